"""`dg compare`: diffusion vs its autoregressive pair on the same prompt."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.live import Live

from dgcli import render
from dgcli.commands import _shared as shared


def compare(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; '-' or omitted with piped stdin reads stdin."),
    model: Optional[str] = shared.ModelOpt,
    ar_model: Optional[str] = typer.Option(None, "--ar-model", help="The autoregressive side (default: the registry pair)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    steps: Optional[int] = shared.StepsOpt, t_min: Optional[float] = shared.TMinOpt, t_max: Optional[float] = shared.TMaxOpt,
    entropy_bound: Optional[float] = shared.EBOpt, stability_threshold: Optional[int] = shared.StabOpt,
    confidence_threshold: Optional[float] = shared.ConfOpt,
    threads: Optional[int] = shared.ThreadsOpt, gpu_layers: int = shared.GpuOpt,
    n_cpu_moe: Optional[int] = shared.NCpuMoeOpt, cpu_moe: bool = shared.CpuMoeOpt, verbose: bool = shared.VerboseOpt,
    thinking: str = shared.ThinkingOpt,
    no_live: bool = typer.Option(False, "--no-live", help="No live panels (automatic when stdout is not a terminal)."),
    json_out: bool = typer.Option(False, "--json", help="Print both results and the comparison as JSON."),
    yes: bool = shared.YesOpt,
) -> None:
    """Diffusion vs its autoregressive pair on the same prompt: two panels, then a table and the speedup.

    The models run one after the other (each closed before the next loads), so both are never in memory at once.
    """
    from dgcli.bench import PeakRss

    with shared.user_errors():
        shared.check_thinking(thinking)
        shared.check_generation_args(max_new_tokens, threads, gpu_layers)
        gpu_layers, n_cpu_moe = shared.resolve_offload(gpu_layers, n_cpu_moe, cpu_moe)
        text = shared.read_prompt(prompt)
        diff_res, diff_path = shared.resolve_model(model, yes=yes, want="diffusion")
        ar_res, ar_path = shared.resolve_pair(diff_res, ar_model, yes=yes)
        shared.preflight(diff_path, diffusion=True, command="compare", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe)
        shared.preflight(ar_path, diffusion=False, command="compare", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe)
        params = shared.diffusion_params(diff_path, **shared.sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold,
                                                              confidence_threshold))
        live = shared.use_live(no_live, json_out)
        ar_live_view = render.AutoregressiveLiveView(title=f"autoregressive: {ar_res.display_name}", thinking=thinking)
        side = lv = None
        if live:
            placeholder = render.DiffusionLiveView(lambda t: "", lambda ids: "", title="diffusion: loading…")
            side = render.SideBySide(placeholder, ar_live_view)
            lv = Live(side, console=shared.stdout, auto_refresh=False, transient=False)
            lv.start()
        try:
            with PeakRss() as diff_rss:
                engine = shared.open_diffusion_engine(diff_path, threads=threads, gpu_layers=gpu_layers,
                                                      n_cpu_moe=n_cpu_moe, verbose=verbose)
                try:
                    shared.check_prompt_fits(engine, text, max_new_tokens)
                    if not live:
                        typer.echo(f"diffusion: {diff_res.display_name}", err=True)
                    d = shared.run_diffusion(engine, text, params=params, max_new_tokens=max_new_tokens, seed=seed,
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
                raise typer.Exit(shared.EXIT_INTERRUPTED)
            with PeakRss() as ar_rss:
                ar_engine = shared.open_ar_engine(ar_path, threads=threads, gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                                                  verbose=verbose)
                try:
                    throttle = shared.Throttle()

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
        shared.stdout.print(render.compare_table(d, a, diff_rss.peak, ar_rss.peak, diff_res.display_name, ar_res.display_name))
        if a.interrupted:
            raise typer.Exit(shared.EXIT_INTERRUPTED)
