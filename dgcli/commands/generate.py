"""`dg generate`: DiffusionGemma on one prompt, the canvas denoising live."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dgcli import render
from dgcli.engine.types import InvalidParameter
from dgcli.commands import _shared as shared


def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; '-' or omitted with piped stdin reads stdin."),
    model: Optional[str] = shared.ModelOpt,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Stop after this many new tokens."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (canvas init, sampling, renoise)."),
    steps: Optional[int] = shared.StepsOpt, t_min: Optional[float] = shared.TMinOpt, t_max: Optional[float] = shared.TMaxOpt,
    entropy_bound: Optional[float] = shared.EBOpt, stability_threshold: Optional[int] = shared.StabOpt,
    confidence_threshold: Optional[float] = shared.ConfOpt,
    threads: Optional[int] = shared.ThreadsOpt, gpu_layers: int = shared.GpuOpt,
    n_cpu_moe: Optional[int] = shared.NCpuMoeOpt, cpu_moe: bool = shared.CpuMoeOpt, verbose: bool = shared.VerboseOpt,
    thinking: str = shared.ThinkingOpt,
    self_cond_top_k: Optional[int] = typer.Option(
        None, "--self-cond-top-k",
        help="Tokens per position fed back to self-conditioning (0 = all; default: all for small vocabularies, "
             "else 64; the mass left out is in the trace as sc_dropped_mass)."),
    no_live: bool = typer.Option(False, "--no-live", help="Plain streaming (automatic when stdout is not a terminal)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result and the per-step trace as JSON."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write per-step JSON lines to this file."),
    yes: bool = shared.YesOpt,
) -> None:
    """Generate with DiffusionGemma, watching the canvas denoise live."""
    with shared.user_errors():
        shared.check_thinking(thinking)
        if self_cond_top_k is not None and self_cond_top_k < 0:
            raise InvalidParameter("self_cond_top_k", self_cond_top_k, "an integer >= 0 (0 = all tokens)")
        shared.check_generation_args(max_new_tokens, threads, gpu_layers)
        gpu_layers, n_cpu_moe = shared.resolve_offload(gpu_layers, n_cpu_moe, cpu_moe)
        text = shared.read_prompt(prompt)
        resolved, path = shared.resolve_model(model, yes=yes, want="diffusion")
        shared.preflight(path, diffusion=True, command="generate", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe)
        params = shared.diffusion_params(path, **shared.sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold,
                                                         confidence_threshold))
        live = shared.use_live(no_live, json_out)
        with shared.atomic_outputs(trace) as (trace_out,):
            engine = shared.open_diffusion_engine(path, threads=threads, gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                                                  verbose=verbose)
            try:
                shared.check_prompt_fits(engine, text, max_new_tokens)
                events: Optional[list] = [] if json_out else None
                result = shared.run_diffusion(engine, text, params=params, max_new_tokens=max_new_tokens, seed=seed,
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
            shared.stdout.print(render.answer_renderable(result.text, thinking))
            shared.stderr.print(render.result_summary(result), style="cyan")
        else:
            streamed = getattr(result, "_streamed_chars", 0)
            if thinking == "show":
                typer.echo(result.text[streamed:] if streamed <= len(result.text) else "")
            else:
                typer.echo(answer.strip())
            typer.echo(render.result_summary(result), err=True)
        if result.interrupted:
            typer.echo("interrupted: the output above is what was produced so far", err=True)
            raise typer.Exit(shared.EXIT_INTERRUPTED)
