"""`dg rm`: remove a downloaded registry model from the huggingface-hub cache (dgcli/remove.py)."""

from __future__ import annotations

import sys

import typer

from dgcli import hub, remove
from dgcli.cli import _errors, _models, _options, _output
from dgcli.errors import DgError


def rm(model: str = typer.Argument(..., help="NAME or NAME:QUANT (see `dg list`).", autocompletion=_options.complete_model),
       yes: bool = typer.Option(False, "--yes", "-y", help="Remove without asking.")) -> None:
    """Remove a downloaded registry model from the huggingface-hub cache (nothing outside it, nothing else in it)."""
    with _errors.user_errors():
        resolved = _models.registry().resolve(model, what="MODEL argument: `dg rm` takes NAME or NAME:QUANT (see `dg list`)")
        removal = remove.plan_removal(resolved)
        what = f"{removal.display_name} ({', '.join(removal.files)}, {hub.format_bytes(removal.freed)})"
        if not yes:
            if not sys.stdin.isatty():
                raise DgError(f"removing {what} needs a yes: pass --yes (stdin is not a terminal to ask on)")
            if not typer.confirm(f"Remove {what} from {hub.cache_dir()}?", err=True):
                raise DgError(f"{removal.display_name} not removed")
        remove.execute(removal)
        _output.notice(f"removed {what}; `dg pull {removal.display_name}` downloads it again")
