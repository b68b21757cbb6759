"""How the dg process ends on signals.

The first Ctrl-C stops the work in progress and prints what it produced (exit 130; `dg chat` stops
the answer and goes on, see `interrupt_handled`): the engines return their partial result (see
`dgcli.runtime.native.deferred_interrupts`). Beyond that:
- a second Ctrl-C exits at once (130);
- SIGTERM and SIGHUP exit at once (143 and 129);
each after removing the temporary files of unfinished outputs (`dgcli.outputs`) and showing the
terminal's cursor again (a live view hides it). Ctrl-Z under a live view (`suspend`) gives the shell
its terminal back (echo on, cursor shown) before the process stops; `fg` resumes the view.

Python runs signal handlers in the main thread between bytecodes, which can be seconds away while a
forward of a large model runs. Its C-level handler also writes each signal's number to a wakeup fd
at once: a thread reading that fd acts without waiting for the main thread (ctypes releases the GIL
during native calls).

Only the standard library is imported here: `quiet_startup()` runs before dg's heavier imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable, ContextManager

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
SHOW_CURSOR = b"\x1b[?25h"
# (fd, termios settings) a live view changed (echo off) and gives back when it ends; restored on exit too
terminal_settings: list[tuple[int, Any]] = []
# what gives the terminal back from a live view: autowrap on, the cursor from where the view left it
# (its top line) to its last line (an exit at once leaves the frame on screen, the shell's prompt after it)
live_view_exit = [b""]
# held around a stop for Ctrl-Z (see suspend): a live view draws nothing meanwhile and takes the
# terminal again when the process continues
on_suspend: list[Callable[[], ContextManager]] = []


def exit_now(code: int) -> None:
    """Remove unfinished outputs' temporaries, give the terminal its settings and cursor back, and exit."""
    try:
        outputs = sys.modules.get("dgcli.outputs")  # no import here: the main thread may hold the import lock
        if outputs is not None:
            outputs.remove_temporaries()
    finally:
        _give_terminal_back(live_view_exit[0] + b"\n" + SHOW_CURSOR)
        os._exit(code)


def _give_terminal_back(cursor: bytes) -> None:
    """The terminal settings a live view changed, and `cursor` (showing it) written to the terminal;
    not from the background (after Ctrl-Z, `kill %1` continues the process there), where the shell
    has the terminal and the attempt would stop the process again (SIGTTOU)."""
    termios = sys.modules.get("termios")  # loaded by whoever saved settings
    for fd, saved in list(terminal_settings):
        try:
            if in_foreground(fd):
                termios.tcsetattr(fd, termios.TCSANOW, saved)
        except Exception:  # noqa: BLE001 (termios.error is no OSError: a terminal that hung up, SIGHUP)
            pass
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                if in_foreground(fd):
                    os.write(fd, cursor)
                break
        except OSError:
            pass


def in_foreground(fd: int) -> bool:
    """This process is in the foreground of the terminal `fd` (False for a terminal that hung up)."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


def suspend() -> None:
    """Ctrl-Z (SIGTSTP) under a live view: the shell gets the terminal as it gave it (echo on, the
    cursor shown), then the process stops; when it continues (`fg`), each `on_suspend` holder takes
    the terminal again. SIGSTOP (only the main thread may reset SIGTSTP's handler), sent to this thread:
    it stops before the call returns, where one sent to the process may let the thread run on a little."""
    with contextlib.ExitStack() as held:
        for hold in list(on_suspend):
            try:
                held.enter_context(hold())
            except Exception:  # noqa: BLE001 (a view that cannot be held must not keep the process from stopping)
                pass
        _give_terminal_back(SHOW_CURSOR)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _quit(signum: int, _frame: Any) -> None:
    exit_now(EXIT_CODES[signum])


def _acted_on_by_the_watcher(_signum: int, _frame: Any) -> None:
    pass


_interrupts = [0]  # SIGINTs seen by the watcher
_acting = [True]  # False once a command handles signals itself (hand_over)
_replaced: dict[int, Any] = {}  # the handlers install() replaced
_wakeup: list[socket.socket] = []  # kept open for the life of the process


def _watch(reader: socket.socket) -> None:
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        for signum in data:
            if signum == signal.SIGINT:
                _interrupts[0] += 1
                if _interrupts[0] < 2:
                    continue  # the first one stops the work in the main thread
            if signum in EXIT_CODES and _acting[0]:
                exit_now(EXIT_CODES[signum])
            if signum == signal.SIGTSTP and _acting[0]:
                try:
                    suspend()
                except Exception:  # noqa: BLE001 (the watcher must outlive a failed resume)
                    pass


def install() -> None:
    """For the rest of the process: a second Ctrl-C, SIGTERM or SIGHUP exit at once (module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return
    reader, writer = socket.socketpair()
    _wakeup[:] = [reader, writer]
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:  # a signal ignored (nohup) stays ignored
            _replaced[s] = signal.signal(s, _acted_on_by_the_watcher)
    threading.Thread(target=_watch, args=(reader,), name="dg-signals", daemon=True).start()


def hand_over() -> None:
    """The command handles its signals itself from now on (dg serve: uvicorn's graceful shutdown);
    what it does not handle does what it did before install()."""
    _acting[0] = False
    for s, handler in _replaced.items():
        signal.signal(s, handler)


@contextlib.contextmanager
def suspendable(hold: Callable[[], ContextManager]) -> Any:
    """Within: Ctrl-Z stops the process through `suspend`, `hold` held around the stop. Only where the
    watcher runs and SIGTSTP does what it does by default (an ignored one stays ignored)."""
    on_suspend.append(hold)
    previous = None
    if (_wakeup and _acting[0] and hasattr(signal, "SIGTSTP")
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTSTP) is signal.SIG_DFL):
        previous = signal.signal(signal.SIGTSTP, _acted_on_by_the_watcher)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTSTP, previous)
        on_suspend.remove(hold)


def interrupt_pending() -> bool:
    """A Ctrl-C has arrived that the main thread has not acted on yet (it may be inside a long
    forward): a live view can say the work stops after it."""
    return _interrupts[0] > 0


def interrupt_handled() -> None:
    """The main thread has acted on the Ctrl-C so far (`dg chat` stopped one answer and goes on):
    the next Ctrl-C is a first one again, not a second."""
    _interrupts[0] = 0


def finishing() -> None:
    """The command is done: any Ctrl-C from now on exits at once, never as a traceback during exit."""
    _interrupts[0] = max(_interrupts[0], 1)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _acted_on_by_the_watcher)


class quiet_startup:
    """Ctrl-C while dg's modules load (a second or so) exits with 130 instead of a traceback."""

    def __enter__(self) -> "quiet_startup":
        self.changed = (threading.current_thread() is threading.main_thread()
                        and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if self.changed:
            signal.signal(signal.SIGINT, _quit)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.changed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
