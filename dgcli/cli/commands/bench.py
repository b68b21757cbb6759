"""`dg bench`: tok/s, steps per canvas, tokens per forward, and the canvas-vs-decode speed model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dgcli import outputs
from dgcli.cli import _errors, _models, _options, _output, _terminal
from dgcli.engine.rng import SEED_LIMIT
from dgcli.errors import DgError, InvalidParameter


def bench(
    model: Optional[str] = _options.ModelOpt,
    ar_model: Optional[str] = typer.Option(None, "--ar-model", help="The autoregressive side (default: the registry pair)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompt file: one prompt per line, `name<TAB>prompt`, or `name<TAB>prompt<TAB>answer` (accuracy). Default: the model's own set (demo), else math/Korean/code/trivial."),
    repeat: int = typer.Option(3, "--repeat", "-r", help="Runs per prompt and model (median and spread reported)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    seed: int = typer.Option(0, "--seed", help="Base seed; run i uses seed+i."),
    steps: Optional[int] = _options.StepsOpt, t_min: Optional[float] = _options.TMinOpt, t_max: Optional[float] = _options.TMaxOpt,
    entropy_bound: Optional[float] = _options.EBOpt, stability_threshold: Optional[int] = _options.StabOpt,
    confidence_threshold: Optional[float] = _options.ConfOpt,
    batch_sizes: str = typer.Option("1,2,4,8,16", "--batch-sizes", help="Batch sizes for the speed-model sweep."),
    no_speed_model: bool = typer.Option(False, "--no-speed-model", help="Skip the canvas-forward vs AR-decode measurement."),
    self_cond_top_k: Optional[int] = typer.Option(
        None, "--self-cond-top-k", show_default=False,
        help="Tokens per position fed back to self-conditioning, in the runs and the speed model (default 0: all "
             "of them, the reference's dense form; K: the K most probable). Each run records its form."),
    threads: Optional[int] = _options.ThreadsOpt, gpu_layers: int = _options.GpuOpt,
    rpc: Optional[str] = _options.RpcOpt,
    n_cpu_moe: Optional[int] = _options.NCpuMoeOpt, cpu_moe: bool = _options.CpuMoeOpt, verbose: bool = _options.VerboseOpt,
    json_out: bool = typer.Option(False, "--json", help="Print the whole report as JSON."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Also write the JSON report to this file ('-': stdout)."),
    force: bool = _options.ForceOpt,
    yes: bool = _options.YesOpt,
) -> None:
    """Benchmark both models: tok/s, steps per canvas, tokens per forward, and the canvas-vs-decode speed model."""
    from dgcli import bench as benchlib

    with _errors.user_errors():
        _options.check_generation_args(max_new_tokens, threads, gpu_layers)
        gpu_layers, n_cpu_moe = _options.resolve_offload(gpu_layers, n_cpu_moe, cpu_moe)
        rpc_servers, gpu_layers = _options.rpc_placement(rpc, gpu_layers)
        if repeat < 1:
            raise InvalidParameter("repeat", repeat, "an integer >= 1")
        if self_cond_top_k is not None and self_cond_top_k < 0:
            raise InvalidParameter("self_cond_top_k", self_cond_top_k, "an integer >= 0 (0 = all tokens)")
        seed = _options.seed_of(seed)
        if seed + repeat > SEED_LIMIT:  # run i uses seed + i
            raise DgError(f"invalid seed={seed}: with --repeat {repeat} the last run's seed would pass {SEED_LIMIT - 1}")
        sizes = benchlib.parse_batch_sizes(batch_sizes)
        diff_res, diff_path = _models.resolve_model(model, yes=yes, want="diffusion")
        own_prompts = diff_res.entry.bench_prompts if diff_res.entry is not None else None
        prompt_file = prompts or own_prompts
        prompt_set = benchlib.load_prompts(prompt_file) if prompt_file \
            else benchlib.BUILTIN_PROMPTS
        ar_res, ar_path = _models.resolve_pair(diff_res, ar_model, yes=yes)
        _models.preflight(diff_path, diffusion=True, command="bench", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe)
        _models.preflight(ar_path, diffusion=False, command="bench", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe)
        params = _options.diffusion_params(diff_path, **_options.sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold,
                                                              confidence_threshold))
        from dgcli.modelfile.info import quant_pair
        config = benchlib.BenchConfig(
            diffusion_model=diff_res.display_name, diffusion_path=str(diff_path),
            ar_model=ar_res.display_name, ar_path=str(ar_path), repeat=repeat, max_new_tokens=max_new_tokens,
            seed=seed, params=params, batch_sizes=sizes, speed_model=not no_speed_model,
            n_threads=threads, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe, rpc_servers=rpc_servers,
            quantization=quant_pair(diff_path, ar_path).to_json(),
            self_cond_top_k=self_cond_top_k,
        )
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        report_file = _output.output_file(output, force=force, inputs=[diff_path, ar_path, prompt_file], what="--output")
        with outputs.writing(report_file) as (out,):
            progress = _terminal.anchored(Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                                TimeElapsedColumn(), console=_output.stderr, transient=True,
                                                disable=not _output.stderr.is_interactive))
            with progress:
                task = progress.add_task("bench", total=benchlib.total_units(config, prompt_set))

                offload = dict(threads=threads, gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe, **_options.rpc_option(rpc_servers))

                def on_progress(desc: str) -> None:
                    progress.update(task, advance=1, description=desc)

                report = benchlib.run_bench(config, prompt_set, on_progress=on_progress,
                                            open_diffusion=lambda p: _models.open_diffusion_engine(Path(p), **offload, verbose=verbose),
                                            open_ar=lambda p: _models.open_ar_engine(Path(p), **offload, verbose=verbose),
                                            open_speed_model=lambda p, n: _models.open_speed_model(p, n, **offload))
            doc = report.to_json()
            if out is not None:
                out.write_all(doc)
        # `-o -` already put the report on stdout: --json must not print it twice, nor the tables follow
        # it there (`dg bench -o - > r.json` must be valid JSON); the tables go to stderr then
        report_on_stdout = report_file is not None and report_file.is_stdout
        if json_out:
            if not report_on_stdout:
                typer.echo(json.dumps(doc, indent=2))
        else:
            console = _output.stderr if report_on_stdout else _output.stdout
            for table in benchlib.report_tables(report):
                _output.print_table(table, console)
            for note in report.notes:  # text, not markup (it may quote an error); one line when piped
                console.print(f"note: {note}", style="yellow", markup=False, highlight=False,
                              soft_wrap=not console.is_terminal)
        if report.interrupted:
            if rpc_servers:
                from dgcli.runtime import rpc

                rpc.check_workers()  # a lost worker ended it: its one line and exit status, after the report
            raise typer.Exit(_errors.EXIT_INTERRUPTED)
