"""A multi-turn conversation with DiffusionGemma (`dg chat`), as a library piece.

Each turn renders the whole conversation through the model's chat template, then generates with
`reuse_cache=True`: the KV cache already holds the earlier turns (their prompts and the committed
canvases of their answers), so only what is new since then is prefilled - the end of the last
answer, the turn markers and the new message. Editing the history (`/clear`, `/system`) needs no
special care: the cache keeps only its prefix that still matches.

    session = ChatSession(engine, system="Answer briefly.", seed=7)
    result = session.ask("what is 3+5", on_event=...)     # -> GenerationResult
    outcome = session.command("/system Be terse.")        # the /commands of the prompt
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dgcli.engine.diffusion import prompt_token_ids
from dgcli.engine.rng import SEED_LIMIT, resolve_seed
from dgcli.engine.types import GenerationResult
from dgcli.errors import DgError, check_utf8
from dgcli.params import DiffusionParams

COMMANDS = {
    "/exit": "leave the chat (also /quit, /bye, Ctrl-D)",
    "/clear": "forget the conversation (the system prompt stays)",
    "/system TEXT": "set the system prompt (no TEXT: show it; /system - : remove it)",
    "/help": "this list",
    "//TEXT": "send /TEXT as a message",
}
EXIT_WORDS = ("/exit", "/quit", "/bye")


@dataclass
class CommandOutcome:
    message: str  # what to tell the user
    exit: bool = False
    unknown: bool = False  # no such command: piped, the line was meant as a message and got no answer


class ChatSession:
    """The conversation (chat messages) and its generation settings over one DiffusionEngine."""

    def __init__(self, engine: Any, *, system: str | None = None, params: DiffusionParams | None = None,
                 max_new_tokens: int = 256, seed: int | None = None, parse_special: bool = False,
                 self_cond_top_k: int | None = None):
        self.engine = engine
        self.system = system or None
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.seed = resolve_seed(seed)  # turn i uses seed + i: a whole session replays from one number
        self.parse_special = parse_special
        self.self_cond_top_k = self_cond_top_k
        self.turns: list[tuple[str, str]] = []  # (user text, answer text)

    @property
    def messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.system}] if self.system else []
        for user, answer in self.turns:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return out

    def prompt_ids(self, text: str) -> list[int]:
        """The next turn's prompt: the conversation so far, `text` and the generation prompt."""
        return prompt_token_ids(self.engine.model, self.messages + [{"role": "user", "content": text}],
                                parse_special=self.parse_special)

    def ask(self, text: str, on_event: Callable[[Any], Any] | None = None) -> GenerationResult:
        """One turn. The answer (even a partial one, after Ctrl-C) joins the conversation."""
        if not text.strip():
            raise DgError("empty message")
        check_utf8(text, "the message")
        ids = self.prompt_ids(text)
        self._check_room(len(ids))
        options = {} if self.self_cond_top_k is None else {"self_cond_top_k": self.self_cond_top_k}
        result = self.engine.generate(ids, params=self.params, max_new_tokens=self.max_new_tokens,
                                      seed=(self.seed + len(self.turns)) % SEED_LIMIT, on_event=on_event,
                                      reuse_cache=True, **options)
        self.turns.append((text, result.text))
        return result

    def _check_room(self, n_prompt: int) -> None:
        model = self.engine.model
        n_ctx, canvas = getattr(model, "n_ctx", None), getattr(model, "canvas_length", 1)
        if isinstance(n_ctx, int) and n_prompt + canvas > n_ctx:
            raise DgError(f"the conversation is {n_prompt} tokens; with one {canvas}-token canvas it exceeds the "
                          f"context of {n_ctx} tokens: /clear to start over, or restart with a larger -c/--ctx-size")

    def command(self, line: str) -> CommandOutcome:
        """Run a /command typed at the prompt."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in EXIT_WORDS:
            return CommandOutcome("bye", exit=True)
        if name == "/clear":
            self.turns.clear()
            return CommandOutcome("conversation cleared" + (" (the system prompt stays)" if self.system else ""))
        if name == "/system":
            if not arg:
                return CommandOutcome(f"system prompt: {self.system}" if self.system else "no system prompt")
            try:
                check_utf8(arg, "the system prompt")
            except DgError as err:
                return CommandOutcome(f"{err}; the system prompt is unchanged")
            self.system = None if arg == "-" else arg
            return CommandOutcome("system prompt removed" if self.system is None else "system prompt set")
        if name == "/help":
            return CommandOutcome("\n".join(f"{cmd:<14} {what}" for cmd, what in COMMANDS.items()))
        return CommandOutcome(f"unknown command {name}; /help lists them (//TEXT sends /TEXT as a message)",
                              unknown=True)


def is_command(line: str) -> bool:
    """A /command; `//TEXT` is the message /TEXT (message_text)."""
    text = line.lstrip()
    return text.startswith("/") and not text.startswith("//")


def message_text(line: str) -> str:
    """The message a line sends: `//TEXT` escapes a message that starts with /."""
    text = line.lstrip()
    return text[1:] if text.startswith("//") else line
