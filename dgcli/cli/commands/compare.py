"""`dg compare`: diffusion vs its autoregressive pair on the same prompt."""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer

from dgcli.cli import _display, _errors, _models, _options, _output, _prompt, _status, _terminal, render
from dgcli.modelfile import info as ginfo
from dgcli.errors import WORKER_LOST
from dgcli.units import plural

# 2: the AR side's tokens_per_second counts only the answer tokens made after the prefill (null when none were)
# 3: tokens_per_forward counts the commit passes as forwards; placement buffers in bytes
COMPARE_SCHEMA = "dg-compare/3"


def compare(
    prompt: Optional[str] = _options.PromptArg,
    prompt_opt: Optional[str] = _options.PromptOpt,
    file: Optional[Path] = _options.FileOpt,
    system: Optional[str] = _options.SystemOpt,
    raw: bool = _options.RawOpt,
    model: Optional[str] = _options.ModelOpt,
    ar_model: Optional[str] = typer.Option(None, "--ar-model", help="The autoregressive side (default: the registry pair).", show_default=False),
    max_new_tokens: int = _options.max_new_tokens_option(
        "At most this many answer tokens per side (-1: as many as each side's context holds)."),
    seed: Optional[int] = _options.SeedOpt,
    temp: Optional[float] = typer.Option(None, "--temp", show_default=False,
                                         help="A constant temperature for both sides (the AR side is greedy without it)."),
    steps: Optional[int] = _options.StepsOpt, t_min: Optional[float] = _options.TMinOpt, t_max: Optional[float] = _options.TMaxOpt,
    entropy_bound: Optional[float] = _options.EBOpt, stability_threshold: Optional[int] = _options.StabOpt,
    confidence_threshold: Optional[float] = _options.ConfOpt,
    ctx_size: Optional[int] = _options.CtxOpt,
    threads: Optional[int] = _options.ThreadsOpt, gpu_layers: int = _options.GpuOpt,
    rpc: Optional[str] = _options.RpcOpt,
    n_cpu_moe: Optional[int] = _options.NCpuMoeOpt, cpu_moe: bool = _options.CpuMoeOpt, verbose: bool = _options.VerboseOpt,
    thinking: str = _options.ThinkingOpt,
    pace: float = typer.Option(0.0, "--pace", help="Seconds each forward stays on screen at least, on both sides: a "
                                                    "denoising step, an AR token (0 = as fast as they run)."),
    no_live: bool = typer.Option(False, "--no-live", help="No live panels (automatic when stdout is not a terminal)."),
    json_out: bool = typer.Option(False, "--json", help=f"Print both results and the comparison as JSON ({COMPARE_SCHEMA})."),
    parse_special: bool = _options.ParseSpecialOpt,
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Both sides keep generating past end tokens, up to "
                                                                 "--max-new-tokens (as llama.cpp's --ignore-eos)."),
    yes: bool = _options.YesOpt,
) -> None:
    """Diffusion vs its autoregressive pair on the same prompt: two panels, then a table and the speedup.

    The models run one after the other (each closed before the next loads), so both are never in memory at once.
    """
    from dgcli.bench import PeakRss

    with _errors.user_errors():
        _options.check_thinking(thinking)
        _options.check_generation_args(max_new_tokens, threads, gpu_layers, ctx_size, pace, unlimited_ok=True)
        gpu_layers, n_cpu_moe = _options.resolve_offload(gpu_layers, n_cpu_moe, cpu_moe)
        rpc_servers, gpu_layers = _options.rpc_placement(rpc, gpu_layers)
        system = _prompt.check_prompt_options(system, raw)
        run_seed = _options.seed_of(seed)
        text = _prompt.read_prompt(prompt, prompt_opt, file)
        diff_res, diff_path = _models.resolve_model(model, yes=yes, want="diffusion")
        ar_res, ar_path = _models.resolve_pair(diff_res, ar_model, yes=yes)
        _models.preflight(diff_path, diffusion=True, command="compare", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                         ctx_size=ctx_size)
        _models.preflight(ar_path, diffusion=False, command="compare", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                         ctx_size=ctx_size)
        quant = ginfo.quant_pair(diff_path, ar_path)
        params = _options.diffusion_params(diff_path, temp, **_options.sampler_flags(
            steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold))
        live = _terminal.use_live(no_live, json_out)
        diff_title, ar_title = f"diffusion: {diff_res.display_name}", f"autoregressive: {ar_res.display_name}"
        ar_view = render.AutoregressiveLiveView(title=ar_title, thinking=thinking)
        side = render.SideBySide(render.DiffusionLiveView(lambda t: "", lambda ids: "", title=diff_title),
                                 ar_view) if live else None
        if side is not None:
            side.left.start_activity(f"loading {diff_res.display_name}")  # drawn as the view starts
        with _terminal.live_view(side) if side is not None else nullcontext() as lv, \
                _display.BusyTicker(lv, lambda: [side.left, side.right]) if side is not None else nullcontext(), \
                _status.StatusLine(enabled=False if side is not None else None) as status:
            status.show(f"diffusion: loading {diff_res.display_name}")
            with PeakRss() as diff_rss:
                engine = _models.open_diffusion_engine(diff_path, threads=threads, gpu_layers=gpu_layers,
                                                      **_options.rpc_option(rpc_servers),
                                                      n_cpu_moe=n_cpu_moe, ctx_size=ctx_size, verbose=verbose)
                diff_placement = _models.placement_of(engine.model)
                try:
                    ids = _prompt.prompt_ids(engine.model, text, system=system, raw=raw, parse_special=parse_special)
                    _prompt.check_prompt_fits(engine, len(ids), ctx_size)
                    if not live:
                        _output.notice(diff_title)
                    view = _display.diffusion_view(engine.model, title=diff_title, thinking=thinking,
                                                   ignore_eos=ignore_eos)
                    if side is not None:
                        side.left = view
                    d = _display.run_diffusion(engine, ids, params=params, seed=run_seed,
                                             max_new_tokens=_options.answer_limit(max_new_tokens, engine.model, len(ids)),
                                             live=live, thinking=thinking, live_obj=lv, view=view, pace=pace,
                                             status=status, status_prefix="diffusion: ", tick=False,
                                             ignore_eos=ignore_eos)
                finally:
                    engine.close()
            a = ar_rss = ar_placement = None
            if not d.interrupted:
                try:
                    with PeakRss() as ar_rss:
                        a, ar_placement = _run_ar_side(ar_path, ar_res.display_name, text, ar_view, lv, status,
                                         system=system, raw=raw, parse_special=parse_special, pace=pace,
                                         engine_options=dict(threads=threads, gpu_layers=gpu_layers,
                                                             n_cpu_moe=n_cpu_moe, **_options.rpc_option(rpc_servers),
                                                             ctx_size=ctx_size, verbose=verbose),
                                         max_new_tokens=max_new_tokens, seed=run_seed, temperature=temp or 0.0,
                                         ignore_eos=ignore_eos)
                except KeyboardInterrupt:  # while the AR model loaded: the diffusion side is kept
                    pass

        def json_doc() -> str:
            return json.dumps(dict(
                schema=COMPARE_SCHEMA, prompt=text, system=system, raw=raw, params=params.__dict__,
                max_new_tokens=max_new_tokens, seed=run_seed, ignore_eos=ignore_eos,
                diffusion=dict(model=diff_res.display_name, path=str(diff_path), peak_rss=diff_rss.peak,
                               placement=diff_placement, result=d.to_json()),
                autoregressive=None if a is None else dict(model=ar_res.display_name, path=str(ar_path),
                                                           peak_rss=ar_rss.peak, placement=ar_placement,
                                                           result=a.to_json()),
                speedup=None if a is None else render.speedup(d, a),
                quantization=quant.to_json(),
            ), indent=2)

        if a is None:
            if d.interrupted:
                view.note = "(interrupted)"
            ar_view.note = "(not run)"
            if json_out:
                typer.echo(json_doc())
            elif side is not None:
                _output.stdout.print(side.whole())
            else:
                _output.echo_text(render.answer_plain(d.text, thinking))
                _output.notice(render.result_summary(d))
            if d.stop_reason == WORKER_LOST:
                from dgcli.runtime import rpc

                rpc.check_workers()  # its one line and exit status, after the answer it cut short
            _output.notice("interrupted: the diffusion output above is what was produced; the AR side did not run")
            raise typer.Exit(_errors.EXIT_INTERRUPTED)
        if a.interrupted:
            ar_view.note = "(interrupted)"
        if side is not None:
            _output.stdout.print(side.whole())  # the live panels were cut to the terminal's height
        if json_out:
            typer.echo(json_doc())
        else:
            if not live:
                typer.echo("--- diffusion ---")
                _output.echo_text(render.answer_plain(d.text, thinking))
                typer.echo("--- autoregressive ---")
                _output.echo_text(render.answer_plain(a.text, thinking))
            _output.print_table(render.compare_table(d, a, diff_rss.peak, ar_rss.peak, diff_res.display_name,
                                                    ar_res.display_name, quant=quant))
        if a.stop_reason == WORKER_LOST:
            from dgcli.runtime import rpc

            rpc.check_workers()
        if a.interrupted:
            _output.notice("interrupted: the AR output above is what was produced")
            raise typer.Exit(_errors.EXIT_INTERRUPTED)


def _run_ar_side(path: Path, name: str, text: str, view: render.AutoregressiveLiveView, live_obj,
                 status: _status.StatusLine, *, system: Optional[str], raw: bool, parse_special: bool, pace: float,
                 engine_options: dict, max_new_tokens: int, seed: int, temperature: float, ignore_eos: bool):
    """The autoregressive pair on the same prompt (its own tokenizer and template), drawn in `view` (or
    said by `status`), each token held `pace` seconds as the diffusion side's steps; with where its
    weights went (_models.placement_of)."""
    def doing(activity: str) -> None:
        view.start_activity(activity)
        status.show(f"autoregressive: {activity}")
        if live_obj is not None:
            _terminal.refresh(live_obj)

    doing(f"loading {name}")
    engine = _models.open_ar_engine(path, **engine_options)
    try:
        ids = _prompt.prompt_ids(engine.model, text, system=system, raw=raw, parse_special=parse_special)
        doing(f"prefill of {plural(len(ids), 'token')}, then token 1")
        throttle, pacer = _terminal.Throttle(), _terminal.Pacer(pace)

        def on_token(ev) -> None:
            view.busy_since = None  # the engine waits for this callback
            view.on_event(ev)
            if live_obj is not None and throttle.ready(force=pace > 0):
                _terminal.refresh(live_obj)
            pacer.wait()
            status.show(f"autoregressive: token {ev.index + 2}")
            view.busy_since = time.monotonic()

        result = engine.generate(ids, max_new_tokens=_options.answer_limit(max_new_tokens, engine.model, len(ids)),
                                 seed=seed, on_event=on_token,
                                 temperature=temperature, ignore_eos=ignore_eos)
        view.busy_since = None
        return result, _models.placement_of(engine.model)
    finally:
        engine.close()
