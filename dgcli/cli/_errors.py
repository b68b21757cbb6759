"""How a command ends on an error: one `error: ...` line on stderr (a flag named as the user typed
it), exit 1, or 130 for Ctrl-C.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import typer

from dgcli.cli import render
from dgcli.cli._options import typed_option
from dgcli.errors import DgError, InvalidParameter

EXIT_INTERRUPTED = 130


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


# engine parameters whose flag has another name
_FLAG_PARAMETERS = {"max_denoising_steps": "steps"}


def flag_message(err: InvalidParameter) -> str:
    """An engine parameter the user typed as a flag, named as that flag: "invalid --n-cpu-moe 1000"
    rather than the engine's "invalid n_cpu_moe=1000"."""
    parameter = _FLAG_PARAMETERS.get(err.name, err.name)
    if not typed_option(parameter):
        return str(err)
    value = err.value if isinstance(err.value, (int, float)) and not isinstance(err.value, bool) else repr(err.value)
    return f"invalid --{parameter.replace('_', '-')} {value}: must be {err.allowed}"
