"""`dg`: thin Typer commands over dgcli's library. Parsing and rendering only; the engine works."""

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
from rich.table import Table
from typer.core import TyperGroup

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer on real click
    from click.exceptions import ClickException

from dgcli import hub, info as ginfo, render
from dgcli.engine.types import CanvasEvent, DgError, DiffusionParams, GenerationResult, InvalidParameter, StepEvent
from dgcli.registry import DEFAULT_MODEL, Registry, ResolvedModel, missing_shipped_message

EXIT_INTERRUPTED = 130
LIVE_REFRESH_S = 1 / 15


class _OneLineErrors(TyperGroup):
    """Usage errors as one `error: ...` line on stderr instead of a help box."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except ClickException as err:
            typer.echo(f"error: {err.format_message()}", err=True)
            code = err.exit_code
        except typer.Abort:
            typer.echo("aborted", err=True)
            code = 1
        else:
            code = rv if isinstance(rv, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=_OneLineErrors,
    name="dg",
    help="Run DiffusionGemma (text diffusion) and its autoregressive base from GGUF files; watch, compare, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

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


def _registry() -> Registry:
    return Registry.load()


def _download_with_progress(resolved: ResolvedModel) -> Path:
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
    return _download_with_progress(resolved)


def resolve_model(spec: Optional[str], *, yes: bool, want: str) -> tuple[ResolvedModel, Path]:
    resolved = _registry().resolve(spec or DEFAULT_MODEL)
    if resolved.role is not None and resolved.role != want:
        kind = "diffusion" if want == "diffusion" else "autoregressive"
        raise DgError(f"{resolved.display_name} is a {resolved.role} model; this needs a {kind} model (see `dg list`)")
    return resolved, ensure_local(resolved, yes=yes)


def resolve_pair(diff: ResolvedModel, ar_spec: Optional[str], *, yes: bool) -> tuple[ResolvedModel, Path]:
    if ar_spec:
        return resolve_model(ar_spec, yes=yes, want="ar")
    registry = _registry()
    pair = registry.pair_of(diff)
    if pair is None:
        raise DgError(f"{diff.display_name} has no registry pair; pass --ar-model NAME|PATH")
    return pair, ensure_local(pair, yes=yes)


def preflight(path: Path, *, diffusion: bool, command: str, gpu_layers: int) -> None:
    ginfo.check_architecture(path, diffusion=diffusion, command=command)
    ginfo.check_fits_memory(path, n_gpu_layers=gpu_layers)


# ---------------------------------------------------------------- engines (seams for tests)


def open_diffusion_engine(path: Path, *, threads: Optional[int], gpu_layers: int):
    from dgcli.engine.diffusion import DiffusionEngine

    return DiffusionEngine(str(path), n_threads=threads, n_gpu_layers=gpu_layers)


def open_speed_model(path: Path, n_seq_max: int, *, threads: Optional[int], gpu_layers: int):
    """The diffusion weights loaded with room for `n_seq_max` canvases in one forward (bench's batch sweep)."""
    from dgcli.engine.model import DiffusionModel

    return DiffusionModel(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_seq_max=n_seq_max)


def open_ar_engine(path: Path, *, threads: Optional[int], gpu_layers: int):
    from dgcli.engine.autoregressive import AutoregressiveEngine

    return AutoregressiveEngine(str(path), n_threads=threads, n_gpu_layers=gpu_layers)


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


def _use_live(no_live: bool, json_out: bool) -> bool:
    return not (no_live or json_out) and stdout.is_terminal


def _piece_of(model):
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
    view = render.DiffusionLiveView(_piece_of(model), model.detokenize, getattr(model, "end_token_ids", ()),
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


# ---------------------------------------------------------------- commands

ModelOpt = typer.Option(None, "--model", "-m", help="Registry name (`name` or `name:QUANT`, see `dg list`) or a .gguf path. Default: demo.")
YesOpt = typer.Option(False, "--yes", "-y", help="Download a missing registry model without asking.")
ThreadsOpt = typer.Option(None, "--threads", "-t", help="CPU threads (default: 1 for tiny models under 64 MB, else every core).")
GpuOpt = typer.Option(0, "--gpu-layers", "-ngl", help="Layers to offload to the GPU (-1 = all).")


@app.command("list")
def list_cmd(json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Registry models: role, pair, quants, size and whether each is on disk."""
    with user_errors():
        registry = _registry()
        rows = []
        for entry in registry.entries.values():
            if entry.shipped is not None:
                present = entry.shipped.exists()
                rows.append(dict(name=entry.name, quant=None, role=entry.role, pair=entry.pair, repo=None,
                                 file=str(entry.shipped), size=entry.shipped.stat().st_size if present else None,
                                 on_disk=present, default=True, description=entry.description))
                continue
            for quant, f in entry.files.items():
                path = hub.cached_path(entry.repo, f.filename)
                rows.append(dict(name=entry.name, quant=quant, role=entry.role, pair=entry.pair, repo=entry.repo,
                                 file=f.filename, size=path.stat().st_size if path else f.approx_size_bytes,
                                 on_disk=path is not None, default=quant == entry.default_quant,
                                 description=entry.description, path=str(path) if path else None))
        if json_out:
            typer.echo(json.dumps(rows, indent=2))
            return
        table = Table(title="dg models", caption_justify="left")
        table.add_column("name", no_wrap=True)
        table.add_column("quant", no_wrap=True)
        for col, kw in (("role", {}), ("pair", {}), ("size", {"justify": "right"}), ("on disk", {})):
            table.add_column(col, **kw)
        for r in rows:
            quant = (r["quant"] or "-") + (" *" if r["default"] and r["quant"] else "")
            size = hub.format_bytes(r["size"]) if r["size"] else "-"
            if not r["on_disk"] and r["size"]:
                size = "~" + size
            table.add_row(r["name"], quant, r["role"], r["pair"] or "-", size, "yes" if r["on_disk"] else "no")
        sources = [f"{e.name}: {e.repo or 'shipped with dg'}" for e in registry.entries.values()]
        table.caption = ("* default quant.  " + "; ".join(sources) +
                         ".  `dg pull NAME[:QUANT]` downloads; --model takes NAME, NAME:QUANT or a .gguf path.")
        stdout.print(table)


@app.command()
def pull(model: str = typer.Argument(..., help="NAME or NAME:QUANT (see `dg list`).")) -> None:
    """Download a registry model into the huggingface-hub cache (resumes an interrupted download)."""
    with user_errors():
        resolved = _registry().resolve(model)
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
        path = _download_with_progress(resolved)
        typer.echo(f"{resolved.display_name}: {path}")


@app.command("info")
def info_cmd(model: str = typer.Argument(..., help="A .gguf path or a registry name."),
             json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """What a GGUF holds (read directly, not loaded): architecture, quant, params, sampler defaults, RAM fit."""
    with user_errors():
        resolved = _registry().resolve(model)
        if resolved.path is None:
            if resolved.entry is not None and resolved.entry.shipped is not None:
                raise DgError(missing_shipped_message(resolved))
            raise DgError(f"{resolved.display_name} is not downloaded; run `dg pull {resolved.display_name}`")
        meta = ginfo.read_info(resolved.path)
        if json_out:
            typer.echo(json.dumps(meta.to_json(), indent=2))
            return
        fmt = hub.format_bytes
        summary = Table.grid(padding=(0, 2))
        summary.add_column(style="bold")
        summary.add_column()
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
            ("chat template", "yes" if meta.has_chat_template else "no"),
            ("memory", f"needs ~{fmt(meta.memory_needed)}; RAM {fmt(meta.ram_total)} total, {fmt(meta.ram_available)} available: "
                       + ("fits" if meta.fits_available_ram else "fits RAM but not what is free now" if meta.fits_ram else "DOES NOT FIT")),
        ]
        for k, v in rows:
            summary.add_row(k, v)
        stdout.print(summary)
        if meta.sampler_defaults:
            sampler = Table(title="sampler defaults (diffusion.eb_*)")
            sampler.add_column("parameter")
            sampler.add_column("value", justify="right")
            sampler.add_column("from")
            for k, v in meta.sampler_defaults.items():
                sampler.add_row(k, str(v), meta.sampler_defaults_source[k])
            stdout.print(sampler)
        types = Table(title="tensor types")
        for col in ("type", "tensors", "parameters", "size"):
            types.add_column(col, justify="left" if col == "type" else "right")
        for t in meta.tensor_types:
            types.add_row(t.type, str(t.tensors), f"{t.parameters:,}", fmt(t.bytes))
        stdout.print(types)


def _sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold) -> dict:
    return dict(max_denoising_steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                stability_threshold=stability_threshold, confidence_threshold=confidence_threshold)


StepsOpt = typer.Option(None, "--steps", help="Max denoising steps per canvas (GGUF default: diffusion.eb_max_steps).")
TMinOpt = typer.Option(None, "--t-min", help="Final temperature of the schedule.")
TMaxOpt = typer.Option(None, "--t-max", help="Initial temperature of the schedule.")
EBOpt = typer.Option(None, "--entropy-bound", help="Entropy budget of the accepted prefix per step (speed knob).")
StabOpt = typer.Option(None, "--stability-threshold", help="Steps the argmax canvas must stay unchanged to stop.")
ConfOpt = typer.Option(None, "--confidence-threshold", help="Mean entropy below which the canvas may stop.")
ThinkingOpt = typer.Option("show", "--thinking", help="Thinking channel: show (dimmed) or hide.")


def _check_thinking(thinking: str) -> None:
    if thinking not in ("show", "hide"):
        raise DgError(f"invalid --thinking {thinking!r}: must be show or hide")


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; '-' or omitted with piped stdin reads stdin."),
    model: Optional[str] = ModelOpt,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Stop after this many new tokens."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (canvas init, sampling, renoise)."),
    steps: Optional[int] = StepsOpt, t_min: Optional[float] = TMinOpt, t_max: Optional[float] = TMaxOpt,
    entropy_bound: Optional[float] = EBOpt, stability_threshold: Optional[int] = StabOpt,
    confidence_threshold: Optional[float] = ConfOpt,
    threads: Optional[int] = ThreadsOpt, gpu_layers: int = GpuOpt,
    thinking: str = ThinkingOpt,
    self_cond_top_k: Optional[int] = typer.Option(
        None, "--self-cond-top-k",
        help="Tokens per position fed back to self-conditioning (0 = all; default: all for small vocabularies, "
             "else 64; the mass left out is in the trace as sc_dropped_mass)."),
    no_live: bool = typer.Option(False, "--no-live", help="Plain streaming (automatic when stdout is not a terminal)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result and the per-step trace as JSON."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write per-step JSON lines to this file."),
    yes: bool = YesOpt,
) -> None:
    """Generate with DiffusionGemma, watching the canvas denoise live."""
    with user_errors():
        _check_thinking(thinking)
        if self_cond_top_k is not None and self_cond_top_k < 0:
            raise InvalidParameter("self_cond_top_k", self_cond_top_k, "an integer >= 0 (0 = all tokens)")
        check_generation_args(max_new_tokens, threads, gpu_layers)
        text = read_prompt(prompt)
        resolved, path = resolve_model(model, yes=yes, want="diffusion")
        preflight(path, diffusion=True, command="generate", gpu_layers=gpu_layers)
        params = diffusion_params(path, **_sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold,
                                                         confidence_threshold))
        live = _use_live(no_live, json_out)
        with atomic_outputs(trace) as (trace_out,):
            engine = open_diffusion_engine(path, threads=threads, gpu_layers=gpu_layers)
            try:
                check_prompt_fits(engine, text, max_new_tokens)
                events: Optional[list] = [] if json_out else None
                result = run_diffusion(engine, text, params=params, max_new_tokens=max_new_tokens, seed=seed,
                                       live=live, thinking=thinking, trace=trace_out if trace else None, events=events,
                                       stream_plain=not live and not json_out, self_cond_top_k=self_cond_top_k)
            finally:
                engine.close()
        thought, answer = render.split_thinking(result.text)
        if json_out:
            doc = dict(model=dict(name=resolved.display_name, path=str(path)), prompt=text, params=params.__dict__,
                       max_new_tokens=max_new_tokens, seed=seed, answer=answer.strip(),
                       thinking=thought.strip() if thought is not None else None,
                       result=result.to_json(), trace=events)
            typer.echo(json.dumps(doc, indent=2))
        elif live:
            stdout.print(render.answer_renderable(result.text, thinking))
            stderr.print(render.result_summary(result), style="cyan")
        else:
            streamed = getattr(result, "_streamed_chars", 0)
            if thinking == "show":
                typer.echo(result.text[streamed:] if streamed <= len(result.text) else "")
            else:
                typer.echo(answer.strip())
            typer.echo(render.result_summary(result), err=True)
        if result.interrupted:
            typer.echo("interrupted: the output above is what was produced so far", err=True)
            raise typer.Exit(EXIT_INTERRUPTED)


@app.command()
def compare(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; '-' or omitted with piped stdin reads stdin."),
    model: Optional[str] = ModelOpt,
    ar_model: Optional[str] = typer.Option(None, "--ar-model", help="The autoregressive side (default: the registry pair)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    steps: Optional[int] = StepsOpt, t_min: Optional[float] = TMinOpt, t_max: Optional[float] = TMaxOpt,
    entropy_bound: Optional[float] = EBOpt, stability_threshold: Optional[int] = StabOpt,
    confidence_threshold: Optional[float] = ConfOpt,
    threads: Optional[int] = ThreadsOpt, gpu_layers: int = GpuOpt,
    thinking: str = ThinkingOpt,
    no_live: bool = typer.Option(False, "--no-live", help="No live panels (automatic when stdout is not a terminal)."),
    json_out: bool = typer.Option(False, "--json", help="Print both results and the comparison as JSON."),
    yes: bool = YesOpt,
) -> None:
    """Diffusion vs its autoregressive pair on the same prompt: two panels, then a table and the speedup.

    The models run one after the other (each closed before the next loads), so both are never in memory at once.
    """
    from dgcli.bench import PeakRss

    with user_errors():
        _check_thinking(thinking)
        check_generation_args(max_new_tokens, threads, gpu_layers)
        text = read_prompt(prompt)
        diff_res, diff_path = resolve_model(model, yes=yes, want="diffusion")
        ar_res, ar_path = resolve_pair(diff_res, ar_model, yes=yes)
        preflight(diff_path, diffusion=True, command="compare", gpu_layers=gpu_layers)
        preflight(ar_path, diffusion=False, command="compare", gpu_layers=gpu_layers)
        params = diffusion_params(diff_path, **_sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold,
                                                              confidence_threshold))
        live = _use_live(no_live, json_out)
        ar_live_view = render.AutoregressiveLiveView(title=f"autoregressive: {ar_res.display_name}", thinking=thinking)
        side = lv = None
        if live:
            placeholder = render.DiffusionLiveView(lambda t: "", lambda ids: "", title="diffusion: loading…")
            side = render.SideBySide(placeholder, ar_live_view)
            lv = Live(side, console=stdout, auto_refresh=False, transient=False)
            lv.start()
        try:
            with PeakRss() as diff_rss:
                engine = open_diffusion_engine(diff_path, threads=threads, gpu_layers=gpu_layers)
                try:
                    check_prompt_fits(engine, text, max_new_tokens)
                    if not live:
                        typer.echo(f"diffusion: {diff_res.display_name}", err=True)
                    d = run_diffusion(engine, text, params=params, max_new_tokens=max_new_tokens, seed=seed,
                                      live=live, thinking=thinking, trace=None, events=None,
                                      title=f"diffusion: {diff_res.display_name}", live_obj=lv,
                                      panel_slot=(lambda v: setattr(side, "left", v)) if side else None)
                finally:
                    engine.close()
            if d.interrupted:
                if lv is not None:
                    lv.stop()
                    lv = None
                typer.echo(render.answer_plain(d.text, thinking))
                typer.echo("interrupted: the diffusion output above is what was produced; the AR side did not run", err=True)
                raise typer.Exit(EXIT_INTERRUPTED)
            with PeakRss() as ar_rss:
                ar_engine = open_ar_engine(ar_path, threads=threads, gpu_layers=gpu_layers)
                try:
                    throttle = Throttle()

                    def on_token(ev):
                        ar_live_view.on_event(ev)
                        if lv is not None and throttle.ready():
                            lv.refresh()

                    a = ar_engine.generate(text, max_new_tokens=max_new_tokens, seed=seed, on_event=on_token)
                finally:
                    ar_engine.close()
        finally:
            if lv is not None:
                lv.refresh()
                lv.stop()
        s = render.speedup(d, a)
        if json_out:
            typer.echo(json.dumps(dict(
                prompt=text, params=params.__dict__, max_new_tokens=max_new_tokens, seed=seed,
                diffusion=dict(model=diff_res.display_name, path=str(diff_path), peak_rss=diff_rss.peak, result=d.to_json()),
                autoregressive=dict(model=ar_res.display_name, path=str(ar_path), peak_rss=ar_rss.peak, result=a.to_json()),
                speedup=s,
            ), indent=2))
            return
        if not live:
            typer.echo("--- diffusion ---")
            typer.echo(render.answer_plain(d.text, thinking))
            typer.echo("--- autoregressive ---")
            typer.echo(render.answer_plain(a.text, thinking))
        stdout.print(render.compare_table(d, a, diff_rss.peak, ar_rss.peak, diff_res.display_name, ar_res.display_name))
        if a.interrupted:
            raise typer.Exit(EXIT_INTERRUPTED)


@app.command()
def bench(
    model: Optional[str] = ModelOpt,
    ar_model: Optional[str] = typer.Option(None, "--ar-model", help="The autoregressive side (default: the registry pair)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompt file: one prompt per line, `name<TAB>prompt`, or `name<TAB>prompt<TAB>answer` (accuracy). Default: the model's own set (demo), else math/Korean/code/trivial."),
    repeat: int = typer.Option(3, "--repeat", "-r", help="Runs per prompt and model (median and spread reported)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    seed: int = typer.Option(0, "--seed", help="Base seed; run i uses seed+i."),
    steps: Optional[int] = StepsOpt, t_min: Optional[float] = TMinOpt, t_max: Optional[float] = TMaxOpt,
    entropy_bound: Optional[float] = EBOpt, stability_threshold: Optional[int] = StabOpt,
    confidence_threshold: Optional[float] = ConfOpt,
    batch_sizes: str = typer.Option("1,2,4,8,16", "--batch-sizes", help="Batch sizes for the speed-model sweep."),
    no_speed_model: bool = typer.Option(False, "--no-speed-model", help="Skip the canvas-forward vs AR-decode measurement."),
    threads: Optional[int] = ThreadsOpt, gpu_layers: int = GpuOpt,
    json_out: bool = typer.Option(False, "--json", help="Print the whole report as JSON."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Also write the JSON report to this file."),
    yes: bool = YesOpt,
) -> None:
    """Benchmark both models: tok/s, steps per canvas, tokens per forward, and the canvas-vs-decode speed model."""
    from dgcli import bench as benchlib

    with user_errors():
        check_generation_args(max_new_tokens, threads, gpu_layers)
        if repeat < 1:
            raise DgError(f"invalid repeat={repeat}: must be an integer >= 1")
        sizes = benchlib.parse_batch_sizes(batch_sizes)
        diff_res, diff_path = resolve_model(model, yes=yes, want="diffusion")
        own_prompts = diff_res.entry.bench_prompts if diff_res.entry is not None else None
        prompt_set = benchlib.load_prompts(prompts or own_prompts) if (prompts or own_prompts) \
            else benchlib.BUILTIN_PROMPTS
        ar_res, ar_path = resolve_pair(diff_res, ar_model, yes=yes)
        preflight(diff_path, diffusion=True, command="bench", gpu_layers=gpu_layers)
        preflight(ar_path, diffusion=False, command="bench", gpu_layers=gpu_layers)
        params = diffusion_params(diff_path, **_sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold,
                                                              confidence_threshold))
        config = benchlib.BenchConfig(
            diffusion_model=diff_res.display_name, diffusion_path=str(diff_path),
            ar_model=ar_res.display_name, ar_path=str(ar_path), repeat=repeat, max_new_tokens=max_new_tokens,
            seed=seed, params=params, batch_sizes=sizes, speed_model=not no_speed_model,
            n_threads=threads, n_gpu_layers=gpu_layers,
        )
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with atomic_outputs(output) as (out,):
            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=stderr, transient=True, disable=json_out and not stderr.is_terminal)
            with progress:
                task = progress.add_task("bench", total=benchlib.total_units(config, prompt_set))

                def on_progress(desc: str) -> None:
                    progress.update(task, advance=1, description=desc)

                report = benchlib.run_bench(config, prompt_set, on_progress=on_progress,
                                            open_diffusion=lambda p: open_diffusion_engine(p, threads=threads, gpu_layers=gpu_layers),
                                            open_ar=lambda p: open_ar_engine(p, threads=threads, gpu_layers=gpu_layers),
                                            open_speed_model=lambda p, n: open_speed_model(p, n, threads=threads, gpu_layers=gpu_layers))
            doc = report.to_json()
            out.write_all(doc)
        if json_out:
            typer.echo(json.dumps(doc, indent=2))
            return
        for table in benchlib.report_tables(report):
            stdout.print(table)
        for note in report.notes:
            stdout.print(f"note: {note}", style="yellow")


@app.command()
def convert(
    hf_dir: Path = typer.Argument(..., help="A Hugging Face DiffusionGemma checkpoint directory."),
    out: Path = typer.Argument(..., help="The GGUF file to write."),
    outtype: str = typer.Option("bf16", "--outtype", help="f32, f16, bf16 or q8_0."),
    ar_twin: Optional[Path] = typer.Option(None, "--ar-twin", help="Also write the AR (gemma4) twin of the same weights here."),
) -> None:
    """Convert a Hugging Face DiffusionGemma checkpoint to a GGUF in the published layout."""
    with user_errors():
        from dgcli.convert import convert_main

        convert_main(hf_dir, out, outtype=outtype, ar_twin=ar_twin, echo=typer.echo)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
