"""Gemma 4's thinking channel in generated text: what the model thought, apart from its answer.

The CLI shows the thinking dimmed or hides it (cli/render.py); the server sends it as
reasoning_content (server/text.py).
"""

from __future__ import annotations

# Gemma 4's thinking channel (Transformers' gemma4 response template): the model opens it with
# `<|channel>thought\n` and closes it with `<channel|>`; the answer follows.
THINK_OPEN = "<|channel>thought"
THINK_CLOSE = "<channel|>"


def split_thinking(text: str) -> tuple[str | None, str]:
    """(thinking, answer). An unclosed thinking channel is all thinking and no answer yet."""
    start = text.find(THINK_OPEN)
    if start < 0:
        return None, text
    before = text[:start]
    rest = text[start + len(THINK_OPEN):].lstrip("\n")
    end = rest.find(THINK_CLOSE)
    if end < 0:
        return rest, before
    return rest[:end].rstrip("\n"), before + rest[end + len(THINK_CLOSE):].lstrip("\n")
