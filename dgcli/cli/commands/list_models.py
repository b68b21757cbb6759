"""`dg list`: the registry models, their repositories and files, sizes and whether each is on disk."""

from __future__ import annotations

import json

import typer
from rich.table import Table
from rich.text import Text

from dgcli import hub, model_list
from dgcli.cli import _errors, _models, _output

LIST_SCHEMA = "dg-list/1"
UNCHECKED = " ?"  # after a file name the repository's listing has not confirmed yet


def list_cmd(json_out: bool = typer.Option(False, "--json", help=f"Machine-readable output ({LIST_SCHEMA})."),
             refresh: bool = typer.Option(False, "--refresh",
                                          help="Read every repository's file list from the Hub first (network).")) -> None:
    """Registry models: role, pair, the file each quant resolves to, size and whether it is on disk."""
    with _errors.user_errors():
        registry = _models.registry()
        problems = model_list.refresh_listings(registry) if refresh else []
        rows = model_list.model_rows(registry)
        if json_out:
            typer.echo(json.dumps({"schema": LIST_SCHEMA, "models": [r.to_json() for r in rows],
                                   "refresh_problems": problems}, indent=2))
            return
        _print(rows, model_list.sources(registry))
        for r in rows:
            if r.problem:
                _output.notice(f"{r.name}:{r.quant}: {r.problem}", style="yellow")
        for line in problems:
            _output.notice(f"not refreshed: {line}", style="yellow")


def _size(r: model_list.ModelRow) -> str:
    if not r.size:
        return "-"
    return ("" if r.size_exact else "~") + hub.format_bytes(r.size)


def _file(r: model_list.ModelRow) -> str:
    if r.problem:
        return "(no single file: see below)"
    parts = f" ({r.parts} parts)" if r.parts > 1 else ""
    return (r.file or "-") + parts + ("" if r.checked else UNCHECKED)


def _print(rows: list[model_list.ModelRow], sources: list[str]) -> None:
    table = Table(title="dg models", caption_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("quant", no_wrap=True)
    table.add_column("role", overflow="fold")  # folded when squeezed, never cut to "…"
    table.add_column("pair", overflow="fold")
    table.add_column("file", no_wrap=True)  # whole or not at all: a folded name is not found by grep
    table.add_column("size", overflow="fold", justify="right")
    table.add_column("on disk", overflow="fold")
    for r in rows:
        quant = (r.quant or "-") + (" *" if r.default and r.quant else "")
        table.add_row(r.name, quant, r.role, r.pair or "-", Text(_file(r)), _size(r), "yes" if r.on_disk else "no")
    legend = ("* default quant; ~ size from the registry;" + UNCHECKED + " the registry's file name, not yet checked "
              "against the repository's file list (`dg pull` or `dg list --refresh` reads it).")
    usage = "`dg pull NAME[:QUANT]` downloads; --model takes NAME, NAME:QUANT or a .gguf path."
    out = _output.stdout
    piped = not out.is_terminal  # then the caption and each model's lines stay one line, for grep
    # the table only where nothing in it needs folding (a pair name folded after "gemma4-26" reads as another)
    if out.measure(table, options=out.options.update_width(10_000)).maximum <= out.width:
        # three lines, each one line when piped (for grep); the table has no column for the repositories
        table.caption = Text("\n".join([legend, "Files from " + "; ".join(sources) + ".", usage]))
        _output.print_table(table)
        return
    # narrower than the table: a line per model and one for its file, under a line naming the repository
    # whenever it changes (columns squeezed to nothing would hide the sizes and whether each is on disk)
    out.print(Text("dg models", style="italic"))
    source = None
    for r in rows:
        where = (f"from {r.repo}" + (f"@{r.revision[:12]}" if r.revision else "") + ":") if r.repo else "shipped with dg:"
        if where != source:
            out.print(Text(where, style="bold"), soft_wrap=piped)
            source = where
        name = r.name + (f":{r.quant}" if r.quant else "") + (" *" if r.default and r.quant else "")
        out.print(Text(f"{name}  {r.role}, pair {r.pair or '-'}  {_size(r)}  "
                       + ("on disk" if r.on_disk else "not on disk")), soft_wrap=piped)
        out.print(Text("  " + _file(r), style="dim"), soft_wrap=piped)
    out.print(Text(legend), soft_wrap=piped)
    out.print(Text(usage), soft_wrap=piped)
