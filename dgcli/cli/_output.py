"""What dg writes on its standard streams: the two consoles (sized for a pipe or a dumb terminal),
one-line notices on stderr, tables, model text; and the output files a command is asked for.
Other modules read `_output.stdout` / `_output.stderr` through this module, so a test can replace them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import typer
from rich.console import Console

from dgcli.cli import render
from dgcli.outputs import OutputFile


def _pipe_width() -> Optional[int]:
    """Tables stay readable when piped (Rich would otherwise assume 80 columns): COLUMNS, or 120 when
    it is not a positive integer (as Rich, which ignores such a value)."""
    if sys.stdout.isatty():
        return None
    columns = os.environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isascii() and columns.isdigit() and int(columns) > 0 else 120


def _dumb_terminal_size(stream: Any) -> tuple[Optional[int], Optional[int]]:
    """(columns, lines) of a dumb terminal (TERM=dumb or unknown, as Rich tells one) that `stream` is,
    else (None, None): Rich takes such a terminal for 80x25 whatever its size and COLUMNS say, and
    lines laid out for 80 columns are broken up by a narrower terminal's wrapping."""
    if os.environ.get("TERM", "").lower() not in ("dumb", "unknown"):
        return None, None
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # not a terminal
        return None, None
    columns, lines = os.environ.get("COLUMNS", ""), os.environ.get("LINES", "")  # checked by cli
    return (int(columns) if columns.isdigit() else size.columns) or 80, (int(lines) if lines.isdigit() else size.lines) or 25


_PIPE_WIDTH = _pipe_width()
_STDOUT_DUMB, _STDERR_DUMB = _dumb_terminal_size(sys.stdout), _dumb_terminal_size(sys.stderr)
stdout = Console(highlight=False, width=_PIPE_WIDTH or _STDOUT_DUMB[0], height=_STDOUT_DUMB[1])
stderr = Console(stderr=True, highlight=False, width=_STDERR_DUMB[0], height=_STDERR_DUMB[1])


def notice(text: str, style: Optional[str] = None) -> None:
    """A line on stderr: word-wrapped at a terminal's width (a terminal cuts words), one line when piped
    (for logs and grep)."""
    _end_text_line()
    stderr.print(text, style=style, markup=False, highlight=False, soft_wrap=not stderr.is_terminal)


def print_table(table: Any, console: Optional[Console] = None) -> None:
    """A Rich table on stdout (or `console`): on a terminal as Rich lays it out; piped, its title and
    caption each one line of their own, for logs and grep (Rich centres both on the table's width,
    padding them with spaces, and wraps a caption at that width)."""
    console = console or stdout
    if console.is_terminal:
        console.print(table)
        return
    title, caption = table.title, table.caption
    table.title = table.caption = None
    try:
        if title:
            console.print(title, soft_wrap=True)  # markup-escaped text, or a Text
        console.print(table)
        if caption:
            console.print(caption, soft_wrap=True)
    finally:
        table.title, table.caption = title, caption


def echo_text(text: str, *, nl: bool = True, err: bool = False) -> None:
    """Model text (an answer, a replayed trace's) on stdout or stderr: as it is into a pipe or a file,
    which may want every byte (color=True: click would strip what looks like a color code from it); on
    a terminal with its control characters shown as U+FFFD, as the live view shows them, so that the
    text cannot move the cursor, clear the screen or retitle the window."""
    stream = sys.stderr if err else sys.stdout
    if stream is not None and stream.isatty():
        text = render.printable(text)
    typer.echo(text, nl=nl, err=err, color=True)
    if text or nl:
        _mid_line["stderr" if err else "stdout"] = not (nl or text.endswith("\n"))


# echo_text left that stream in the middle of a line (plain streaming writes each canvas's text as
# it is final, without a newline): a notice starts a line of its own (see _end_text_line)
_mid_line = {"stdout": False, "stderr": False}


def _end_text_line() -> None:
    """Before a notice on stderr: end the line that streamed text left open where the notice would
    follow it: on stderr, or on the terminal, where stdout's text shows too (directly, or through
    `| cat`, `| tee`), or in the one file or pipe both streams go to (`> run.log 2>&1`, `2>&1 | cat`);
    stdout keeps its bytes. A status line must start at the left edge, not after the text."""
    if _mid_line["stderr"] or (_mid_line["stdout"] and (stderr.is_terminal or _one_stream())):
        typer.echo("", err=True)
    _mid_line.update(stdout=False, stderr=False)


def _one_stream() -> bool:
    """stdout and stderr are the same open file or pipe (`2>&1`)."""
    try:
        sys.stdout.flush()
        return os.path.sameopenfile(sys.stdout.fileno(), sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptors (a test runner's buffers)
        return False


def output_file(path: Optional[Path], *, force: bool, inputs: Sequence[Optional[Path]], what: str) -> Optional[OutputFile]:
    """An output path checked before any work starts (None: not asked for); see dgcli.outputs."""
    if path is None:
        return None
    return OutputFile(path, force=force, inputs=[p for p in inputs if p is not None], what=what)
