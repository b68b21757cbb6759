"""The status line: one transient line on stderr saying what dg is doing and for how long (loading
the model, the prefill, canvas 1 step 3, ...), from the first second, while no live panel shows it.

A real model on a CPU takes tens of seconds to load, prefill and make its first step; without it
the terminal stays blank. Only on a terminal that can redraw: piped or on TERM=dumb it draws
nothing (the plain status lines stay as they were), and it is gone from the screen when it stops.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any, Optional

from rich.text import Text

from dgcli.cli import _output, _signals

STYLE = "cyan"
# elapsed time is shown once a phase has lasted this long (a fast model's phases would flicker "0 s")
SHOW_ELAPSED_S = 1.0
REFRESH_PER_SECOND = 4


def elapsed_words(since: Optional[float], now: Optional[float] = None) -> str:
    """"  12 s" once `since` is SHOW_ELAPSED_S ago, "  2 min 5 s" past a minute; "" before (or None)."""
    if since is None:
        return ""
    seconds = (time.monotonic() if now is None else now) - since
    if seconds < SHOW_ELAPSED_S:
        return ""
    minutes, rest = divmod(int(seconds), 60)
    return f"  {minutes} min {rest} s" if minutes else f"  {seconds:.0f} s"


def can_show() -> bool:
    """stderr is a terminal that can redraw a line."""
    return _output.stderr.is_terminal and not _output.stderr.is_dumb_terminal


class StatusLine:
    """`with StatusLine() as status: status.show("loading demo")`: what dg does now, with the seconds it
    has taken so far, redrawn a few times a second on stderr. `stop()` takes it off the screen for
    what draws there instead (a live panel on the same terminal, text streamed to it)."""

    def __init__(self, enabled: Optional[bool] = None):
        self.enabled = can_show() if enabled is None else enabled
        self.text, self.since = "", time.monotonic()
        self._stack: Optional[ExitStack] = None

    def __enter__(self) -> "StatusLine":
        self.resume()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def show(self, text: str) -> None:
        """A new phase: its text, its clock from now."""
        self.text, self.since = text, time.monotonic()

    def resume(self) -> None:
        if self.enabled and self._stack is None:
            from dgcli.cli._terminal import live_view

            self._stack = ExitStack()
            self._stack.enter_context(live_view(self, console=_output.stderr, refresh_per_second=REFRESH_PER_SECOND))

    def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def __rich__(self) -> Text:
        if not self.text:
            return Text("")
        stopping = ", stopping after this (Ctrl-C again: now)" if _signals.interrupt_pending() else ""
        return Text(f"{self.text}…{elapsed_words(self.since)}{stopping}", style=STYLE, no_wrap=True,
                    overflow="ellipsis")
