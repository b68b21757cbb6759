#!/usr/bin/env python3
"""One denoising step under two environments, each in fresh processes, interleaved A/B.

    .venv/bin/python benchmarks/step_ab.py --b DG_MOE_GEMM=0,DG_DENSE_GEMM=ggml
                                           [--a ''] [--gguf PATH | --layers 2 --experts 8 --quant q4_k_m]
                                           [--threads 1] [--reps 3] [--steps 2]
    .venv/bin/python benchmarks/step_ab.py --a-tree OLD_CHECKOUT --a-site OLD_SITE ...   # before / after

For the switches a process reads once (DG_MOE_GEMM is read by ggml-cpu on the first MUL_MAT_ID), so
`step_profile.py`'s in-process variants cannot compare them. Each rep runs A, then B, in its own
process: the model loaded, a 64-token prompt prefilled, a first step (no self-conditioning, also the
warm-up), then --steps self-conditioned steps on the real vocabulary, timed. Reports per variant the
CPU seconds and wall seconds of one step (min / median over reps x steps) and B / A; then, from one
more step per process timed node by node (llama.cpp's eval callback), each matmul group's CPU seconds
by weight type, so that a kernel's change shows where the whole step's noise would hide it. With
--decodes N, each process then times N one-token decodes on the same weights (an AR step's shape, the
canvas/decode ratio's denominator): a kernel that takes only large batches must leave those alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the child: prints one JSON line, the (wall, CPU) seconds of each timed step
_CHILD = r"""
import json, sys, time
import numpy as np
from dgcli.runtime.model import DiffusionModel

path, threads, steps, decodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, "benchmarks")
from step_profile import group_of, multiply_adds
from dgcli.runtime.profile import NodeProfiler

def rss_gb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024 / 1e9

rng = np.random.default_rng(0)
profiler = NodeProfiler()
load = time.perf_counter()
with DiffusionModel(path, n_threads=threads, n_ctx=1024, eval_callback=profiler.eval_callback) as m:
    load, loaded_rss = time.perf_counter() - load, rss_gb()
    m.prefill([int(t) for t in rng.integers(200, 400, 64)])
    canvas = rng.integers(0, m.vocab_size, (1, m.canvas_length))
    [first] = m.denoise_step(canvas, np.float32(0.6), rng.random((1, m.canvas_length)), top_k=64)
    sc = (first.topk_ids[None], first.topk_probs[None])
    times = []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        m.denoise_step(canvas, np.float32(0.6), rng.random((1, m.canvas_length)), sc_topk=sc, top_k=64)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    # one more step timed node by node: CPU seconds and multiply-adds per matmul group
    profiler.enabled = True
    m.denoise_step(canvas, np.float32(0.6), rng.random((1, m.canvas_length)), sc_topk=sc, top_k=64)
    profiler.enabled = False
    groups = {}
    for node in profiler.take():
        macs = multiply_adds(node, m.n_embd)
        if macs:
            g = groups.setdefault(group_of(node, m.vocab_size, m.n_embd) + f" [{node.src0_type}]", [0.0, 0])
            g[0] += node.cpu_seconds
            g[1] += macs
    # one-token decodes after the prompt: one token through the encoder with its logits
    decode_times = []
    for token in rng.integers(200, 400, decodes):
        wall, cpu = time.perf_counter(), time.process_time()
        m.prefill([int(token)], return_logits=True)
        decode_times.append((time.perf_counter() - wall, time.process_time() - cpu))
    stepped_rss = rss_gb()
print(json.dumps({"steps": times, "groups": groups, "decodes": decode_times, "load_s": load, "rss_gb": loaded_rss,
                  "rss_after_steps_gb": stepped_rss}))
"""


def parse_env(text: str) -> dict[str, str]:
    """'K=V,K2=V2' -> {K: V, K2: V2} ('' -> {})."""
    env = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"step_ab: {item!r} is not NAME=VALUE")
        env[key] = value
    return env


def run_variant(path: Path, env: dict[str, str], threads: int, steps: int, decodes: int = 0,
                tree: Path | None = None, site: Path | None = None) -> dict:
    """{"steps": [(wall s, CPU s), ...], "groups": {matmul group [weight type]: [CPU s, multiply-adds]},
    "decodes": [(wall s, CPU s), ...]}; `tree`: another checkout whose dgcli and benchmarks the child runs,
    `site`: a folder put first on its PYTHONPATH (another build's llama_cpp package), for before/after runs."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("DG_")} | env
    if site is not None:
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), child_env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(threads), str(steps), str(decodes)], env=child_env,
                         cwd=tree or ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"step_ab: a variant's process failed ({out.returncode}): {last[0]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="", help="variant A's environment, NAME=VALUE,... (default: none)")
    parser.add_argument("--b", default="", help="variant B's environment, NAME=VALUE,...")
    parser.add_argument("--a-tree", type=Path, default=None,
                        help="variant A runs this checkout's dgcli (e.g. the commit before a change)")
    parser.add_argument("--a-site", type=Path, default=None,
                        help="a folder holding another build's llama_cpp package, first on variant A's PYTHONPATH")
    parser.add_argument("--gguf", type=Path, help="a diffusion-gemma GGUF (default: synthetic)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--quant", default="q4_k_m", choices=["q8_0", "q4_k_m", "f16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=0, help="one-token decodes timed per process after the steps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    variants = {"A": parse_env(args.a), "B": parse_env(args.b)}
    if variants["A"] == variants["B"] and args.a_tree is None and args.a_site is None:
        raise SystemExit("step_ab: A and B are the same run; give --b, --a, --a-tree or --a-site")
    if args.gguf:
        path = args.gguf
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from native_costs import synthetic_model

        path = synthetic_model(args.layers, args.quant, args.experts)
    times: dict[str, list] = {name: [] for name in variants}
    memory: dict[str, list] = {name: [] for name in variants}  # (load s, RSS after load, RSS after the steps)
    decodes: dict[str, list] = {name: [] for name in variants}
    groups: dict[str, dict] = {name: {} for name in variants}  # group -> [CPU s of each rep], multiply-adds
    for rep in range(args.reps):  # interleaved: the box's load hits both alike
        for name, env in variants.items():
            before = name == "A"
            run = run_variant(path, env, args.threads, args.steps, args.decodes,
                              tree=args.a_tree if before else None, site=args.a_site if before else None)
            times[name] += [tuple(t) for t in run["steps"]]
            memory[name].append((run.get("load_s"), run.get("rss_gb"), run.get("rss_after_steps_gb")))
            decodes[name] += [tuple(t) for t in run["decodes"]]
            for group, (cpu, macs) in run["groups"].items():
                groups[name].setdefault(group, {"cpu_s": [], "multiply_adds": macs})["cpu_s"].append(cpu)
            print(f"rep {rep + 1}/{args.reps} {name}: CPU s {[round(c, 2) for _, c in times[name][-args.steps:]]}",
                  file=sys.stderr)
    report = {"model": path.name, "threads": args.threads, "reps": args.reps, "steps": args.steps,
              "variants": {name: {"env": variants[name], "wall_s": [w for w, _ in t], "cpu_s": [c for _, c in t],
                                  "decode_wall_s": [w for w, _ in decodes[name]],
                                  "decode_cpu_s": [c for _, c in decodes[name]], "matmuls": groups[name],
                                  "load_s_rss_gb": memory[name]}
                           for name, t in times.items()}}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{path.name}: one self-conditioned step, {args.threads} thread(s), {args.reps} processes x "
          f"{args.steps} steps per variant, interleaved")
    rows = {}
    for name, v in report["variants"].items():
        cpu, wall = v["cpu_s"], v["wall_s"]
        rows[name] = (min(cpu), statistics.median(cpu), min(wall), statistics.median(wall))
        env = ",".join(f"{k}={x}" for k, x in v["env"].items()) or "(defaults)"
        if name == "A" and (args.a_tree or args.a_site):
            env = f"{env} [{args.a_tree or ''} {args.a_site or ''}]".strip()
        print(f"  {name} {env:40s} CPU s {rows[name][0]:7.2f} / {rows[name][1]:7.2f}   "
              f"wall s {rows[name][2]:7.2f} / {rows[name][3]:7.2f}   (min / median)")
    for name, v in report["variants"].items():
        loads = [m for m in v["load_s_rss_gb"] if m[0] is not None]
        if loads:
            print(f"  {name} load s {min(m[0] for m in loads):.1f}, resident set after the load "
                  f"{min(m[1] for m in loads):.2f} GB, after the steps {min(m[2] for m in loads):.2f} GB (min)")
    a, b = rows["A"], rows["B"]
    print(f"  B / A: CPU {b[0] / a[0]:.2f}x (min) {b[1] / a[1]:.2f}x (median), "
          f"wall {b[2] / a[2]:.2f}x (min) {b[3] / a[3]:.2f}x (median)")
    if args.decodes:
        print(f"one-token decode, {args.decodes} per process:")
        dec = {}
        for name, v in report["variants"].items():
            cpu, wall = v["decode_cpu_s"], v["decode_wall_s"]
            dec[name] = (min(cpu), statistics.median(cpu))
            print(f"  {name} CPU ms {1e3 * dec[name][0]:8.2f} / {1e3 * dec[name][1]:8.2f}   "
                  f"wall ms {1e3 * min(wall):8.2f} / {1e3 * statistics.median(wall):8.2f}   (min / median)")
        print(f"  B / A: CPU {dec['B'][0] / dec['A'][0]:.2f}x (min) {dec['B'][1] / dec['A'][1]:.2f}x (median)")
    print("matmuls of one profiled step per process, by group and weight type: CPU s min / median, G MAC/s at the min")
    names = sorted(set(groups["A"]) | set(groups["B"]),
                   key=lambda g: -max(min(groups[v][g]["cpu_s"]) if g in groups[v] else 0 for v in variants))
    for group in names:
        cells = []
        for name in variants:
            g = groups[name].get(group)
            if g is None:
                cells.append(f"{name}: {'-':>22s}")
                continue
            best = min(g["cpu_s"])
            cells.append(f"{name}: {best:6.3f} / {statistics.median(g['cpu_s']):6.3f} {g['multiply_adds'] / best / 1e9:5.1f}")
        print(f"  {group:60s} {'   '.join(cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
