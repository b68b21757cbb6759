"""`dg info`: what a GGUF holds, read from its header (nothing is loaded)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from dgcli import hub, pull
from dgcli.cli import _errors, _models, _options, _output, render
from dgcli.errors import DgError
from dgcli.modelfile import info as ginfo
from dgcli.params import DIFFUSION_PARAM_KEYS
from dgcli.registry import missing_shipped_message

INFO_SCHEMA = "dg-info/1"


def info_cmd(model: str = typer.Argument(..., help="A .gguf path or a registry name."),
             json_out: bool = typer.Option(False, "--json", help=f"Machine-readable output ({INFO_SCHEMA})."),
             gpu_layers: int = _options.GpuOpt,
             n_cpu_moe: Optional[int] = _options.NCpuMoeOpt, cpu_moe: bool = _options.CpuMoeOpt,
             gpu_memory: Optional[str] = typer.Option(
                 None, "--gpu-memory", metavar="SIZE",
                 help="Judge the fit against a GPU with this much free memory (e.g. 16GB) instead of the one found.")) -> None:
    """What a GGUF holds (read directly, not loaded) and whether it fits in RAM and GPU memory.

    Architecture, quant, params and sampler defaults; the fit is judged with the given offload
    (--gpu-layers, --n-cpu-moe, --cpu-moe)."""
    with _errors.user_errors():
        from dgcli.runtime.model import check_gpu_layers

        check_gpu_layers(gpu_layers)  # as every command that loads: info must not call "fits" what they refuse
        gpu_layers, n_cpu_moe = _options.resolve_offload(gpu_layers, n_cpu_moe, cpu_moe)
        if gpu_memory is not None and gpu_layers == 0:
            gpu_layers = -1  # a fit against a GPU means something offloaded
        resolved = _models.registry().resolve(model, what="MODEL argument: `dg info` takes a .gguf path or a registry name")
        if resolved.path is None and resolved.entry is not None and resolved.entry.shipped is not None:
            raise DgError(missing_shipped_message(resolved))
        gpus = None
        if gpu_memory is not None:
            size = ginfo.parse_size(gpu_memory)
            # on a Mac the GPU is Apple's, through ggml-metal
            gpus = [ginfo.GpuMemory(f"a {hub.format_bytes(size)} GPU (--gpu-memory)", size, size,
                                    metal=sys.platform == "darwin")]
        offload = dict(n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe, gpus=gpus)
        on_hub = None  # a registry model not downloaded: described from the Hub (its listing, its header's bytes)
        if resolved.path is None:
            resolved = pull.resolve_on_hub(resolved)
            if resolved.path is None:
                on_hub = pull.hub_model_info(resolved, **offload)
        meta = on_hub.info if on_hub is not None else ginfo.read_info(resolved.path, **offload)
        if json_out:
            doc = {"schema": INFO_SCHEMA, **(meta.to_json() if meta is not None else {})}
            if on_hub is not None and meta is not None:
                doc["path"] = None  # not on this machine: `hub` says where it is
            if resolved.entry is not None and resolved.entry.shipped is None:
                doc["hub"] = (on_hub or pull.hub_model_info(resolved, read_header=False)).to_json() \
                    if resolved.choice is not None else {"repo": resolved.repo, "revision": resolved.revision,
                                                         "file": resolved.filename, "downloaded": True}
            if on_hub is not None and on_hub.header_problem:
                doc["header_error"] = on_hub.header_problem
            typer.echo(json.dumps(doc, indent=2))
            return
        fmt = hub.format_bytes
        summary = Table.grid(padding=(0, 2))
        summary.add_column(style="bold")
        summary.add_column(overflow="fold")  # long key names and paths wrap, never cut
        if meta is None:  # the Hub's metadata, without the header
            _print_rows(summary, _hub_rows(resolved, on_hub))
            return
        rows = [
            ("file", f"{meta.path} ({fmt(meta.file_size)})"),
            ("architecture", meta.architecture + ("  (diffusion)" if meta.is_diffusion else "")),
            ("name", meta.name or "-"),
            ("quantization", meta.file_type or "-"),
            ("parameters", f"{meta.parameter_count:,} ({meta.tensor_count} tensors)"),
            ("layers", str(meta.block_count or "-")),
            ("embedding", str(meta.embedding_length or "-")),
            ("experts", f"{meta.expert_count} (top {meta.expert_used_count})" if meta.expert_count else "-"),
            ("vocab", str(meta.vocab_size or "-")),
            ("context length", str(meta.context_length or "-")),
            ("canvas length", str(meta.canvas_length or "-")),
            ("logit softcap", _softcap(meta)),
            ("chat template", "yes" if meta.has_chat_template else "no"),
            ("memory", f"needs ~{fmt(meta.memory_needed)}; RAM {fmt(meta.ram_total)} total, {fmt(meta.ram_available)} available: "
                       + unloadable_words(meta, "fits" if meta.fits_available_ram else "fits RAM but not what is free now"
                                          if meta.fits_ram else "DOES NOT FIT")),
        ]
        if meta.self_cond_bytes:
            # "self-cond" as in --self-cond-top-k: every label fits the narrowest terminal's label column
            rows.append(("self-cond", f"dense (the reference's): {fmt(meta.self_cond_bytes)} of transposed "
                                      f"embeddings in {'GPU memory' if meta.self_cond_on_gpu else 'RAM'}, "
                                      "made on first use, counted in the needs"))
        if meta.reference_default_keys:
            rows.append(("added by dg", f"{_key_list(meta.reference_default_keys)}: the reference's defaults, where "
                                        "the model's config gave none (the published converter leaves these keys out)"))
        if gpu_layers != 0:
            rows.append(("GPU memory", gpu_fit_words(meta)))
        if meta.problem:
            rows.append(("problem", Text(render.printable(f"{meta.problem} (dg will not load it)"), style="red")))
        if on_hub is not None:
            rows = _hub_rows(resolved, on_hub) + rows[1:]  # the file is on the Hub
        _print_rows(summary, rows)
        if meta.sampler_defaults:
            # overflow="fold" everywhere: a narrow terminal wraps a name or a number, never cuts it to "…"
            sampler = Table(title="sampler defaults (diffusion.eb_*)")
            sampler.add_column("parameter", overflow="fold")
            sampler.add_column("value", justify="right", overflow="fold")
            sampler.add_column("from", overflow="fold")
            for k, v in meta.sampler_defaults.items():
                sampler.add_row(k, str(v), meta.sampler_defaults_source[k])
            _output.print_table(sampler)
        if gpu_layers != 0 and meta.gpu_name:
            where = Table(title=f"placement ({meta.offloaded_layers}/{(meta.block_count or 0) + 1} layers offloaded)")
            for col in ("weights", "in", "tensors", "size"):
                where.add_column(col, justify="left" if col in ("weights", "in") else "right", overflow="fold")
            for what, device, count, nbytes in meta.placement:
                where.add_row(what, device, str(count), fmt(nbytes))
            _output.print_table(where)
        types = Table(title="tensor types")
        for col in ("type", "tensors", "parameters", "size"):
            types.add_column(col, justify="left" if col == "type" else "right", overflow="fold")
        for t in meta.tensor_types:
            types.add_row(t.type, str(t.tensors), f"{t.parameters:,}", fmt(t.bytes))
        _output.print_table(types)


def _print_rows(summary: Table, rows: list) -> None:
    # Text, not markup: names and paths come from the file and may hold brackets (and control
    # characters: general.name = ESC [2J cleared the screen)
    rows = [(k, v if isinstance(v, Text) else Text(render.printable(v))) for k, v in rows]
    if _output.stdout.is_terminal:
        for k, v in rows:
            summary.add_row(k, v)
        _output.stdout.print(summary)
    else:  # piped: one line per row, as the grid lays it out but neither wrapped nor padded to the width
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            _output.stdout.print(Text.assemble((k.ljust(width + 2), "bold"), v), soft_wrap=True)


def _hub_rows(resolved, on_hub: pull.HubModelInfo) -> list:
    """A registry model not downloaded: where it is on the Hub, and what reading its header gave."""
    parts = f", {len(on_hub.parts)} parts" if len(on_hub.parts) > 1 else ""
    rows = [("file", f"{on_hub.parts[0]} ({hub.format_bytes(on_hub.size)}{parts}), not downloaded: "
                     f"`dg pull {resolved.display_name}`"),
            ("repository", on_hub.repo + (f" (pinned at {on_hub.revision[:12]})" if on_hub.revision else "")),
            ("commit", on_hub.commit)]
    if on_hub.header_problem:
        rows.append(("header", Text(render.printable(f"not read: {on_hub.header_problem}"), style="yellow")))
    else:
        rows.append(("header", "read from the first bytes of the file on the Hub (nothing downloaded)"))
    return rows


def _softcap(meta: ginfo.GgufInfo) -> str:
    if meta.final_logit_softcapping is None:
        return "-"
    added = any(k.endswith(".final_logit_softcapping") for k in meta.reference_default_keys)
    return f"{meta.final_logit_softcapping:g}" + ("  (reference default, added by dg)" if added else "")


def _key_list(keys: list[str]) -> str:
    """Key names, the sampler's six diffusion.eb_* keys summed up when all are there."""
    eb = [k for k in keys if k in DIFFUSION_PARAM_KEYS]
    if len(eb) == len(DIFFUSION_PARAM_KEYS):
        keys = [k for k in keys if k not in DIFFUSION_PARAM_KEYS] + ["the six diffusion.eb_* keys"]
    return ", ".join(keys)


def unloadable_words(meta: ginfo.GgufInfo, verdict: str) -> str:
    """A size verdict, unless the file has a problem: then its size is not what stops a load."""
    return verdict if not meta.problem or verdict == "DOES NOT FIT" else f"{verdict} by size, but dg will not load it (problem below)"


def gpu_fit_words(meta: ginfo.GgufInfo) -> str:
    fmt = hub.format_bytes
    if not meta.gpu_name:
        return "no GPU found (CPU-only llama.cpp build, or no device): --gpu-layers is ignored, the RAM line counts every weight"
    verdict = ("fits" if meta.fits_available_gpu else "fits the card but not what is free now" if meta.fits_gpu
               else "DOES NOT FIT")
    return (f"needs ~{fmt(meta.gpu_needed)}; {meta.gpu_name}: {fmt(meta.gpu_total)} total, {fmt(meta.gpu_free)} free: "
            + unloadable_words(meta, verdict))
