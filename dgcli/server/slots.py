"""Which request owns which KV-cache sequence in `dg serve`'s scheduler.

Request i of the layout owns sequence i. The multi-sequence forward decodes canvas i after
sequence i, so the requests whose canvases are being denoised must own sequences 0..d-1; after
them come the one long prompt being prefilled in chunks (at most one), then the grammar-constrained
decodes (one token per iteration each, through the encoder). Each group is contiguous:

    [ denoising 0..d-1 ][ prefilling ][ decoding ... ]

Removing a request or making room for one moves at most one request per later group (a KV-cache
sequence copy, `model.move_sequence`), never more.
"""

from __future__ import annotations

from typing import Any, Callable

DENOISING, PREFILLING, DECODING = 0, 1, 2
STAGES = (DENOISING, PREFILLING, DECODING)


class SlotLayout:
    """The requests in KV-cache sequence order; each has a `stage` attribute set here."""

    def __init__(self, move: Callable[[int, int], None], clear: Callable[[int], None]):
        self._move, self._clear = move, clear
        self.requests: list[Any] = []

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request: Any) -> bool:
        return any(r is request for r in self.requests)

    def index(self, request: Any) -> int:
        for i, r in enumerate(self.requests):
            if r is request:
                return i
        raise ValueError("request not in the layout")

    def stage(self, stage: int) -> list[Any]:
        return [r for r in self.requests if r.stage == stage]

    def _bounds(self) -> dict[int, tuple[int, int]]:
        """[start, end) of each stage's positions."""
        bounds, start = {}, 0
        for stage in STAGES:
            end = start + sum(1 for r in self.requests if r.stage == stage)
            bounds[stage], start = (start, end), end
        return bounds

    def _relocate(self, src: int, dst: int) -> None:
        self._move(src, dst)
        self.requests[dst] = self.requests[src]

    def insert(self, request: Any, stage: int) -> int:
        """Place `request` at the end of `stage` and return its sequence (cleared). Needs a free
        sequence: each later stage moves its first request to the position after its last."""
        bounds = self._bounds()
        hole = len(self.requests)
        self.requests.append(None)
        for later in reversed(STAGES[stage + 1:]):
            start, end = bounds[later]
            if start < end:  # hole == end here: the stages after this one have moved up already
                self._relocate(start, hole)
                hole = start
        self._clear(hole)
        request.stage = stage
        self.requests[hole] = request
        return hole

    def remove(self, request: Any) -> None:
        """Drop `request` and free its sequence; the last request of its stage takes its place, and
        each later stage moves its last request into the gap left before it."""
        bounds = self._bounds()
        hole = self.index(request)
        self._clear(hole)
        end = bounds[request.stage][1]
        if hole != end - 1:
            self._relocate(end - 1, hole)
            hole = end - 1
        for later in STAGES[request.stage + 1:]:
            start, end = bounds[later]
            if start < end:  # the stage starts right after the hole: its last request fills it
                self._relocate(end - 1, hole)
                hole = end - 1
        del self.requests[hole]

    def promote(self, request: Any, stage: int) -> None:
        """The prefilling request (there is only one) moves on to `stage` without moving: it sits
        at the end of the denoising requests and right before the decoding ones."""
        if request.stage != PREFILLING or stage == PREFILLING:
            raise ValueError("only the prefilling request is promoted")
        request.stage = stage

    def check(self) -> None:
        """The invariant: stages in order, at most one prefilling request."""
        stages = [r.stage for r in self.requests]
        if stages != sorted(stages) or stages.count(PREFILLING) > 1:
            raise AssertionError(f"slot layout out of order: {stages}")
