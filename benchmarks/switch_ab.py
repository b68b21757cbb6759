#!/usr/bin/env python3
"""One process, its denoising steps alternating an environment switch the native code reads per call.

    .venv/bin/python benchmarks/switch_ab.py --gguf PATH --var DG_EXPERT_PREFETCH --values 0,1
                                             [--rounds 6] [--threads 1]

On a shared host, two processes of step_ab.py can land on different neighbours' loads (the second of
a pair ran slower in every group on one Sapphire Rapids evening); steps of one process alternating
A, B, B, A, ... meet the same host. Only for switches read on every call, such as DG_EXPERT_PREFETCH
(the experts' GEMM reads it per call) or a temporary one added to try a kernel: a switch read once,
when a context or a GEMM is made, needs step_ab.py. The model is loaded once, a 64-token prompt
prefilled, a first step run (no self-conditioning, also the warm-up); then each round times one
self-conditioned step (top-64) per value, node by node (llama.cpp's eval callback). Reports the
profiled step's CPU seconds and each matmul group's, min / median over the rounds, with the group's
G MAC/s at its min.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import group_of, multiply_adds  # noqa: E402

from dgcli.runtime.model import DiffusionModel  # noqa: E402
from dgcli.runtime.profile import NodeProfiler  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--var", required=True, help="the environment variable to alternate")
    parser.add_argument("--values", default="0,1", help="its two values, A,B")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--groups", type=int, default=8, help="how many matmul groups to list (slowest first)")
    args = parser.parse_args()
    values = args.values.split(",")
    if len(values) != 2 or args.rounds < 1:
        parser.error("--values takes two comma-separated values and --rounds at least 1")
    if not args.gguf.is_file():
        parser.error(f"no file at {args.gguf}")
    a, b = values

    rng = np.random.default_rng(0)
    profiler = NodeProfiler()
    steps: dict[str, list[float]] = {a: [], b: []}
    groups: dict[str, dict[str, list[tuple[float, int]]]] = {a: {}, b: {}}
    with DiffusionModel(str(args.gguf), n_threads=args.threads, n_ctx=1024,
                        eval_callback=profiler.eval_callback) as m:
        m.prefill([int(t) for t in rng.integers(200, 400, 64)])
        canvas = rng.integers(0, m.vocab_size, (1, m.canvas_length))
        [first] = m.denoise_step(canvas, np.float32(0.6), rng.random((1, m.canvas_length)), top_k=64)
        sc = (first.topk_ids[None], first.topk_probs[None])
        for r in range(args.rounds):
            for value in (b, a) if r % 2 else (a, b):
                os.environ[args.var] = value
                profiler.enabled = True
                cpu = time.process_time()
                m.denoise_step(canvas, np.float32(0.6), rng.random((1, m.canvas_length)), sc_topk=sc, top_k=64)
                steps[value].append(time.process_time() - cpu)
                profiler.enabled = False
                step_groups: dict[str, list[float]] = {}
                for node in profiler.take():
                    macs = multiply_adds(node, m.n_embd)
                    if macs:
                        name = f"{group_of(node, m.vocab_size, m.n_embd)} [{node.src0_type}]"
                        entry = step_groups.setdefault(name, [0.0, 0])
                        entry[0] += node.cpu_seconds
                        entry[1] += macs
                for name, (seconds, macs) in step_groups.items():
                    groups[value].setdefault(name, []).append((seconds, macs))

    def cell(value: str, runs: list[tuple[float, int]]) -> str:
        times = [s for s, _ in runs]
        return f"{value}: {min(times):.3f} / {statistics.median(times):.3f} ({runs[0][1] / min(times) / 1e9:.0f})"

    print(f"{args.var} = {a} / {b}, {args.rounds} rounds alternating, {args.threads} thread(s): "
          "CPU s min / median (G MAC/s at the min)")
    print(f"  {'profiled step':52s}  {a}: {min(steps[a]):.3f} / {statistics.median(steps[a]):.3f}"
          f"  {b}: {min(steps[b]):.3f} / {statistics.median(steps[b]):.3f}")
    slowest = sorted(groups[b], key=lambda name: -min(s for s, _ in groups[b][name]))
    for name in slowest[:args.groups]:
        if name in groups[a]:
            print(f"  {name[:52]:52s}  {cell(a, groups[a][name])}  {cell(b, groups[b][name])}")


if __name__ == "__main__":
    main()
