"""Run `dg` in a pseudo-terminal of a given size and read back the final screen, as a person sees it.

pexpect gives the command a real terminal (so Rich takes its live, terminal path); pyte replays
everything written to it on a virtual screen of the same size. `Terminal.screen_text()` is the
screen at the end; `history` holds what scrolled off the top.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field

import pexpect
import pyte

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _default_signals() -> None:
    """In the child: Ctrl-C and SIGTERM act as on a person's terminal, even when the test runner was
    started in the background (a shell without job control starts it with SIGINT ignored, and an
    ignored signal stays ignored across exec)."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def dg_command(*args: str) -> tuple[str, list[str]]:
    """The dg console script of this environment, run from this checkout (PYTHONPATH)."""
    return sys.executable, ["-m", "dgcli.cli", *map(str, args)]


@dataclass
class Terminal:
    columns: int = 80
    rows: int = 24
    child: pexpect.spawn | None = None
    screen: pyte.HistoryScreen = field(init=False)
    stream: pyte.ByteStream = field(init=False)
    raw: bytes = b""

    def __post_init__(self) -> None:
        self.screen = pyte.HistoryScreen(self.columns, self.rows, history=10_000)
        self.screen.set_mode(pyte.modes.LNM)  # a newline returns the carriage, as a tty's onlcr does
        self.stream = pyte.ByteStream(self.screen)

    def spawn(self, *args: str, env: dict | None = None, timeout: float = 120) -> "Terminal":
        """env: more variables, or replacing them (TERM, ...); a None value unsets one (COLUMNS and
        LINES, for a command that must follow the terminal's size as it changes)."""
        exe, argv = dg_command(*args)
        full_env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(self.columns), LINES=str(self.rows),
                        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        full_env.update(env or {})  # may replace TERM
        full_env = {name: value for name, value in full_env.items() if value is not None}
        self.child = pexpect.spawn(exe, argv, env=full_env, dimensions=(self.rows, self.columns), timeout=timeout,
                                   cwd=REPO, preexec_fn=_default_signals)
        return self

    def _feed(self, data: bytes) -> None:
        self.raw += data
        self.stream.feed(data)

    def read_until(self, pattern: str, timeout: float = 120) -> int:
        """Read until `pattern` (a regular expression) has been written."""
        assert self.child is not None
        index = self.child.expect(pattern.encode("utf-8"), timeout=timeout)
        self._feed(self.child.before + (self.child.after if isinstance(self.child.after, bytes) else b""))
        return index

    def drain(self, quiet: float = 0.1) -> None:
        """Feed what the command has written so far: read until it writes nothing for `quiet` seconds."""
        assert self.child is not None
        while True:
            index = self.child.expect([b"(?s).+", pexpect.TIMEOUT, pexpect.EOF], timeout=quiet)
            self._feed(self.child.before + (self.child.after if index == 0 else b""))
            if index != 0:
                return

    def resize(self, columns: int, rows: int | None = None, tell: bool = True) -> None:
        """The window resized as tmux 3 does it (VTE, kitty and xterm.js reflow too; xterm cuts lines):
        fewer rows take the blank rows below the cursor first, then rows at the top into the history;
        then each line longer than the new width rewraps onto more rows (the cursor moves with its
        text) and the screen keeps the last rows, the rows above going into the history (the cursor
        stays on the top row if its own went). Then the command is told (SIGWINCH; tell=False:
        later, `tell_size`, as a command in the middle of a frame learns only after it). What it
        wrote before is drawn at the old size first."""
        assert self.child is not None
        self.drain()
        rows = rows or self.rows
        screen = self.screen
        blank = screen.default_char

        def new_line(cells: dict) -> pyte.screens.StaticDefaultDict:
            line = pyte.screens.StaticDefaultDict(blank)
            line.update(cells)
            return line

        def used(line: dict) -> int:
            return max((x + 1 for x, char in line.items() if char.data != " "), default=0)

        old_lines = [screen.buffer[y] for y in range(screen.lines)]
        cursor_x, cursor_y = screen.cursor.x, screen.cursor.y
        while len(old_lines) > rows and len(old_lines) - 1 > cursor_y and not used(old_lines[-1]):
            old_lines.pop()
        while len(old_lines) > rows:
            screen.history.top.append(old_lines.pop(0))
            cursor_y -= 1
        old_lines += [new_line({}) for _ in range(rows - len(old_lines))]
        lines: list = []
        at = cursor_y
        for y, old in enumerate(old_lines):
            parts = max(-(-used(old) // columns), 1)
            if y == at:
                part = min(cursor_x // columns, parts - 1)
                cursor_x, cursor_y = min(cursor_x - part * columns, columns), len(lines) + part
            for part in range(parts):
                lines.append(new_line({x - part * columns: char for x, char in old.items()
                                       if part * columns <= x < (part + 1) * columns}))
        while len(lines) > rows:
            screen.history.top.append(lines.pop(0))
            cursor_y -= 1
        screen.buffer.clear()
        for y, line in enumerate(lines):
            screen.buffer[y] = line
        screen.lines, screen.columns = rows, columns
        self.rows, self.columns = rows, columns
        screen.set_margins()
        screen.cursor.x, screen.cursor.y = cursor_x, max(cursor_y, 0)
        screen.dirty.update(range(rows))
        if tell:
            self.tell_size()

    def tell_size(self) -> None:
        assert self.child is not None
        self.child.setwinsize(self.rows, self.columns)

    def send(self, text: str) -> None:
        assert self.child is not None
        self.child.send(text)

    def sendintr(self) -> None:
        assert self.child is not None
        self.child.sendintr()

    def wait(self, timeout: float = 300) -> int:
        """Read to the end; the exit status (128 + signal for a signal)."""
        assert self.child is not None
        self.child.expect(pexpect.EOF, timeout=timeout)
        self._feed(self.child.before)
        self.child.close()
        return self.child.exitstatus if self.child.exitstatus is not None else 128 + (self.child.signalstatus or 0)

    def screen_lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def screen_text(self) -> str:
        return "\n".join(self.screen_lines())

    def all_text(self) -> str:
        """Scrolled-off lines and the screen, top to bottom."""
        top = ["".join(line[x].data for x in range(max(line, default=-1) + 1)).rstrip()
               for line in self.screen.history.top]
        return "\n".join(top + self.screen_lines())


def run(*args: str, columns: int = 80, rows: int = 24, env: dict | None = None, timeout: float = 300) -> tuple[int, Terminal]:
    term = Terminal(columns, rows).spawn(*args, env=env, timeout=timeout)
    return term.wait(timeout), term
