"""How a command ends on an error: one `error: ...` line on stderr (a flag named as the user typed
it), exit 1, or 130 for Ctrl-C.
"""

from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import typer

from dgcli.cli import render
from dgcli.cli._options import typed_flag, typed_option
from dgcli.errors import DgError, InvalidParameter

EXIT_INTERRUPTED = 130
# 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away (`dg list | head -1`)
EXIT_CLOSED_PIPE = 141
# a standard stream that cannot take more: one line and exit 1 (stdout on /dev/full, a full disk)
_WRITE_FAILURES = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def fail(message: str, code: int = 1) -> "typer.Exit":
    # One line, whatever the message contained; no control characters (a key or tensor name quoted from
    # a file may hold an escape sequence, which click passes to a terminal and, for OSC, even to a pipe)
    typer.echo("error: " + render.printable(" ".join(str(message).split())), err=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """DgError (and a missing native layer) become one line on stderr and exit 1."""
    try:
        yield
    except InvalidParameter as err:
        raise fail(flag_message(err)) from None
    except DgError as err:
        raise fail(str(err), err.exit_code) from None
    except ImportError as err:
        raise fail(f"native layer unavailable ({err}); build it with `make setup` (python native/build.py)") from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


# engine parameters whose option has another name (the command's parameter name)
_FLAG_PARAMETERS = {"max_denoising_steps": "steps", "n_ctx": "ctx_size", "temperature": "temp",
                    "n_gpu_layers": "gpu_layers", "n_threads": "threads"}


def flag_message(err: InvalidParameter) -> str:
    """An engine parameter the user typed as a flag, named as that flag was typed: "invalid -n 0"
    after `-n 0`, "invalid --n-cpu-moe 1000", rather than the engine's "invalid n_cpu_moe=1000"."""
    parameter = _FLAG_PARAMETERS.get(err.name, err.name)
    if parameter in ("t_min", "t_max") and typed_option("temp"):
        parameter = "temp"  # --temp sets both ends: the user typed no --t-max
    if not typed_option(parameter):
        return str(err)
    value = err.value if isinstance(err.value, (int, float)) and not isinstance(err.value, bool) else repr(err.value)
    return f"invalid {typed_flag(parameter)} {value}: must be {err.allowed}"


@contextmanager
def output_errors() -> Iterator[None]:
    """A standard stream that fails under dg ends it as a Unix tool ends: a closed pipe (the reader
    went away: `| head -1`) quietly with 141, a full one (/dev/full, a full disk) with one line and 1.
    An OSError naming a file is not a standard stream's: it goes on up."""
    try:
        yield
    except OSError as err:
        code = output_failure(err)
        if code is None:
            raise
        raise typer.Exit(code) from None


def output_failure(err: OSError) -> "int | None":
    """The exit code for a failed write to stdout or stderr (None: not such a failure); afterwards
    both go to /dev/null, so that nothing buffered fails again when the process exits."""
    if err.errno == errno.EPIPE:
        _standard_streams_to_null()
        return EXIT_CLOSED_PIPE
    if err.errno in _WRITE_FAILURES and not err.filename:
        _standard_streams_to_null(keep_stderr=True)
        try:
            typer.echo(f"error: cannot write the output: {err.strerror or err}", err=True)
        except OSError:  # stderr is the full one
            pass
        return 1
    return None


def _standard_streams_to_null(keep_stderr: bool = False) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout,) if keep_stderr else (sys.stdout, sys.stderr):
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, ValueError):  # a test runner's buffer
                continue
            os.dup2(null, fd)
    finally:
        os.close(null)
