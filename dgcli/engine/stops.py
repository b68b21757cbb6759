"""Stop strings (llama-cli's -r/--reverse-prompt, llama-server's `stop`): the answer ends where one
first appears, the string itself left out."""

from __future__ import annotations

from typing import Callable, Sequence


def first_stop(text: str, stops: Sequence[str]) -> int:
    """Where the first of `stops` begins in `text`; -1 when none is there."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


def tokens_before(ids: Sequence[int], detokenize: Callable[[list[int]], str], cut: int) -> int:
    """The most leading tokens whose text ends at or before character `cut` (a stop string that
    begins inside a token leaves that token out: the answer's text keeps its first characters)."""
    lo, hi = 0, len(ids)
    while lo < hi:  # the text of a prefix only grows with it
        mid = (lo + hi + 1) // 2
        if len(detokenize(list(ids[:mid]))) <= cut:
            lo = mid
        else:
            hi = mid - 1
    return lo


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string that the next
    text completes: what text streamed as it comes must hold back."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
