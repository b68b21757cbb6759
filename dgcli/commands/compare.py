"""`dg compare`: diffusion vs its autoregressive pair on the same prompt."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer

from dgcli import render
from dgcli.commands import _shared as shared
from dgcli.engine.types import WORKER_LOST

# 2: the AR side's tokens_per_second counts only the answer tokens made after the prefill (null when none were)
COMPARE_SCHEMA = "dg-compare/2"


def compare(
    prompt: Optional[str] = shared.PromptArg,
    prompt_opt: Optional[str] = shared.PromptOpt,
    file: Optional[Path] = shared.FileOpt,
    system: Optional[str] = shared.SystemOpt,
    raw: bool = shared.RawOpt,
    model: Optional[str] = shared.ModelOpt,
    ar_model: Optional[str] = typer.Option(None, "--ar-model", help="The autoregressive side (default: the registry pair).", show_default=False),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="At most this many answer tokens per side."),
    seed: Optional[int] = shared.SeedOpt,
    temp: Optional[float] = typer.Option(None, "--temp", show_default=False,
                                         help="A constant temperature for both sides (the AR side is greedy without it)."),
    steps: Optional[int] = shared.StepsOpt, t_min: Optional[float] = shared.TMinOpt, t_max: Optional[float] = shared.TMaxOpt,
    entropy_bound: Optional[float] = shared.EBOpt, stability_threshold: Optional[int] = shared.StabOpt,
    confidence_threshold: Optional[float] = shared.ConfOpt,
    ctx_size: Optional[int] = shared.CtxOpt,
    threads: Optional[int] = shared.ThreadsOpt, gpu_layers: int = shared.GpuOpt,
    rpc: Optional[str] = shared.RpcOpt,
    n_cpu_moe: Optional[int] = shared.NCpuMoeOpt, cpu_moe: bool = shared.CpuMoeOpt, verbose: bool = shared.VerboseOpt,
    thinking: str = shared.ThinkingOpt,
    pace: float = shared.PaceOpt,
    no_live: bool = typer.Option(False, "--no-live", help="No live panels (automatic when stdout is not a terminal)."),
    json_out: bool = typer.Option(False, "--json", help=f"Print both results and the comparison as JSON ({COMPARE_SCHEMA})."),
    parse_special: bool = shared.ParseSpecialOpt,
    yes: bool = shared.YesOpt,
) -> None:
    """Diffusion vs its autoregressive pair on the same prompt: two panels, then a table and the speedup.

    The models run one after the other (each closed before the next loads), so both are never in memory at once.
    """
    from dgcli.bench import PeakRss

    with shared.user_errors():
        shared.check_thinking(thinking)
        shared.check_generation_args(max_new_tokens, threads, gpu_layers, ctx_size, pace)
        gpu_layers, n_cpu_moe = shared.resolve_offload(gpu_layers, n_cpu_moe, cpu_moe)
        rpc_servers, gpu_layers = shared.rpc_placement(rpc, gpu_layers)
        system = shared.check_prompt_options(system, raw)
        run_seed = shared.seed_of(seed)
        text = shared.read_prompt(prompt, prompt_opt, file)
        diff_res, diff_path = shared.resolve_model(model, yes=yes, want="diffusion")
        ar_res, ar_path = shared.resolve_pair(diff_res, ar_model, yes=yes)
        shared.preflight(diff_path, diffusion=True, command="compare", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                         ctx_size=ctx_size)
        shared.preflight(ar_path, diffusion=False, command="compare", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                         ctx_size=ctx_size)
        params = shared.diffusion_params(diff_path, temp, **shared.sampler_flags(
            steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold))
        live = shared.use_live(no_live, json_out)
        diff_title, ar_title = f"diffusion: {diff_res.display_name}", f"autoregressive: {ar_res.display_name}"
        ar_view = render.AutoregressiveLiveView(title=ar_title, thinking=thinking)
        side = render.SideBySide(render.DiffusionLiveView(lambda t: "", lambda ids: "", title=diff_title),
                                 ar_view) if live else None
        with shared.live_view(side) if side is not None else nullcontext() as lv:
            with PeakRss() as diff_rss:
                engine = shared.open_diffusion_engine(diff_path, threads=threads, gpu_layers=gpu_layers,
                                                      **shared.rpc_option(rpc_servers),
                                                      n_cpu_moe=n_cpu_moe, ctx_size=ctx_size, verbose=verbose)
                diff_placement = shared.placement_of(engine.model)
                try:
                    ids = shared.prompt_ids(engine.model, text, system=system, raw=raw, parse_special=parse_special)
                    shared.check_prompt_fits(engine, len(ids))
                    if not live:
                        typer.echo(diff_title, err=True)
                    view = shared.diffusion_view(engine.model, title=diff_title, thinking=thinking)
                    if side is not None:
                        side.left = view
                    d = shared.run_diffusion(engine, ids, params=params, max_new_tokens=max_new_tokens, seed=run_seed,
                                             live=live, thinking=thinking, live_obj=lv, view=view, pace=pace)
                finally:
                    engine.close()
            a = ar_rss = ar_placement = None
            if not d.interrupted:
                try:
                    with PeakRss() as ar_rss:
                        a, ar_placement = _run_ar_side(ar_path, text, ar_view, lv, system=system, raw=raw,
                                         parse_special=parse_special,
                                         engine_options=dict(threads=threads, gpu_layers=gpu_layers,
                                                             n_cpu_moe=n_cpu_moe, **shared.rpc_option(rpc_servers),
                                                             ctx_size=ctx_size, verbose=verbose),
                                         max_new_tokens=max_new_tokens, seed=run_seed, temperature=temp or 0.0)
                except KeyboardInterrupt:  # while the AR model loaded: the diffusion side is kept
                    pass

        def json_doc() -> str:
            return json.dumps(dict(
                schema=COMPARE_SCHEMA, prompt=text, system=system, raw=raw, params=params.__dict__,
                max_new_tokens=max_new_tokens, seed=run_seed,
                diffusion=dict(model=diff_res.display_name, path=str(diff_path), peak_rss=diff_rss.peak,
                               placement=diff_placement, result=d.to_json()),
                autoregressive=None if a is None else dict(model=ar_res.display_name, path=str(ar_path),
                                                           peak_rss=ar_rss.peak, placement=ar_placement,
                                                           result=a.to_json()),
                speedup=None if a is None else render.speedup(d, a),
            ), indent=2)

        if a is None:
            if d.interrupted:
                view.note = "(interrupted)"
            ar_view.note = "(not run)"
            if json_out:
                typer.echo(json_doc())
            elif side is not None:
                shared.stdout.print(side.whole())
            else:
                shared.echo_text(render.answer_plain(d.text, thinking))
                shared.notice(render.result_summary(d))
            if d.stop_reason == WORKER_LOST:
                from dgcli.engine import rpc

                rpc.check_workers()  # its one line and exit status, after the answer it cut short
            shared.notice("interrupted: the diffusion output above is what was produced; the AR side did not run")
            raise typer.Exit(shared.EXIT_INTERRUPTED)
        if a.interrupted:
            ar_view.note = "(interrupted)"
        if side is not None:
            shared.stdout.print(side.whole())  # the live panels were cut to the terminal's height
        if json_out:
            typer.echo(json_doc())
        else:
            if not live:
                typer.echo("--- diffusion ---")
                shared.echo_text(render.answer_plain(d.text, thinking))
                typer.echo("--- autoregressive ---")
                shared.echo_text(render.answer_plain(a.text, thinking))
            shared.print_table(render.compare_table(d, a, diff_rss.peak, ar_rss.peak, diff_res.display_name,
                                                    ar_res.display_name))
        if a.stop_reason == WORKER_LOST:
            from dgcli.engine import rpc

            rpc.check_workers()
        if a.interrupted:
            shared.notice("interrupted: the AR output above is what was produced")
            raise typer.Exit(shared.EXIT_INTERRUPTED)


def _run_ar_side(path: Path, text: str, view: render.AutoregressiveLiveView, live_obj, *, system: Optional[str],
                 raw: bool, parse_special: bool, engine_options: dict, max_new_tokens: int, seed: int,
                 temperature: float):
    """The autoregressive pair on the same prompt (its own tokenizer and template), drawn in `view`; with
    where its weights went (shared.placement_of)."""
    engine = shared.open_ar_engine(path, **engine_options)
    try:
        ids = shared.prompt_ids(engine.model, text, system=system, raw=raw, parse_special=parse_special)
        throttle = shared.Throttle()

        def on_token(ev) -> None:
            view.on_event(ev)
            if live_obj is not None and throttle.ready():
                shared.refresh(live_obj)

        result = engine.generate(ids, max_new_tokens=max_new_tokens, seed=seed, on_event=on_token,
                                 temperature=temperature)
        return result, shared.placement_of(engine.model)
    finally:
        engine.close()
