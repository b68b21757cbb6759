"""`dg`: the Typer app. Each command is a thin function in `dgcli/cli/commands/` (parse, call the
library, render); this module only assembles them and turns usage errors into one line."""

from __future__ import annotations

from dgcli.cli import _signals


def _reopen_closed_standard_streams() -> None:
    """A standard stream the caller closed (`<&-`, `>&-`, `2>&-`) is /dev/null for dg. Python leaves
    sys.stdin/stdout/stderr None then, which fails at the first use, and the next file dg opens must not
    take the free descriptor: llama.cpp's log and the status lines would be written into it."""
    import os
    import sys

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False, encoding="utf-8", errors="surrogateescape"))


def _utf8_standard_streams() -> None:
    """Under the C/POSIX locale without Python's UTF-8 mode (LC_ALL=C PYTHONUTF8=0) the standard streams
    are ASCII, which cannot carry an answer, the live view's ⟨end⟩ and ▪, or a message typed in UTF-8
    at `dg chat`'s prompt. They read and write UTF-8 then, as click's echo already does on such a
    stream (and Python's UTF-8 mode would), each keeping its error handler."""
    import codecs
    import sys

    for name in ("stdin", "stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            ascii_only = codecs.lookup(getattr(stream, "encoding", None) or "utf-8").name == "ascii"
        except LookupError:
            continue
        if ascii_only and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors=stream.errors)


# The most columns or lines dg takes COLUMNS or LINES to mean.
MAX_TERMINAL_CELLS = 10_000


def _terminal_size_variables() -> None:
    """COLUMNS and LINES that are no terminal's size are ignored, as Rich ignores a word there: a digit
    that is not ASCII (COLUMNS=², which Rich's int() cannot read), 0, or more than MAX_TERMINAL_CELLS
    (Rich pads each line of a live view to that width, so a billion would take gigabytes). Rich then
    asks the terminal (piped: see _output._pipe_width)."""
    import os

    for name in ("COLUMNS", "LINES"):
        value = os.environ.get(name)
        if value is not None and not (value.isascii() and value.isdigit() and 0 < int(value) <= MAX_TERMINAL_CELLS):
            del os.environ[name]


_reopen_closed_standard_streams()
_utf8_standard_streams()
_terminal_size_variables()

with _signals.quiet_startup():
    import sys
    from typing import Any

    import typer
    from typer.core import TyperGroup

    try:  # typer >= 0.20 vendors click
        from typer._click.exceptions import ClickException
    except ImportError:  # pragma: no cover - older typer on real click
        from click.exceptions import ClickException

    from dgcli.cli.commands import bench, chat, compare, convert, generate, info, list_models, pull, replay, serve, worker


def _flags_without_metavar(command: Any) -> None:
    """Help shows `--json`, not `--json <bool>` as if the flag took a value (help options included)."""
    for param in command.params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    get_help_option = command.get_help_option

    def help_option(ctx: Any) -> Any:
        option = get_help_option(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option

    command.get_help_option = help_option


class _OneLineErrors(TyperGroup):
    """Usage errors as one `error: ...` line on stderr instead of a help box; flags shown as flags."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for command in [self, *self.commands.values()]:
            _flags_without_metavar(command)

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except ClickException as err:
            typer.echo(f"error: {err.format_message()}", err=True)
            code = err.exit_code
        except typer.Abort:
            typer.echo("aborted", err=True)
            code = 1
        else:
            code = rv if isinstance(rv, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=_OneLineErrors,
    name="dg",
    help="Run DiffusionGemma (text diffusion) and its autoregressive base from GGUF files; watch, compare, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"dg {version('dgcli')}")
        except PackageNotFoundError:
            typer.echo("dg (not installed as a package)")
        raise typer.Exit()


@app.callback(cls=_OneLineErrors)
def _root_options(show_version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                               help="Print dg's version and exit.")) -> None:
    """Run DiffusionGemma (text diffusion) and its autoregressive base from GGUF files; watch, compare, benchmark."""

app.command("list")(list_models.list_cmd)
app.command("pull")(pull.pull)
app.command("info")(info.info_cmd)
app.command("generate")(generate.generate)
app.command("chat")(chat.chat)
app.command("compare")(compare.compare)
app.command("replay")(replay.replay)
app.command("bench")(bench.bench)
app.command("convert")(convert.convert)
app.command("serve")(serve.serve)
app.command("worker")(worker.worker)


def main() -> None:
    _signals.install()
    try:
        app()
    finally:
        _signals.finishing()

