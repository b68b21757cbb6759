"""A GGUF's chat template: rendered by llama-cpp-python's Jinja2ChatFormatter, split into the
template's own text and the messages' text, so that only the former is parsed for control tokens.
The template is a program from the file: it runs in a limited child process (sandbox.py).

Text a user types (or pipes in from elsewhere) may hold the text of a control token: `<turn|>`,
`<eos>`, `<|turn>model`. Tokenized with special parsing, that text would close the user's turn and
forge one of the model's. So the template is rendered twice, once with each message's content
replaced by a sentinel (the template's structure) and once for real; walking both side by side
says which characters of the prompt came from which message, even when the template trims the
content. The structure is then tokenized with special parsing, user and system text without it,
and the model's own earlier answers with it (they came from its tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from dgcli.errors import DgError
from dgcli.templates.sandbox import ChatTemplateError, ChatTemplateParseError, render_chat_template

# Private-use characters: a sentinel cannot be confused with text a template writes.
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")

STRUCTURE = "structure"


@dataclass(frozen=True)
class Segment:
    text: str
    role: str  # STRUCTURE, or the role of the message the text came from

    @property
    def parse_special(self) -> bool:
        """Control-token text is honoured in the template's own text and in the model's answers."""
        return self.role in (STRUCTURE, "assistant")


class ChatTemplate:
    """One chat template (a Jinja2 string) with its bos/eos token texts."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "", name: str = "the model"):
        self.template, self.bos_token, self.eos_token, self.name = template, bos_token, eos_token, name

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None) -> str:
        return render_chat_template(self.template, messages=[dict(m) for m in messages],
                                    add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                                    eos_token=self.eos_token, source=self.name,
                                    tools=list(tools) if tools else None)

    def renders_tools(self) -> bool:
        """Whether the template writes the tools it is given into the prompt (one that ignores them
        would leave the model unaware of them)."""
        probe = [{"type": "function", "function": {"name": "dg_probe_tool", "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        messages = [{"role": "user", "content": "hello"}]
        try:
            return self.render(messages, tools=probe) != self.render(messages)
        except ChatTemplateError:
            return False

    def check(self) -> None:
        """ChatTemplateParseError now when the template does not parse (every render would fail); a
        template that fails only on some messages (e.g. a lone user message) passes."""
        try:
            self.render([{"role": "user", "content": "hello"}])
        except ChatTemplateParseError:
            raise
        except ChatTemplateError:
            pass

    def segments(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                 tools: Sequence[dict] | None = None) -> list[Segment] | None:
        """The rendered prompt as consecutive segments of structure and message text, or None when the
        template rewrites message text beyond trimming it (the split is then unknown). Tool
        declarations and earlier tool calls are structure; tool results are message text."""
        messages = [dict(m) for m in messages]
        for m in messages:
            check_message(m)
        full = self.render(messages, add_generation_prompt, tools)
        if any("\ue000" in m["content"] for m in messages):
            return None
        # an empty content stays empty: templates test it (an assistant turn of tool calls only)
        skeleton = self.render([dict(m, content=_SENTINEL.format(i)) if m["content"] else m
                                for i, m in enumerate(messages)], add_generation_prompt, tools)
        pieces = _SENTINEL_RE.split(skeleton)  # structure, index, structure, index, ..., structure
        if not full.startswith(pieces[0]):
            return None
        out = [Segment(pieces[0], STRUCTURE)]
        pos = len(pieces[0])
        for index_text, after in zip(pieces[1::2], pieces[2::2]):
            message = messages[int(index_text)]
            text = _match_content(full, pos, message, after)
            if text is None:
                return None
            out += [Segment(text, message["role"]), Segment(after, STRUCTURE)]
            pos += len(text) + len(after)
        if pos != len(full):
            return None
        return [s for s in out if s.text]


def check_message(message: dict) -> None:
    if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
        raise DgError(f"a chat message needs a string role and content, got {message!r:.80}")


def _match_content(full: str, pos: int, message: dict, after: str) -> str | None:
    """The text the template wrote for `message` at `pos`, followed by the structure `after`."""
    content = message["content"]
    for candidate in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip())):
        if full.startswith(candidate, pos) and full.startswith(after, pos + len(candidate)):
            return candidate
    if message["role"] == "assistant" and after:
        # The model's own earlier answer, rewritten (e.g. its thinking dropped): its text is parsed
        # like the structure anyway, so the next structure piece bounds it.
        end = full.find(after, pos)
        return full[pos:end] if end >= 0 else None
    return None


def tokenize_chat(template: ChatTemplate, messages: Sequence[dict], tokenize: Callable[[str, bool], list[int]],
                  *, add_generation_prompt: bool = True, parse_special: bool = False,
                  tools: Sequence[dict] | None = None) -> list[int]:
    """The prompt's token ids: `tokenize(text, special)` over each segment. parse_special=True parses
    control-token text in user and system messages too (for experts: it lets text forge turns)."""
    segments = template.segments(messages, add_generation_prompt, tools)
    if segments is None:
        user_texts = [m["content"] for m in messages if m["role"] != "assistant" and m["content"]]
        if not parse_special and any(tokenize(t, True) != tokenize(t, False) for t in user_texts):
            raise DgError(f"the chat template of {template.name} rewrites message text, so the control-token "
                          "text in your message cannot be kept literal; remove it, or pass --parse-special "
                          "to let it act as control tokens")
        return tokenize(template.render(messages, add_generation_prompt, tools), True)
    ids: list[int] = []
    for segment in segments:
        ids += tokenize(segment.text, parse_special or segment.parse_special)
    return ids
