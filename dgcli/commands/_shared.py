"""What the dg commands share: consoles, one-line errors, model resolution, engine seams, options,
the diffusion run with its live view. Commands reach these through the module (`shared.X`), so tests
can replace a seam (`open_diffusion_engine`, `stdout`, ...) in one place."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import typer
from rich.console import Console
from rich.live import Live

from dgcli import hub, info as ginfo, render
from dgcli.engine.types import CanvasEvent, DgError, DiffusionParams, GenerationResult, StepEvent
from dgcli.registry import DEFAULT_MODEL, Registry, ResolvedModel, missing_shipped_message

EXIT_INTERRUPTED = 130
LIVE_REFRESH_S = 1 / 15

# Tables stay readable when piped (Rich would otherwise assume 80 columns).
_PIPE_WIDTH = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS") or 120)
stdout = Console(highlight=False, width=_PIPE_WIDTH)
stderr = Console(stderr=True, highlight=False)


def fail(message: str, code: int = 1) -> "typer.Exit":
    # One line, whatever the message contained.
    typer.echo("error: " + " ".join(str(message).split()), err=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """DgError (and a missing native layer) become one line on stderr and exit 1."""
    try:
        yield
    except DgError as err:
        raise fail(str(err)) from None
    except ImportError as err:
        raise fail(f"native layer unavailable ({err}); build it with `make setup` (python native/build.py)") from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


# ---------------------------------------------------------------- model resolution / pulling


def registry() -> Registry:
    return Registry.load()


def download_with_progress(resolved: ResolvedModel) -> Path:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    # Started on the first byte count, so a missing repo/file or a full disk prints only its error.
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=stderr, transient=False,
    )
    task = None

    def on_progress(done: int, total: int | None) -> None:
        nonlocal task
        if task is None:
            progress.start()
            task = progress.add_task(resolved.filename or "download", total=total)
        progress.update(task, completed=done, total=total)

    try:
        return hub.download(resolved.repo, resolved.filename, approx_size=resolved.approx_size_bytes,
                            on_progress=on_progress)
    except KeyboardInterrupt:
        raise DgError(f"download interrupted; run `dg pull {resolved.display_name}` to continue it (the partial file is never loaded)") from None
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


def resolve_model(spec: Optional[str], *, yes: bool, want: str) -> tuple[ResolvedModel, Path]:
    resolved = registry().resolve(spec or DEFAULT_MODEL)
    if resolved.role is not None and resolved.role != want:
        kind = "diffusion" if want == "diffusion" else "autoregressive"
        raise DgError(f"{resolved.display_name} is a {resolved.role} model; this needs a {kind} model (see `dg list`)")
    return resolved, ensure_local(resolved, yes=yes)


def resolve_pair(diff: ResolvedModel, ar_spec: Optional[str], *, yes: bool) -> tuple[ResolvedModel, Path]:
    if ar_spec:
        return resolve_model(ar_spec, yes=yes, want="ar")
    pair = registry().pair_of(diff)
    if pair is None:
        raise DgError(f"{diff.display_name} has no registry pair; pass --ar-model NAME|PATH")
    return pair, ensure_local(pair, yes=yes)


def preflight(path: Path, *, diffusion: bool, command: str, gpu_layers: int, n_cpu_moe: int = 0) -> None:
    ginfo.check_architecture(path, diffusion=diffusion, command=command)
    ginfo.check_fits_memory(path, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe)


def resolve_offload(gpu_layers: int, n_cpu_moe: Optional[int], cpu_moe: bool) -> tuple[int, int]:
    """(gpu_layers, n_cpu_moe) for the engines from --gpu-layers / --n-cpu-moe / --cpu-moe.

    Keeping experts in RAM only means something when the rest is offloaded, so --n-cpu-moe and
    --cpu-moe offload every layer unless --gpu-layers says how many."""
    if cpu_moe and n_cpu_moe is not None:
        raise DgError("pass --cpu-moe or --n-cpu-moe N, not both")
    if n_cpu_moe is not None and n_cpu_moe < 0:
        raise DgError(f"invalid --n-cpu-moe {n_cpu_moe}: must be an integer >= 0 (--cpu-moe keeps every layer's experts)")
    experts = -1 if cpu_moe else (n_cpu_moe or 0)
    if experts and gpu_layers == 0:
        gpu_layers = -1
    return gpu_layers, experts


def report_placement(what: str, model) -> None:
    """--verbose: where llama.cpp put this model's weights, from its load log."""
    report = getattr(model, "load_report", None)
    if report is not None:
        for line in render.placement_lines(what, report):
            stderr.print(line, markup=False)


# ---------------------------------------------------------------- engines (seams for tests)


def open_diffusion_engine(path: Path, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0,
                          verbose: bool = False):
    from dgcli.engine.diffusion import DiffusionEngine

    engine = DiffusionEngine(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe)
    if verbose:
        report_placement(f"diffusion model {path.name}", engine.model)
    return engine


def open_speed_model(path: Path, n_seq_max: int, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0):
    """The diffusion weights loaded with room for `n_seq_max` canvases in one forward (bench's batch sweep)."""
    from dgcli.engine.model import DiffusionModel

    return DiffusionModel(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_seq_max=n_seq_max,
                          n_cpu_moe=n_cpu_moe)


def open_ar_engine(path: Path, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0,
                   verbose: bool = False):
    from dgcli.engine.autoregressive import AutoregressiveEngine

    engine = AutoregressiveEngine(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe)
    if verbose:
        report_placement(f"autoregressive model {path.name}", engine.model)
    return engine


# ---------------------------------------------------------------- prompt / params / outputs


def read_prompt(prompt: Optional[str]) -> str:
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise DgError("no prompt: pass one as an argument, or pipe it on stdin")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise DgError("empty prompt")
    return prompt


def diffusion_params(path: Path, **flags: Any) -> DiffusionParams:
    """The GGUF's sampler defaults with the user's flags on top, validated before any loading."""
    meta = ginfo.read_info(path)
    base = DiffusionParams(**meta.sampler_defaults) if meta.sampler_defaults else DiffusionParams()
    return base.replace(**flags).validate()


def check_generation_args(max_new_tokens: int, threads: Optional[int], gpu_layers: int) -> None:
    if max_new_tokens < 1:
        raise DgError(f"invalid max_new_tokens={max_new_tokens}: must be an integer >= 1")
    if threads is not None and threads < 1:
        raise DgError(f"invalid threads={threads}: must be an integer >= 1")
    if gpu_layers < -1:
        raise DgError(f"invalid gpu_layers={gpu_layers}: must be -1 (all) or >= 0")


def check_prompt_fits(engine, prompt: str, max_new_tokens: int) -> None:
    """Refuse a prompt that leaves no room for one canvas in the context."""
    model = getattr(engine, "model", None)
    n_ctx = getattr(model, "n_ctx", None)
    if model is None or not isinstance(n_ctx, int):
        return
    n_prompt = len(model.chat_prompt(prompt))
    room = getattr(model, "canvas_length", 1) or 1
    if n_prompt + room > n_ctx:
        raise DgError(f"prompt is {n_prompt} tokens; with one {room}-token canvas it exceeds the context of {n_ctx} tokens")


class AtomicOutput:
    """A file written to a temporary name and renamed into place only on success."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self.tmp: Optional[Path] = None
        self.handle = None
        if path is not None:
            parent = path.expanduser().resolve().parent
            if not parent.is_dir():
                raise DgError(f"cannot write {path}: directory {parent} does not exist")
            if path.is_dir():
                raise DgError(f"cannot write {path}: it is a directory")
            self.tmp = parent / f".{path.name}.{os.getpid()}.partial"

    def open(self):
        if self.tmp is not None:
            self.handle = open(self.tmp, "w", encoding="utf-8")
        return self

    def write_line(self, obj: dict) -> None:
        if self.handle is not None:
            self.handle.write(json.dumps(obj) + "\n")

    def write_all(self, obj: dict) -> None:
        if self.handle is not None:
            json.dump(obj, self.handle, indent=2)
            self.handle.write("\n")

    def commit(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
            os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.tmp is not None and self.tmp.exists():
            self.tmp.unlink()


@contextmanager
def atomic_outputs(*paths: Optional[Path]) -> Iterator[list[AtomicOutput]]:
    outs = [AtomicOutput(p) for p in paths]
    try:
        for out in outs:
            out.open()
        yield outs
    except BaseException:
        for out in outs:
            out.discard()
        raise
    else:
        for out in outs:
            out.commit()


class Throttle:
    def __init__(self, interval: float = LIVE_REFRESH_S):
        self.interval, self.last = interval, 0.0

    def ready(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force or now - self.last >= self.interval:
            self.last = now
            return True
        return False


def use_live(no_live: bool, json_out: bool) -> bool:
    return not (no_live or json_out) and stdout.is_terminal


def piece_of(model):
    cache: dict[int, str] = {}

    def piece(token: int) -> str:
        if token not in cache:
            cache[token] = model.detokenize([token])
        return cache[token]

    return piece


def run_diffusion(engine, prompt: str, *, params: DiffusionParams, max_new_tokens: int, seed: Optional[int],
                  live: bool, thinking: str, trace: Optional[AtomicOutput], events: Optional[list],
                  stream_plain: bool = False, title: str = "diffusion", live_obj: Optional[Live] = None,
                  panel_slot=None, self_cond_top_k: Optional[int] = None) -> GenerationResult:
    """One diffusion generation with the chosen display; returns the engine's result.

    live: a Rich Live panel (its own, or `live_obj` shared with compare); stream_plain: per-step status
    lines on stderr and each committed canvas's text on stdout (logs and pipes).
    """
    model = engine.model
    view = render.DiffusionLiveView(piece_of(model), model.detokenize, getattr(model, "end_token_ids", ()),
                                    title=title, thinking=thinking)
    throttle = Throttle()
    streamed = {"n": 0}

    def on_event(ev) -> None:
        view.on_event(ev)
        if trace is not None:
            trace.write_line(ev.to_json())
        if events is not None:
            events.append(ev.to_json())
        if live_obj is not None:
            if throttle.ready(force=isinstance(ev, CanvasEvent)):
                live_obj.refresh()
        elif stream_plain:
            if isinstance(ev, StepEvent):
                typer.echo(render.step_status(ev), err=True)
            elif isinstance(ev, CanvasEvent) and thinking == "show":
                # Plain mode streams each committed canvas's text as soon as it is final.
                text = view.committed_text
                typer.echo(text[streamed["n"]:], nl=False)
                streamed["n"] = len(text)

    if panel_slot is not None:
        panel_slot(view)
    # Only an explicit choice reaches the engine; otherwise it picks (dense for small vocabularies).
    options = {} if self_cond_top_k is None else {"self_cond_top_k": self_cond_top_k}
    if live and live_obj is None:
        with Live(view, console=stdout, auto_refresh=False, transient=True) as lv:
            live_obj = lv
            result = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, seed=seed,
                                     on_event=on_event, **options)
    else:
        result = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, seed=seed, on_event=on_event,
                                 **options)
    if live_obj is not None:
        live_obj.refresh()
    result._streamed_chars = streamed["n"]  # type: ignore[attr-defined]
    return result


# ---------------------------------------------------------------- options shared by commands

ModelOpt = typer.Option(None, "--model", "-m", help="Registry name (`name` or `name:QUANT`, see `dg list`) or a .gguf path. Default: demo.")
YesOpt = typer.Option(False, "--yes", "-y", help="Download a missing registry model without asking.")
ThreadsOpt = typer.Option(None, "--threads", "-t", help="CPU threads (default: 1 for tiny models under 64 MB, else every core).")
GpuOpt = typer.Option(0, "--gpu-layers", "-ngl", help="Layers to offload to the GPU (-1 = all).")
NCpuMoeOpt = typer.Option(None, "--n-cpu-moe", metavar="N",
                          help="Keep the expert weights of the first N layers in system memory, the rest on the GPU "
                               "(offloads every layer unless --gpu-layers is given).")
CpuMoeOpt = typer.Option(False, "--cpu-moe", help="Keep every layer's expert weights in system memory (--n-cpu-moe all).")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="Print where llama.cpp put the weights (GPU/RAM buffers, tensors kept in RAM).")

def sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold) -> dict:
    return dict(max_denoising_steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                stability_threshold=stability_threshold, confidence_threshold=confidence_threshold)


StepsOpt = typer.Option(None, "--steps", help="Max denoising steps per canvas (GGUF default: diffusion.eb_max_steps).")
TMinOpt = typer.Option(None, "--t-min", help="Final temperature of the schedule.")
TMaxOpt = typer.Option(None, "--t-max", help="Initial temperature of the schedule.")
EBOpt = typer.Option(None, "--entropy-bound", help="Entropy budget of the accepted prefix per step (speed knob).")
StabOpt = typer.Option(None, "--stability-threshold", help="Steps the argmax canvas must stay unchanged to stop.")
ConfOpt = typer.Option(None, "--confidence-threshold", help="Mean entropy below which the canvas may stop.")
ThinkingOpt = typer.Option("show", "--thinking", help="Thinking channel: show (dimmed) or hide.")


def check_thinking(thinking: str) -> None:
    if thinking not in ("show", "hide"):
        raise DgError(f"invalid --thinking {thinking!r}: must be show or hide")
