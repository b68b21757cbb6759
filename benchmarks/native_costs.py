#!/usr/bin/env python3
"""What one native forward costs, on a synthetic model with the real vocabulary and hidden size.

    .venv/bin/python benchmarks/native_costs.py [--layers 1] [--quant q8_0] [--experts 128]
                                                [--reps 3] [--threads N] [--batch 1,2] [--sc-top-k 64]
                                                [--json]

Writes (once, cached under ~/.cache/dg/bench) a random diffusion-gemma GGUF with vocab 262144 and
hidden 2816 but only `--layers` layers, and its AR gemma4 twin (same weights), then times, as
medians of `--reps`:
  decoder forward   one 256-token canvas, first step (no self-conditioning)
  decoder + sc      the same, self-conditioned on the top-k (--sc-top-k, the engine's default 64)
                    of the previous step's softmax: k rows of E gathered per position. (The dense
                    form, softmax(logits) @ E over the whole vocabulary, ~190 G multiply-adds,
                    measured 103 s against 9.4 s without it: --layers 2 --experts 8 --reps 2
                    --threads 2 on the shared 2-core box; graph memory rules it out here now.)
  sampler + top-k   the native sampler pass over the [256, 262144] logits, top-k included
  encoder commit    256 tokens appended to the cache (logits of the last token only)
  graph step        what `dg generate` runs per step: the self-conditioned forward with softcap,
                    sampling and top-k in the graph (only per-position results leave it)
  one-token decode  one token through the encoder with its logits: an AR step on the same weights
  AR token decode   one token on the gemma4 twin (--no-ar: none, the ratios are to the line above)
and, with --batch, n canvases as n sequences in one decoder forward.

With few layers the vocabulary-sized matrices dominate (the LM head over 256 positions and the
self-conditioning product), so the ratios here are an upper bound of the real model's overhead
from those two; the per-layer cost scales with --layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgcli.errors import DgError  # noqa: E402


def cache_dir() -> Path:
    base = os.environ.get("DG_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "dg") / "bench"


def synthetic_model(layers: int, quant: str, experts: int, arch: str = "diffusion-gemma") -> Path:
    """The cached synthetic GGUF of `arch` (written once; the gemma4 twin holds the same weights)."""
    from dgcli.testing.tiny import write_synthetic_gguf

    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"synthetic-v262144-h2816-l{layers}-e{experts}-{quant}-{arch}.gguf"
    if not path.exists():
        tmp = path.with_suffix(".partial")
        write_synthetic_gguf(tmp, n_layer=layers, outtype=quant, arch=arch, num_experts=experts,
                             top_k_experts=min(8, experts))
        tmp.replace(path)
    return path


def synthetic_pair(layers: int, quant: str, experts: int) -> tuple[Path, Path]:
    return (synthetic_model(layers, quant, experts, "diffusion-gemma"),
            synthetic_model(layers, quant, experts, "gemma4"))


def median_time(fn, reps: int, setup=None) -> float:
    times = []
    for _ in range(reps):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--quant", default="q8_0", choices=["q8_0", "q4_k_m", "f16"])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", default="", help="comma-separated canvases per forward, e.g. 1,2,4")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens before the canvas")
    parser.add_argument("--sc-top-k", type=int, default=64, help="self-conditioning top-k width")
    parser.add_argument("--no-ar", action="store_true",
                        help="no gemma4 twin (at real size a second 16 GB file): ratios to the one-token decode")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from dgcli.engine.sampler import make_step_sampler
    from dgcli.runtime.model import ArModel, DiffusionModel

    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
        t0 = time.perf_counter()
        diff_path = synthetic_model(args.layers, args.quant, args.experts)
        ar_path = None if args.no_ar else synthetic_model(args.layers, args.quant, args.experts, "gemma4")
        write_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        n_seq = max([1, *batches])
        results: dict[str, float] = {}
        with DiffusionModel(diff_path, n_threads=args.threads, n_ctx=2048, n_seq_max=n_seq) as m:
            C, V = m.canvas_length, m.vocab_size
            prompt = [int(t) for t in rng.integers(200, 400, args.prompt)]
            canvas = [int(t) for t in rng.integers(0, V, C)]
            # previous logits: a spread-out softmax (std 4) is the worst case for nothing; the
            # forward's cost depends on k only. The sampler pass produces the top-k as it would.
            prev = rng.standard_normal((C, V), dtype=np.float32) * 4.0
            step_sampler = make_step_sampler("auto", n_threads=args.threads)
            stats = step_sampler.process_logits(prev.copy(), np.float32(0.8), rng.random(C), top_k=args.sc_top_k)
            sc_topk = (stats.topk_ids, stats.topk_probs)

            def fresh():
                m.reset()
                m.prefill(prompt)

            fresh()
            m.decode_canvas(canvas)  # warm-up: page in the weights, size the buffers
            results["decoder forward (256 canvas)"] = median_time(lambda: m.decode_canvas(canvas), args.reps)
            results[f"decoder forward + self-cond (top-{args.sc_top_k})"] = median_time(
                lambda: m.decode_canvas(canvas, sc_topk=sc_topk), args.reps)
            results[f"sampler pass + top-{args.sc_top_k} ({step_sampler.name})"] = median_time(
                lambda: step_sampler.process_logits(prev.copy(), np.float32(0.8), rng.random(C), top_k=args.sc_top_k),
                args.reps)
            results["encoder commit (256 tokens)"] = median_time(lambda: m.commit(canvas), args.reps, setup=fresh)
            fresh()
            # the graph step generate runs: the forward, then softcap, sampling and top-k in the graph
            uniforms = rng.random((1, C))
            results[f"graph step + self-cond (top-{args.sc_top_k})"] = median_time(
                lambda: m.denoise_step(np.array([canvas]), np.float32(0.8), uniforms,
                                       sc_topk=(sc_topk[0][None], sc_topk[1][None]), top_k=args.sc_top_k), args.reps)
            # one token through the encoder with its logits: an AR decode step on the same weights
            fresh()
            token = iter(rng.integers(200, 400, 10_000).tolist())
            m.prefill([next(token)], return_logits=True)
            results["one-token decode (same weights)"] = median_time(
                lambda: m.prefill([next(token)], return_logits=True), max(args.reps, 5))
            for n in batches:
                fresh()
                canvases = np.array([[int(t) for t in rng.integers(0, V, C)] for _ in range(n)])
                results[f"decoder batch of {n} canvases"] = median_time(lambda: m.decode_canvases(canvases), args.reps)
        if ar_path is not None:
            with ArModel(ar_path, n_threads=args.threads, n_ctx=2048) as ar:
                ar.prefill(prompt)
                token = iter(rng.integers(200, 400, 10_000).tolist())
                ar.decode_token(next(token))
                results["AR token decode"] = median_time(lambda: ar.decode_token(next(token)), max(args.reps, 5))
    except DgError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    base = "one-token decode (same weights)" if ar_path is None else "AR token decode"
    ar_s = results[base]
    meta = dict(layers=args.layers, quant=args.quant, experts=args.experts, vocab=262144, hidden=2816, canvas=256,
                prompt=args.prompt, threads=args.threads or os.cpu_count(), reps=args.reps, file_write_s=round(write_s, 1),
                ratio_base=base)
    if args.json:
        print(json.dumps({"config": meta, "seconds": results,
                          "ratio_to_ar_decode": {k: v / ar_s for k, v in results.items()}}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"native costs: {args.layers} layer(s), {args.quant}, {args.experts} experts, "
                        f"vocab 262144, hidden 2816 (median of {args.reps})")
    table.add_column("forward")
    table.add_column("seconds", justify="right")
    table.add_column("x AR token" if ar_path is not None else "x one-token decode", justify="right")
    for name, secs in results.items():
        table.add_row(name, f"{secs:.3f}", f"{secs / ar_s:.1f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
