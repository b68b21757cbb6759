#!/usr/bin/env python3
"""Start-up on a GGUF with the real vocabulary: how long `dg` takes before llama.cpp loads anything.

    .venv/bin/python benchmarks/startup.py [--reps 5] [--baseline /path/to/other/checkout] [--json]

Writes (once, cached under ~/.cache/dg/bench) a synthetic diffusion-gemma GGUF with the real
262144-token vocabulary and two small layers (one sliding, one full), then measures, each as a fresh process:
  to model load   `dg generate "hi" -m FILE`: from the process's start to the moment dg calls
                  llama_model_load_from_file (the call is intercepted and the process ends there):
                  Python start-up, imports, resolving the model, the header check, the sampler
                  defaults
  dg info         `dg info FILE`: the whole command
each as wall time and as the process's CPU time (user + system; on a shared, loaded machine the
wall time is mostly waiting for a core).
With --baseline, the same runs of another checkout (e.g. main) are interleaved with these, so both
see the same machine load; min and median are reported for each. Goals (issue 8): model load
reached within 1 s of start, `dg info` within 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Runs `dg generate` until dg asks llama.cpp to load the model, then prints the wall clock and exits.
_UNTIL_LOAD = """
import os, runpy, sys, time
import dgcli
print(f"DGCLI {os.path.dirname(dgcli.__file__)}", flush=True)
try:
    from dgcli.runtime import native
except ImportError:  # a --baseline checkout from before dgcli/runtime/
    from dgcli.runtime import native
_lib = native.lib
def lib():
    mod = _lib()
    def load(*args, **kwargs):
        print(f"LOAD {time.time():.6f}", flush=True)
        os._exit(0)
    mod.llama_model_load_from_file = load
    return mod
native.lib = lib
sys.argv = ["dg", "generate", "hi", "-m", sys.argv[1], "--no-live", "-n", "8"]
runpy.run_module("dgcli.cli", run_name="__main__")
"""


def synthetic_model() -> Path:
    from dgcli.testing.tiny import write_synthetic_gguf

    cache = Path(os.environ.get("DG_CACHE_DIR") or Path.home() / ".cache" / "dg") / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "startup-vocab262144-l2-h256-q8_0.gguf"
    if not path.exists():
        tmp = path.with_suffix(".partial")
        write_synthetic_gguf(tmp, n_layer=2, vocab_size=262144, hidden=256, outtype="q8_0", num_experts=8,
                             top_k_experts=2)
        tmp.rename(path)
    return path


def _env(checkout: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(checkout), COLUMNS="100")


def _run(checkout: Path, args: list[str]) -> subprocess.CompletedProcess:
    # in the checkout: `python -c` and `-m` put the working directory first on the module path
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(checkout),
                          cwd=checkout, stdin=subprocess.DEVNULL, timeout=3600)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_to_load(checkout: Path, model: Path) -> tuple[float, float]:
    """(wall, CPU) seconds from the process's start to llama_model_load_from_file."""
    start, cpu = time.time(), _children_cpu()
    proc = _run(checkout, ["-c", _UNTIL_LOAD, str(model)])
    marks = [line for line in proc.stdout.splitlines() if line.startswith("LOAD ")]
    if not marks:
        raise SystemExit(f"{checkout}: dg never reached the model load:\n{proc.stderr[-2000:]}")
    if f"DGCLI {checkout / 'dgcli'}" not in proc.stdout:
        raise SystemExit(f"{checkout}: another dgcli was imported: {proc.stdout.splitlines()[0]}")
    return float(marks[0].split()[1]) - start, _children_cpu() - cpu


def time_info(checkout: Path, model: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of the whole `dg info`."""
    start, cpu = time.monotonic(), _children_cpu()
    proc = _run(checkout, ["-m", "dgcli.cli", "info", str(model)])
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: dg info failed:\n{proc.stderr[-2000:]}")
    return time.monotonic() - start, _children_cpu() - cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None, help="another dg checkout, run interleaved with this one")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = synthetic_model()
    checkouts = {"this": REPO} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    metrics = ("to_model_load_s", "to_model_load_cpu_s", "info_s", "info_cpu_s")
    samples: dict[str, dict[str, list[float]]] = {name: {m: [] for m in metrics} for name in checkouts}
    for _ in range(args.reps):
        for name, checkout in checkouts.items():  # interleaved: both see the same load
            for what, measure in (("to_model_load", time_to_load), ("info", time_info)):
                wall, cpu = measure(checkout, model)
                samples[name][f"{what}_s"].append(wall)
                samples[name][f"{what}_cpu_s"].append(cpu)
    report = {name: {metric: {"min": min(v), "median": statistics.median(v), "samples": v}
                     for metric, v in metrics.items()} for name, metrics in samples.items()}
    if args.json:
        print(json.dumps({"model": str(model), "reps": args.reps, "checkouts": {k: str(v) for k, v in checkouts.items()},
                          "results": report}, indent=2))
        return 0
    print(f"model: {model.name} ({model.stat().st_size / 1e6:.0f} MB, vocabulary 262144); {args.reps} runs each; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall time grows with it, CPU time less)")
    for name, measured in report.items():
        for metric, stats in measured.items():
            print(f"{name:<9} {metric:<20} min {stats['min']:7.2f} s   median {stats['median']:7.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
