"""`dg list`: the registry models, their quants, sizes and whether each is on disk."""

from __future__ import annotations

import json

import typer
from rich.table import Table
from rich.text import Text

from dgcli import hub
from dgcli.cli import _errors, _models, _output

LIST_SCHEMA = "dg-list/1"


def list_cmd(json_out: bool = typer.Option(False, "--json", help=f"Machine-readable output ({LIST_SCHEMA}).")) -> None:
    """Registry models: role, pair, quants, size and whether each is on disk."""
    with _errors.user_errors():
        registry = _models.registry()
        rows = []
        for entry in registry.entries.values():
            if entry.shipped is not None:
                present = entry.shipped.exists()
                rows.append(dict(name=entry.name, quant=None, role=entry.role, pair=entry.pair, repo=None,
                                 file=entry.shipped.name, size=entry.shipped.stat().st_size if present else None,
                                 on_disk=present, default=True, description=entry.description,
                                 path=str(entry.shipped) if present else None))
                continue
            for quant, f in entry.files.items():
                path = hub.cached_path(entry.repo, f.filename)
                rows.append(dict(name=entry.name, quant=quant, role=entry.role, pair=entry.pair, repo=entry.repo,
                                 file=f.filename, size=path.stat().st_size if path else f.approx_size_bytes,
                                 on_disk=path is not None, default=quant == entry.default_quant,
                                 description=entry.description, path=str(path) if path else None))
        if json_out:
            typer.echo(json.dumps({"schema": LIST_SCHEMA, "models": rows}, indent=2))
            return
        table = Table(title="dg models", caption_justify="left")
        table.add_column("name", no_wrap=True)
        table.add_column("quant", no_wrap=True)
        for col, kw in (("role", {}), ("pair", {}), ("size", {"justify": "right"}), ("on disk", {})):
            table.add_column(col, overflow="fold", **kw)  # folded when squeezed, never cut to "…"
        for r in rows:
            quant = (r["quant"] or "-") + (" *" if r["default"] and r["quant"] else "")
            size = hub.format_bytes(r["size"]) if r["size"] else "-"
            if not r["on_disk"] and r["size"]:
                size = "~" + size
            table.add_row(r["name"], quant, r["role"], r["pair"] or "-", size, "yes" if r["on_disk"] else "no")
        sources = [f"{e.name}: {e.repo or 'shipped with dg'}" for e in registry.entries.values()]
        caption = ("* default quant.  " + "; ".join(sources) +
                   ".  `dg pull NAME[:QUANT]` downloads; --model takes NAME, NAME:QUANT or a .gguf path.")
        out = _output.stdout
        piped = not out.is_terminal  # then the caption and each model's line stay one line, for grep
        if out.measure(table, options=out.options.update_width(10_000)).minimum <= out.width:
            table.caption = Text(caption)
            _output.print_table(table)  # piped: the caption one line, for grep
            return
        # narrower than the table can fold to: one wrapped line per model (columns squeezed to nothing
        # would hide the sizes and whether each is on disk)
        out.print(Text("dg models", style="italic"))
        for r in rows:
            name = r["name"] + (f":{r['quant']}" if r["quant"] else "") + (" *" if r["default"] and r["quant"] else "")
            size = hub.format_bytes(r["size"]) if r["size"] else "-"
            size = "~" + size if not r["on_disk"] and r["size"] else size
            out.print(Text(f"{name}  {r['role']}, pair {r['pair'] or '-'}  {size}  "
                           + ("on disk" if r["on_disk"] else "not on disk")), soft_wrap=piped)
        out.print(Text(caption), soft_wrap=piped)
