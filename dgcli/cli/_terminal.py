"""The terminal under a live view: keys not echoed, Ctrl-C deferred while a frame is drawn, Ctrl-Z
and resizes survived (a Rich Live drawn from its top-left corner with autowrap off), and the
pacing of redraws.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from rich.console import Console, ConsoleOptions, RenderResult
from rich.control import Control
from rich.live import Live
from rich.live_render import LiveRender
from rich.segment import ControlType, Segment

from dgcli.cli import _output, _signals

LIVE_REFRESH_S = 1 / 15


class Throttle:
    def __init__(self, interval: float = LIVE_REFRESH_S):
        self.interval, self.last = interval, 0.0

    def ready(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force or now - self.last >= self.interval:
            self.last = now
            return True
        return False


class Pacer:
    """--pace: each denoising step stays on screen at least `seconds` (the demo is too fast to watch)."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self.last = seconds, None

    def wait(self) -> None:
        if self.seconds <= 0:
            return
        now = time.monotonic()
        if self.last is not None and now - self.last < self.seconds:
            time.sleep(self.seconds - (now - self.last))
        self.last = time.monotonic()


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Ctrl-C waits until the block is done: a live frame is drawn whole, so stopping the live view
    erases exactly what it drew, and no line of a half-drawn frame stays on screen."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            raise KeyboardInterrupt


@contextmanager
def echo_off() -> Iterator[Optional[tuple[int, Any]]]:
    """No echo of typed keys while a live view is drawn: the terminal's `^C` (or any key) would move
    the cursor under the live view, and stopping it would then erase one line too few, leaving a
    line of the panel behind. SIGTERM still restores the terminal (and the cursor, through the
    live view's own cleanup). Yields (fd, the settings without echo), or None: no terminal."""
    fd, saved = _terminal_settings()
    if saved is None:
        yield None
        return
    import termios

    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    previous_term = signal.getsignal(signal.SIGTERM)
    if previous_term is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    _signals.terminal_settings.append((fd, saved))  # a signal that exits at once restores them too
    try:
        yield fd, quiet
    finally:
        _signals.terminal_settings.remove((fd, saved))
        if _signals.in_foreground(fd):  # from the background (Ctrl-Z, `bg`) it would stop dg (SIGTTOU)
            termios.tcsetattr(fd, termios.TCSANOW, saved)
        if previous_term is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _terminal_settings() -> tuple[int, Any]:
    """The terminal's file descriptor (stdin's, else stdout's) and its termios settings, or (-1, None)."""
    try:
        import termios
    except ImportError:
        return -1, None
    for stream in (sys.stdin, sys.stdout):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return fd, termios.tcgetattr(fd)
        except (AttributeError, OSError, ValueError):
            continue
    return -1, None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# DECAWM: a line longer than the terminal is cut at its right edge instead of wrapping onto the next
# row. Under a live view, a frame drawn for the width from before a resize (dg learns of the new one a
# moment later) then still takes as many rows as it has lines, and the next frame erases it whole.
NO_AUTOWRAP, AUTOWRAP = "\x1b[?7l", "\x1b[?7h"

# The cursor's line and every line below it erased: deleted (DL), as many as the screen has. Not CSI J:
# from the top-left corner tmux takes that for a clear screen and keeps the screen in its history.
ERASE_BELOW = "\r\x1b[9999M"


class _AnchoredRender(LiveRender):
    """Rich's live region with the cursor left at its top-left corner between frames.

    Rich leaves the cursor after a frame's last line and erases the frame by going up as many lines
    as it drew. A terminal made narrower rewraps those lines (tmux, VTE, kitty, xterm.js reflow each
    line longer than the new width onto more rows; xterm cuts them): the count no longer matches, and
    the top of the frame on screen stayed above every later one. The start of a line stays the start
    of a line however a terminal resizes, and the cursor moves with it: each frame is drawn from
    there over whatever is below (ERASE_BELOW), then the cursor goes back there.
    `anchor` False (the last frame, when the live view stops): the cursor stays after it, as Rich's."""

    anchor = True
    _at_top = False

    def position_cursor(self) -> Control:
        return _codes(ERASE_BELOW) if self._shape is not None and self._at_top else super().position_cursor()

    def restore_cursor(self) -> Control:
        return _codes(ERASE_BELOW) if self._shape is not None and self._at_top else super().restore_cursor()

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from super().__rich_console__(console, options)
        height = self._shape[1] if self._shape else 0  # last_render_height, which Rich 13.0 lacks
        self._at_top = self.anchor and height > 0
        down = f"\x1b[{height - 1}B" if self._at_top and height > 1 else ""
        _signals.live_view_exit[0] = (down + AUTOWRAP).encode()
        if self._at_top:
            yield Control(ControlType.CARRIAGE_RETURN, *([(ControlType.CURSOR_UP, height - 1)] if height > 1 else []))

    def leave(self) -> Control:
        """The cursor after the frame's last line (where Rich's own would be), autowrap on: the
        terminal as the shell wants it at a Ctrl-Z."""
        width, height = self._shape or (0, 0)
        moves = [(ControlType.CURSOR_DOWN, height - 1)] if self._at_top and height > 1 else []
        if self._at_top:
            moves.append((ControlType.CURSOR_MOVE_TO_COLUMN, width))
        self._at_top = False
        return Control(*moves) if moves else Control()


def _codes(text: str) -> Control:
    """Control codes Rich has no name for (delete lines, autowrap), written as they are, only to a
    terminal."""
    control = Control()
    control.segment = Segment(text, None, [(ControlType.CARRIAGE_RETURN,)])
    return control


class _AnchoredLive(Live):
    """Rich's Live, drawn by an _AnchoredRender with autowrap off: it survives the terminal's resizing."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._live_render = _AnchoredRender(self.get_renderable(), vertical_overflow=self.vertical_overflow)

    def start(self, refresh: bool = False) -> None:
        _signals.live_view_exit[0] = AUTOWRAP.encode()
        self.console.control(_codes(NO_AUTOWRAP))
        super().start(refresh)

    def stop(self) -> None:
        self._live_render.anchor = False  # the last frame ends where Rich's does: stop erases it from there
        try:
            super().stop()
        finally:
            self.console.control(_codes(AUTOWRAP))
            _signals.live_view_exit[0] = b""


def anchored(progress: Any) -> Any:
    """A Rich Progress whose bars are drawn as the live views are (_AnchoredLive): a terminal made
    narrower rewraps a full-width bar onto two rows, which Rich's own redraw would not erase."""
    live = progress.live
    progress.live = _AnchoredLive(console=live.console, auto_refresh=live.auto_refresh,
                                  refresh_per_second=live.refresh_per_second, transient=live.transient,
                                  redirect_stdout=live._redirect_stdout, redirect_stderr=live._redirect_stderr,
                                  get_renderable=progress.get_renderable)
    return progress


@contextmanager
def live_view(renderable: Any) -> Iterator[Live]:
    """A transient Rich Live on stdout (auto-refresh off: the caller refreshes), keys not echoed, that
    a resized terminal does not leave old frames of (_AnchoredRender). Ctrl-Z stops it with the
    terminal given back to the shell; `fg` draws it again (_signals.suspend)."""
    with echo_off() as quiet:
        live = _AnchoredLive(renderable, console=_output.stdout, auto_refresh=False, transient=True)
        live.start()
        try:
            with _signals.suspendable(_suspended_live(live, quiet)):
                yield live
        finally:
            live.stop()


def _suspended_live(live: Live, quiet: Optional[tuple[int, Any]]) -> Callable[[], Any]:
    """What a live view does around a Ctrl-Z stop: no frame drawn while the shell has the terminal;
    on `fg`, echo off and the cursor hidden again, and a new frame below the shell's lines (the one
    from before the stop stays where it was: erasing it would erase the shell's lines instead)."""
    @contextmanager
    def hold() -> Iterator[None]:
        with live._lock:
            anchored = isinstance(live._live_render, _AnchoredRender) and live.is_started
            if anchored:  # the shell's lines go below the frame, and wrap
                live.console.control(live._live_render.leave(), _codes(AUTOWRAP))
            yield
            if not live.is_started:  # it ended while the stop waited for it: the terminal is given back
                return
            live._live_render._shape = None
            if not _signals.in_foreground(quiet[0] if quiet is not None else 1):
                return  # continued in the background (`bg`, `kill %1`): the terminal stays the shell's
            if quiet is not None:
                import termios

                termios.tcsetattr(quiet[0], termios.TCSANOW, quiet[1])
            live.console.show_cursor(False)
            if anchored:
                live.console.control(_codes(NO_AUTOWRAP))
            live.refresh()
    return hold


def refresh(live: Live) -> None:
    with sigint_deferred():
        live.refresh()


def use_live(no_live: bool, json_out: bool) -> bool:
    """A live view when stdout is a terminal that can redraw: on TERM=dumb (or unknown) Rich's Live
    draws nothing until it stops, so the plain status lines show the progress instead."""
    return not (no_live or json_out) and _output.stdout.is_terminal and not _output.stdout.is_dumb_terminal
