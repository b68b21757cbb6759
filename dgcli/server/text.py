"""Committed canvases -> the text an OpenAI client receives, incrementally.

Diffusion commits a canvas at a time; its text is appended to what the client has. For chat, Gemma
4's thinking channel (`<|channel>thought ... <channel|>`, engine/thinking.py) goes out as
`reasoning_content` and the rest as `content`, the way OpenAI-compatible servers return a
reasoning model's output. `stop` strings cut the content (and end the request after that canvas).

Text that a later canvas could still change is held back until it cannot: a trailing incomplete
UTF-8 character, the start of a channel marker or a stop string, and the newlines that end an
open thinking channel (split_thinking strips them once it closes). So every delta only appends,
and the deltas add up to exactly what the whole text gives at the end.
"""

from __future__ import annotations

from typing import Callable, Sequence

from dgcli.engine.stops import held_back
from dgcli.engine.thinking import THINK_CLOSE, THINK_OPEN, split_thinking

REPLACEMENT_CHAR = "\ufffd"  # what detokenizing a cut UTF-8 sequence ends with


class AnswerStream:
    """Feeds on committed token ids; gives (reasoning delta, content delta) pairs."""

    def __init__(self, detokenize: Callable[[list[int]], str], stop: Sequence[str] = (), thinking: bool = True):
        self.detokenize = detokenize
        self.stop = [s for s in stop if s]
        self.thinking = thinking
        self.ids: list[int] = []
        self.reasoning = ""  # sent so far
        self.content = ""
        self.stopped = False  # a stop string was found: nothing more is sent
        # then: the answer's tokens up to the one that completes the stop string, what usage counts (as
        # llama-server does; the rest of that canvas was denoised but is never sent)
        self.stop_tokens: int | None = None

    def feed(self, token_ids: Sequence[int]) -> tuple[str, str]:
        self.ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """Everything held back (the generation is over)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        if self.stopped:
            return "", ""
        text = self.detokenize(self.ids) if self.ids else ""
        if not final:
            text = text[:len(text) - self._unsettled_tail(text)]
        reasoning, content = split_thinking(text) if self.thinking else (None, text)
        reasoning = reasoning or ""
        if self.thinking and not final and THINK_OPEN in text and THINK_CLOSE not in text.split(THINK_OPEN, 1)[1]:
            reasoning = reasoning.rstrip("\n")  # split_thinking drops these once the channel closes
        cut = self._stop_at(content)
        if cut >= 0:
            content, self.stopped = content[:cut], True
            self.stop_tokens = self._tokens_through_stop()
        return self._delta("reasoning", reasoning), self._delta("content", content)

    def _stop_at(self, content: str) -> int:
        return min((i for i in (content.find(s) for s in self.stop) if i >= 0), default=-1)

    def _tokens_through_stop(self) -> int:
        """The fewest leading tokens whose text holds a stop string in its content."""
        def holds(k: int) -> bool:
            text = self.detokenize(self.ids[:k])
            return self._stop_at(split_thinking(text)[1] if self.thinking else text) >= 0

        lo, hi = 1, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
        return lo

    def _delta(self, name: str, now: str) -> str:
        sent = getattr(self, name)
        if not now.startswith(sent):
            return ""  # cannot happen with the hold-back above; never take back what a client has
        setattr(self, name, now)
        return now[len(sent):]

    def _unsettled_tail(self, text: str) -> int:
        """How many trailing characters a later canvas could still change."""
        n = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
        body = text[:len(text) - n]
        patterns = ([THINK_OPEN, THINK_CLOSE] if self.thinking else []) + self.stop
        return n + held_back(body, patterns)
