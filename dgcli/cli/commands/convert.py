"""`dg convert`: a Hugging Face DiffusionGemma checkpoint to a GGUF in the published layout."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from dgcli.cli import _errors, _options


def convert(
    hf_dir: Path = typer.Argument(..., help="A Hugging Face DiffusionGemma checkpoint directory."),
    out: Path = typer.Argument(..., help="The GGUF file to write."),
    outtype: str = typer.Option("bf16", "--outtype", help="f32, f16, bf16 or q8_0."),
    ar_twin: Optional[Path] = typer.Option(None, "--ar-twin", help="Also write the AR (gemma4) twin of the same weights here."),
    force: bool = _options.ForceOpt,
) -> None:
    """Convert a Hugging Face DiffusionGemma checkpoint to a GGUF in the published layout."""
    with _errors.user_errors():
        from dgcli.convert import convert_main

        convert_main(hf_dir, out, outtype=outtype, ar_twin=ar_twin, echo=typer.echo, force=force)
