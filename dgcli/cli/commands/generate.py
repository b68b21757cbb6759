"""`dg generate`: DiffusionGemma on one prompt, the canvas denoising live."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dgcli import outputs
from dgcli.cli import _display, _errors, _models, _options, _output, _prompt, _terminal, render
from dgcli.engine.thinking import split_thinking
from dgcli.errors import WORKER_LOST, DgError, InvalidParameter

GENERATE_SCHEMA = "dg-generate/1"


def generate(
    prompt: Optional[str] = _options.PromptArg,
    prompt_opt: Optional[str] = _options.PromptOpt,
    file: Optional[Path] = _options.FileOpt,
    system: Optional[str] = _options.SystemOpt,
    raw: bool = _options.RawOpt,
    model: Optional[str] = _options.ModelOpt,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="At most this many answer tokens (whole canvases are still denoised)."),
    seed: Optional[int] = _options.SeedOpt,
    temp: Optional[float] = _options.TempOpt,
    steps: Optional[int] = _options.StepsOpt, t_min: Optional[float] = _options.TMinOpt, t_max: Optional[float] = _options.TMaxOpt,
    entropy_bound: Optional[float] = _options.EBOpt, stability_threshold: Optional[int] = _options.StabOpt,
    confidence_threshold: Optional[float] = _options.ConfOpt,
    ctx_size: Optional[int] = _options.CtxOpt,
    threads: Optional[int] = _options.ThreadsOpt, gpu_layers: int = _options.GpuOpt,
    rpc: Optional[str] = _options.RpcOpt,
    n_cpu_moe: Optional[int] = _options.NCpuMoeOpt, cpu_moe: bool = _options.CpuMoeOpt, verbose: bool = _options.VerboseOpt,
    thinking: str = _options.ThinkingOpt,
    self_cond_top_k: Optional[int] = typer.Option(
        None, "--self-cond-top-k", show_default=False,
        help="Tokens per position fed back to self-conditioning (default 0: all of them, the reference's dense "
             "form; K: the K most probable, the mass left out in the trace as sc_dropped_mass)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end tokens, up to --max-new-tokens (as llama.cpp's --ignore-eos)."),
    pace: float = _options.PaceOpt,
    no_live: bool = _options.NoLiveOpt,
    json_out: bool = typer.Option(False, "--json", help=f"Print the result and the per-step trace as JSON ({GENERATE_SCHEMA})."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write the per-step trace to this file (JSON lines, dg-trace/1; `dg replay` shows it again; '-': stdout).", show_default=False),
    force: bool = _options.ForceOpt,
    parse_special: bool = _options.ParseSpecialOpt,
    yes: bool = _options.YesOpt,
) -> None:
    """Generate with DiffusionGemma, watching the canvas denoise live."""
    with _errors.user_errors():
        _options.check_thinking(thinking)
        if self_cond_top_k is not None and self_cond_top_k < 0:
            raise InvalidParameter("self_cond_top_k", self_cond_top_k, "an integer >= 0 (0 = all tokens)")
        _options.check_generation_args(max_new_tokens, threads, gpu_layers, ctx_size, pace)
        gpu_layers, n_cpu_moe = _options.resolve_offload(gpu_layers, n_cpu_moe, cpu_moe)
        rpc_servers, gpu_layers = _options.rpc_placement(rpc, gpu_layers)
        system = _prompt.check_prompt_options(system, raw)
        run_seed = _options.seed_of(seed)
        text = _prompt.read_prompt(prompt, prompt_opt, file)
        resolved, path = _models.resolve_model(model, yes=yes, want="diffusion")
        _models.preflight(path, diffusion=True, command="generate", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                         ctx_size=ctx_size)
        params = _options.diffusion_params(path, temp, **_options.sampler_flags(
            steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold))
        live = _terminal.use_live(no_live, json_out)
        header = dict(model=dict(name=resolved.display_name, path=str(path)), prompt=text, system=system, raw=raw,
                      params=params.__dict__, max_new_tokens=max_new_tokens, seed=run_seed, ignore_eos=ignore_eos)
        trace_file = _output.output_file(trace, force=force, inputs=[path, file], what="--trace")
        # a trace on stdout has it to itself: the answer goes to stderr, no live view draws over it
        trace_on_stdout = trace_file is not None and trace_file.is_stdout
        if trace_on_stdout and json_out:
            raise DgError("--json and --trace to stdout would mix two documents there; write the trace to a "
                          "file (--json holds it too, as \"trace\")")
        live = live and not trace_on_stdout
        with outputs.writing(trace_file) as (trace_out,):
            engine = _models.open_diffusion_engine(path, threads=threads, gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                                                  **_options.rpc_option(rpc_servers),
                                                  ctx_size=ctx_size, verbose=verbose)
            placement = _models.placement_of(engine.model)
            try:
                ids = _prompt.prompt_ids(engine.model, text, system=system, raw=raw, parse_special=parse_special)
                _prompt.check_prompt_fits(engine, len(ids))
                events: Optional[list] = [] if json_out else None
                sinks = ([trace_out.write_line] if trace_out else []) + ([events.append] if events is not None else [])
                recorder = _display.trace_recorder(engine.model, sinks)
                if recorder is not None:
                    recorder.header(**header, canvas_length=engine.model.canvas_length,
                                    end_token_ids=[] if ignore_eos else list(engine.model.end_token_ids),
                                    pad_token_id=getattr(engine.model, "pad_token_id", None))
                result = _display.run_diffusion(engine, ids, params=params, max_new_tokens=max_new_tokens, seed=run_seed,
                                              live=live, thinking=thinking, recorder=recorder,
                                              title=f"diffusion: {resolved.display_name}",
                                              stream_plain=not live and not json_out, self_cond_top_k=self_cond_top_k,
                                              pace=pace, text_to_stderr=trace_on_stdout, ignore_eos=ignore_eos)
                if recorder is not None:
                    recorder.result(result.to_json())
            finally:
                engine.close()
        thought, answer = split_thinking(result.text)
        if json_out:
            doc = dict(schema=GENERATE_SCHEMA, **header, answer=answer.strip(),
                       thinking=thought.strip() if thought is not None else None,
                       result=result.to_json(), placement=placement, trace=events)
            typer.echo(json.dumps(doc, indent=2))
        elif live:
            _output.stdout.print(render.answer_renderable(result.text, thinking))
            _output.notice(render.result_summary(result), style="cyan")
        else:
            streamed = getattr(result, "_streamed_chars", 0)
            if thinking == "show":
                _output.echo_text(result.text[streamed:] if streamed <= len(result.text) else "", err=trace_on_stdout)
            else:
                _output.echo_text(answer.strip(), err=trace_on_stdout)
            _output.notice(render.result_summary(result))
        if result.stop_reason == "context_full" and not json_out:
            _output.notice("note: the context is full; the answer stops here")
        if result.stop_reason == WORKER_LOST:
            from dgcli.runtime import rpc

            rpc.check_workers()  # its one line and exit status, after the answer it cut short
        if result.interrupted:
            _output.notice("interrupted: the output above is what was produced so far")
            raise typer.Exit(_errors.EXIT_INTERRUPTED)
