"""From a model name to a loaded engine: registry resolution, the download prompt and its progress
bars, the checks before a load (architecture, header, memory), and the engine seams tests replace
(`open_diffusion_engine`, `open_ar_engine`, `open_speed_model`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from dgcli import hub
from dgcli.cli import _output, render
from dgcli.cli._errors import EXIT_INTERRUPTED
from dgcli.cli._options import typed_option
from dgcli.cli._terminal import anchored, echo_off
from dgcli.errors import DgError
from dgcli.modelfile import info as ginfo
from dgcli.registry import DEFAULT_MODEL, Registry, ResolvedModel, missing_shipped_message

ROLE_NAMES = {"diffusion": "a diffusion", "ar": "an autoregressive"}


def registry() -> Registry:
    return Registry.load()


def download_with_progress(resolved: ResolvedModel) -> Path:
    """The model's file from the Hub (dgcli.pull: the file its repository's listing names for the
    quant, every part of a split one), with a progress bar for each transfer and for the sha256 pass
    after it. Ctrl-C keeps the partial file for the next `dg pull` and exits 130."""
    from dgcli import pull

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    from rich.markup import escape
    from rich.table import Column

    # One line per bar at any width (a bar of fixed width beside a registry file's name does not fit
    # 80 columns): the name is cut to what the figures leave, the bar takes the rest, and under 60
    # columns only the name, the bytes and the speed stay.
    def fixed() -> Column:
        return Column(no_wrap=True)

    def columns_for(width: int) -> list:
        name_column = TextColumn("[bold]{task.description}",
                                 table_column=Column(no_wrap=True, overflow="ellipsis", max_width=max(10, width - 52)))
        figures = [DownloadColumn(table_column=fixed()), TransferSpeedColumn(table_column=fixed())]
        return ([name_column, BarColumn(bar_width=None), *figures, TimeRemainingColumn(table_column=fixed())]
                if width >= 60 else [name_column, *figures])

    class FittedProgress(Progress):
        """The columns for the terminal's width each time it is drawn, not once at the start: a
        terminal made narrower meanwhile keeps every figure whole."""

        def get_renderables(self):
            self.columns = tuple(columns_for(_output.stderr.width))
            yield from super().get_renderables()

    # Started on the first byte count, so a missing repo/file or a full disk prints only its error.
    progress = anchored(FittedProgress(*columns_for(_output.stderr.width), console=_output.stderr, transient=False,
                                       expand=True))
    tasks: dict[str, Any] = {}

    def bar(description: str):
        def update(done: int, total: int | None) -> None:
            if description not in tasks:
                progress.start()
                # text, not markup: the name column formats "[bold]{task.description}", and a file name
                # may hold "[/x]"
                tasks[description] = progress.add_task(escape(description), total=total)
            progress.update(tasks[description], completed=done, total=total)
        return update

    try:
        with echo_off():  # as under a live view: an echoed `^C` would move the cursor past the bar
            if resolved.choice is None:
                resolved = pull.resolve_on_hub(resolved)
            if resolved.path is not None:  # the listing names a file already in the cache
                return resolved.path
            single = len(resolved.parts) == 1
            return pull.download_model(resolved, progress=bar,
                                       verify=lambda name: bar("sha256 check" if single else f"sha256 check {name}"),
                                       on_wait=lambda line: _output.notice(line, style="yellow"))
    except KeyboardInterrupt:
        progress.stop()
        _output.notice(f"interrupted: run `dg pull {resolved.display_name}` to continue the download "
               "(the partial file is never loaded)")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        progress.stop()


def ensure_local(resolved: ResolvedModel, *, yes: bool) -> Path:
    """The model's file on disk, pulling it first (after asking) when it is a registry model."""
    if resolved.path is not None:
        return resolved.path
    if resolved.entry is not None and resolved.entry.shipped is not None:
        raise DgError(missing_shipped_message(resolved))
    size = hub.format_bytes(resolved.approx_size_bytes)
    if not yes:
        if not sys.stdin.isatty():
            raise DgError(
                f"{resolved.display_name} is not downloaded (~{size}); run `dg pull {resolved.display_name}` or pass --yes"
            )
        if not typer.confirm(f"{resolved.display_name} (~{size}) is not downloaded. Download it from {resolved.repo} now?"):
            raise DgError(f"{resolved.display_name} not downloaded")
    return download_with_progress(resolved)


def resolve_model(spec: Optional[str], *, yes: bool, want: str,
                  option: str = "--model") -> tuple[ResolvedModel, Path]:
    resolved = registry().resolve(DEFAULT_MODEL if spec is None else spec, what=f"{option} value")
    if resolved.role is not None and resolved.role != want:
        raise DgError(f"{resolved.display_name} is {ROLE_NAMES[resolved.role]} model; this needs "
                      f"{ROLE_NAMES[want]} model (see `dg list`)")
    return resolved, ensure_local(resolved, yes=yes)


def resolve_pair(diff: ResolvedModel, ar_spec: Optional[str], *, yes: bool) -> tuple[ResolvedModel, Path]:
    if ar_spec is not None:  # --ar-model "" is an error, not the registry pair
        return resolve_model(ar_spec, yes=yes, want="ar", option="--ar-model")
    pair = registry().pair_of(diff)
    if pair is None:
        raise DgError(f"{diff.display_name} has no registry pair; pass --ar-model NAME|PATH")
    return pair, ensure_local(pair, yes=yes)


def preflight(path: Path, *, diffusion: bool, command: str, gpu_layers: int, n_cpu_moe: int = 0,
              ctx_size: Optional[int] = None, n_seq: int = 1) -> None:
    """The file's architecture and header, then whether its weights and the KV cache of the context
    asked for (-c/--ctx-size: n_seq sequences of ctx_size cells; None: the default, small) fit."""
    ginfo.check_architecture(path, diffusion=diffusion, command=command)
    ginfo.check_fits_memory(path, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe, n_ctx=ctx_size, n_seq=n_seq)


def report_placement(what: str, model) -> None:
    """--verbose: where llama.cpp put this model's weights, from its load log."""
    report = getattr(model, "load_report", None)
    if report is not None:
        target = "the RPC workers" if getattr(model, "rpc_devices", None) is not None else "the GPU"
        for line in render.placement_lines(what, report, target):  # one line each when piped, as _output.notice()
            _output.stderr.print(line, markup=False, highlight=False, soft_wrap=not _output.stderr.is_terminal)


def placement_of(model) -> Optional[dict]:
    """Where llama.cpp put a loaded model's weights (runtime.offload.LoadReport.to_json()), for --json:
    the figures beside it are that device's."""
    report = getattr(model, "load_report", None)
    return report.to_json() if report is not None else None


def warn_if_not_offloaded(what: str, model, gpu_layers: int) -> None:
    """--gpu-layers asked for a GPU and llama.cpp put every weight in system memory: say so and why,
    since the speed shown is then the CPU's."""
    report = getattr(model, "load_report", None)
    missed = report.offload_missed(gpu_layers) if report is not None else None
    if missed:
        _output.notice(f"warning: {_offload_asked_by(gpu_layers)}: {missed}; the {what} runs on the CPU")


def _offload_asked_by(gpu_layers: int) -> str:
    """The flag that asked for the offload, as the user typed it: --cpu-moe / --n-cpu-moe offload every
    layer when --gpu-layers is not given (resolve_offload), and the warning names what was typed, not
    the --gpu-layers -1 it implies."""
    if not typed_option("gpu_layers"):
        for name, flag in (("cpu_moe", "--cpu-moe"), ("n_cpu_moe", "--n-cpu-moe")):
            if typed_option(name):
                return f"{flag} (which offloads every layer but the experts it keeps)"
    return f"--gpu-layers {gpu_layers}"


def open_diffusion_engine(path: Path, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0,
                          ctx_size: Optional[int] = None, verbose: bool = False, rpc: Optional[list[str]] = None):
    from dgcli.engine.diffusion import DiffusionEngine

    engine = DiffusionEngine(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe, n_ctx=ctx_size,
                             rpc_servers=rpc)
    warn_if_not_offloaded("diffusion model", engine.model, gpu_layers)
    if verbose:
        report_placement(f"diffusion model {path.name}", engine.model)
    return engine


def open_speed_model(path: Path, n_seq_max: int, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0,
                     rpc: Optional[list[str]] = None):
    """The diffusion weights loaded with room for `n_seq_max` canvases in one forward (bench's batch sweep)."""
    from dgcli.runtime.model import DiffusionModel

    model = DiffusionModel(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_seq_max=n_seq_max,
                           n_cpu_moe=n_cpu_moe, rpc_servers=rpc)
    warn_if_not_offloaded("speed model", model, gpu_layers)
    return model


def open_ar_engine(path: Path, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0,
                   ctx_size: Optional[int] = None, verbose: bool = False, rpc: Optional[list[str]] = None):
    from dgcli.engine.autoregressive import AutoregressiveEngine

    engine = AutoregressiveEngine(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                                  n_ctx=ctx_size, rpc_servers=rpc)
    warn_if_not_offloaded("autoregressive model", engine.model, gpu_layers)
    if verbose:
        report_placement(f"autoregressive model {path.name}", engine.model)
    return engine
