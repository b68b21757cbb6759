"""`dg pull`: download a registry model into the huggingface-hub cache."""

from __future__ import annotations

import typer

from dgcli.cli import _errors, _models
from dgcli.errors import DgError
from dgcli.registry import missing_shipped_message


def pull(model: str = typer.Argument(..., help="NAME or NAME:QUANT (see `dg list`).")) -> None:
    """Download a registry model into the huggingface-hub cache (resumes an interrupted download)."""
    with _errors.user_errors():
        resolved = _models.registry().resolve(model, what="MODEL argument: `dg pull` takes NAME or NAME:QUANT (see `dg list`)")
        if resolved.entry is None:
            raise DgError(f"{model} is a path; `dg pull` takes a registry name (see `dg list`)")
        if resolved.entry.shipped is not None:
            if resolved.path is None:
                raise DgError(missing_shipped_message(resolved))
            typer.echo(f"{resolved.display_name} is shipped with dg: {resolved.path}")
            return
        if resolved.path is not None:
            typer.echo(f"{resolved.display_name} already downloaded: {resolved.path}")
            return
        path = _models.download_with_progress(resolved)
        typer.echo(f"{resolved.display_name}: {path}")
