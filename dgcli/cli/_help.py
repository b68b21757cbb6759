"""Help pages that fit the terminal: click's plain layout, at the terminal's width (click never goes
below 50 columns, so a 40-column terminal wrapped every line a second time), and under 70 columns
each option on a line of its own with its text below it (beside a 30-column name column there was
room for a word or two per line)."""

from __future__ import annotations

import shutil
from typing import Any, Sequence

try:  # typer >= 0.20 vendors click
    from typer._click.core import Context
    from typer._click.formatting import HelpFormatter, wrap_text
except ImportError:  # pragma: no cover - older typer on real click
    from click.core import Context
    from click.formatting import HelpFormatter, wrap_text

# help is laid out at most this wide (click's default is 80)
MAX_HELP_COLUMNS = 100
# below this width an option's text goes under its name instead of beside it
SIDE_BY_SIDE_HELP_COLUMNS = 70
# an option's text under its name is indented this much more than the name
TEXT_INDENT = 4


class FittedHelpFormatter(HelpFormatter):
    def __init__(self, indent_increment: int = 2, width: int | None = None, max_width: int | None = None):
        if width is None:
            columns = shutil.get_terminal_size().columns
            width = max(min(columns, max_width or MAX_HELP_COLUMNS) - 2, 20)
        super().__init__(indent_increment, width=width, max_width=max_width)

    def write_dl(self, rows: Sequence[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        if self.width + 2 >= SIDE_BY_SIDE_HELP_COLUMNS:
            super().write_dl(rows, col_max, col_spacing)
            return
        indent = self.current_indent + TEXT_INDENT
        for first, second in rows:
            for line in _names_lines(first, self.width - self.current_indent):
                self.write(f"{'':>{self.current_indent}}{line}\n")
            if second:
                for line in wrap_text(second, max(self.width - indent, 10), preserve_paragraphs=True).splitlines():
                    self.write(f"{'':>{indent}}{line}\n")


def _names_lines(names: str, width: int) -> list[str]:
    """An option's names ("-n, --max-new-tokens, --n-predict <int>") on as many lines as the width
    needs, broken after a comma, never inside a name."""
    lines: list[str] = []
    for part in names.split(", "):
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += ", " + part
        else:
            if lines:
                lines[-1] += ","
            lines.append(part)
    return lines


def narrow(formatter: HelpFormatter) -> bool:
    return formatter.width + 2 < SIDE_BY_SIDE_HELP_COLUMNS


def write_commands(group: Any, ctx: Any, formatter: HelpFormatter) -> bool:
    """A narrow page's command list: each command's short help on two lines of its own under its name
    (click cuts it to what is left beside the longest name: "Generate with..."). False: a wide page,
    left to click."""
    if not narrow(formatter):
        return False
    rows = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is not None and not command.hidden:
            text_width = formatter.width - formatter.indent_increment - TEXT_INDENT
            rows.append((name, command.get_short_help_str(limit=2 * text_width)))
    if rows:
        with formatter.section("Commands"):
            formatter.write_dl(rows)
    return True


class FittedHelpContext(Context):
    formatter_class = FittedHelpFormatter


def fit_help(command: Any) -> None:
    """`command`'s help laid out by FittedHelpFormatter."""
    command.context_class = FittedHelpContext
