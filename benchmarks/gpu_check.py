"""The GPU check: parity with every layer offloaded, then the speed numbers on a real-size model.

One command on a machine with an NVIDIA GPU and the CUDA build of our llama.cpp (see
native/README.md, "The GPU check", for how the wheel and dg's dependencies travel there):

    python3 benchmarks/gpu_check.py --out DIR [--budget 420] [--n-layer 30] [--skip-tests]

Steps, each timed; a failed step is a row in the table and the rest still run:
1. gpu       llama.cpp sees a GPU (without one the check stops here, exit 2)
2. write     the real-size synthetic GGUFs, written here (dgcli.testing.tiny.write_synthetic_gguf: 30 layers,
             hidden 2816, vocab 262144, 128 experts top-8, Q4_K_M-like types, ~16 GB) and their
             gemma4 AR twin, in background processes while step 3 runs
3. parity    pytest tests/test_gpu_parity.py (GPU vs CPU exact mode vs the Transformers reference)
             and tests/test_replay_gguf.py with DG_TEST_GPU_LAYERS=-1 (every layer offloaded)
4. diffusion every layer offloaded: decoder step (256-token canvas forward, with the sampler's top-64
             self-conditioning), one-token decode on the same weights, their ratio (the report: 3.2x on
             an H100 in FP8), then one canvas on the default sampler: steps, tok/s and the share of the
             step spent outside the GPU, per step backend ("native": logits to the host sampler;
             "graph": the one-graph step, when this build has it)
5. profile   every node of the canvas forward and of the one-graph step timed on the device, grouped
             (the costliest --profile groups), and the scheduler's splits (DIR/splits.txt)
6. offload   --n-cpu-moe N and --cpu-moe: where llama.cpp put the weights, and the step time
7. ar        the AR twin (stock gemma4 graph), every layer offloaded: decode ms per token, tok/s
8. cli       with --cli: `dg bench` and `dg compare` on the pair as a user runs them

Prints one table and writes DIR/gpu-check.md, DIR/gpu-check.json, DIR/pytest.log and DIR/splits.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # step_profile's node groups

REPORTED_RATIO = 3.2  # DiffusionGemma report: a canvas forward costs 3.2x a one-token decode (H100, FP8)
CANVAS = 256
PROMPT_TOKENS = 64


@dataclass
class Row:
    section: str
    quantity: str
    value: str
    note: str = ""


@dataclass
class Check:
    out: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    rows: list[Row] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def add(self, section: str, quantity: str, value: Any, note: str = "") -> None:
        self.rows.append(Row(section, quantity, str(value), note))
        print(f"  {section:10s} {quantity:44s} {value}  {note}", flush=True)

    def step(self, name: str, fn: Callable[[], None], need_s: float = 0.0) -> bool:
        if self.left() < need_s:
            self.add(name, "skipped", "-", f"out of time budget ({self.left():.0f} s left, needs ~{need_s:.0f} s)")
            return False
        t0 = time.monotonic()
        print(f"[{time.monotonic() - self.started:6.1f} s] {name} ...", flush=True)
        try:
            fn()
            return True
        except Exception as err:  # noqa: BLE001 - a failed step is reported, the others still run
            self.failed.append(name)
            self.add(name, "FAILED", type(err).__name__, " ".join(str(err).split())[:160])
            traceback.print_exc()
            return False
        finally:
            self.data.setdefault("step_seconds", {})[name] = round(time.monotonic() - t0, 1)
            self.save()  # device time is scarce: what is measured so far survives a kill mid-check

    def save(self) -> None:
        """The table so far, as $OUT/gpu-check.md and .json."""
        lines = ["| step | quantity | value | note |", "|---|---|---|---|"]
        lines += [f"| {r.section} | {r.quantity} | {r.value} | {r.note} |" for r in self.rows]
        (self.out / "gpu-check.md").write_text("\n".join(lines) + "\n")
        doc = dict(rows=[r.__dict__ for r in self.rows], failed=self.failed, seconds=time.monotonic() - self.started,
                   **self.data)
        (self.out / "gpu-check.json").write_text(json.dumps(doc, indent=1, default=str))


class Stopped(BaseException):
    """SIGTERM or SIGHUP (a device tool's time limit): unwind, so that the writers are killed, their
    files removed and the table written."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_stopped(signum: int, _frame) -> None:
    raise Stopped(signum)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def timed(fn: Callable[[], Any], reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- steps -------------------------------------------------------------------------------------------


def check_gpu(check: Check) -> None:
    from dgcli.runtime import native

    native.lib()
    gpus = native.gpu_devices()
    if not gpus:
        log = " | ".join(t for t in native.log_tail() if "cuda" in t.lower())[:300]
        raise SystemExit(f"no GPU visible to llama.cpp (CPU-only build, or no device/driver): {log or 'no CUDA log'}")
    for gpu in gpus:
        check.add("gpu", gpu.name, gpu.description, f"{gpu.total / 2**30:.1f} GiB, {gpu.free / 2**30:.1f} GiB free")
    check.data["gpus"] = [dict(name=g.name, description=g.description, total=g.total, free=g.free) for g in gpus]


# --cpu-dry-run: the same code path on a model small enough for a CPU (no GPU needed)
SMALL_MODEL = dict(vocab_size=4096, hidden=256, num_experts=8, top_k_experts=2, moe_intermediate_size=256,
                   intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   global_head_dim=128, num_global_key_value_heads=1)


def start_writers(workdir: Path, n_layer: int, overrides: dict) -> dict[str, tuple[Path, subprocess.Popen]]:
    """Both real-size GGUFs, written by two processes at once (they are CPU-bound on the random draws)."""
    out = {}
    for arch, name in (("diffusion-gemma", "diffusion"), ("gemma4", "ar")):
        path = workdir / f"synthetic-{name}-{n_layer}L-q4_k_m.gguf"
        code = ("import sys; from dgcli.testing.tiny import write_synthetic_gguf; "
                f"write_synthetic_gguf({str(path)!r}, n_layer={n_layer}, outtype='q4_k_m', arch={arch!r}, **{overrides!r})")
        out[name] = (path, subprocess.Popen([sys.executable, "-c", code], cwd=ROOT))
    return out


def wait_writer(check: Check, name: str, writer: tuple[Path, subprocess.Popen], t0: float) -> Path:
    path, proc = writer
    code = proc.wait(timeout=max(check.left(), 1))
    if code != 0:
        raise RuntimeError(f"writing {path.name} exited {code}")
    size = path.stat().st_size
    check.add("write", f"{name} GGUF", f"{size / 2**30:.1f} GiB", f"written in {time.monotonic() - t0:.0f} s (two at once)")
    return path


def run_parity(check: Check) -> None:
    env = dict(os.environ, DG_TEST_GPU_LAYERS="-1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    log = check.out / "pytest.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-s",
           "tests/test_gpu_parity.py", "tests/test_replay_gguf.py"]
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=max(check.left() - 60, 60)).returncode
    text = log.read_text()
    summary = next((line for line in reversed(text.splitlines()) if " passed" in line or " failed" in line
                    or " skipped" in line or " error" in line), "no summary line")
    for line in text.splitlines():
        if "max |diff|" in line:
            name, _, numbers = line.strip().partition(": ")
            check.add("parity", name, numbers)
    check.add("parity", "pytest (GPU parity + replay, every layer offloaded)", summary.strip("= "),
              "tolerance: (1.5 max, 5e-2 mean) |logit diff|, TF32 matmuls (tests/test_gpu_parity.py)")
    if code != 0:
        raise RuntimeError(f"parity tests failed (exit {code}); see pytest.log")


def step_backends(requested: str) -> list[str]:
    from dgcli.engine import diffusion

    available = getattr(diffusion, "STEP_BACKENDS", ("auto", "native", "numpy"))
    wanted = ["native", "graph"] if requested == "auto" else requested.split(",")
    return [b for b in wanted if b in available]


def measure_diffusion(check: Check, path: Path, backends: list[str], reps: int) -> None:
    from dgcli.runtime.model import DiffusionModel

    t0 = time.monotonic()
    model = DiffusionModel(path, n_gpu_layers=-1)
    check.add("diffusion", "load (every layer offloaded)", f"{time.monotonic() - t0:.1f} s",
              placement_note(model.load_report))
    try:
        rng = np.random.default_rng(0)
        prompt = [2, 105] + [int(t) for t in rng.integers(200, 400, PROMPT_TOKENS - 3)] + [106]
        canvas = [int(t) for t in rng.integers(200, 400, CANVAS)]
        ids = np.stack([rng.choice(model.vocab_size, 64, replace=False) for _ in range(CANVAS)]).astype(np.int32)
        probs = np.full((CANVAS, 64), 1 / 64, dtype=np.float32)
        model.prefill(prompt)
        step = timed(lambda: model.decode_canvas(canvas, sc_topk=(ids, probs)), reps, warmup=2)
        first = timed(lambda: model.decode_canvas(canvas), reps, warmup=1)
        decode = []
        for _ in range(reps + 2):
            t = time.perf_counter()
            model.prefill([int(rng.integers(200, 400))], return_logits=True)
            decode.append(time.perf_counter() - t)
        decode = decode[2:]
        step_ms, first_ms, decode_ms = (statistics.median(v) for v in (step, first, decode))
        check.add("diffusion", "decoder step, 256-token canvas + top-64 SC (median)", ms(step_ms),
                  f"min {ms(min(step))}, {reps} reps; includes the [256, {model.vocab_size}] logits to the host")
        if hasattr(model, "denoise_step"):
            graph = timed(lambda: model.denoise_step(np.asarray([canvas]), np.float32(0.6), rng.random((1, CANVAS)),
                                                     sc_topk=(ids[None], probs[None]), top_k=64), reps, warmup=2)
            check.add("diffusion", "one-graph step, same canvas + top-64 SC (median)", ms(statistics.median(graph)),
                      f"min {ms(min(graph))}; the sampler's pass in the graph, only per-position results to the host")
            check.data["diffusion_graph_step_s"] = graph
            soft = rng.standard_normal((1, CANVAS, model.n_embd)).astype(np.float32)
            dense = timed(lambda: model.denoise_step(np.asarray([canvas]), np.float32(0.6), rng.random((1, CANVAS)),
                                                     sc_soft=soft, next_soft=True), reps, warmup=2)
            check.add("diffusion", "one-graph step, same canvas + dense SC (median)", ms(statistics.median(dense)),
                      f"min {ms(min(dense))}; the reference's form: the soft embedding in, this step's "
                      f"[{model.vocab_size} x {model.n_embd}] x [{model.vocab_size} x {CANVAS}] product out")
            check.data["diffusion_graph_step_dense_s"] = dense
            check.add("diffusion", "one-graph step / one-token decode",
                      f"{statistics.median(graph) / statistics.median(decode):.2f}x",
                      "a denoising step as dg runs it on a GPU, against an AR-style decode")
        check.add("diffusion", "canvas forward, first step (no SC)", ms(first_ms), f"min {ms(min(first))}")
        check.add("diffusion", "one-token decode, same weights", ms(decode_ms), f"min {ms(min(decode))}")
        check.add("diffusion", "canvas forward / one-token decode", f"{first_ms / decode_ms:.2f}x",
                  f"report: {REPORTED_RATIO}x (H100, FP8)")
        check.data["diffusion"] = dict(step_s=step, first_s=first, decode_s=decode)
        for backend in backends:
            generate_once(check, model, backend)
    finally:
        model.close()


def generate_once(check: Check, model, backend: str) -> None:
    from dgcli.engine.diffusion import DiffusionEngine

    engine = DiffusionEngine(model, sampler=backend)
    events: list = []
    model.reset()
    result = engine.generate("Explain KV caching in two sentences.", max_new_tokens=CANVAS, seed=0,
                             on_event=events.append)
    steps = [e for e in events if getattr(e, "kind", "") == "step"]
    forward = sum(e.forward_s for e in steps)
    host = sum(e.sampling_s for e in steps)
    check.add(f"sampler:{backend}", "steps per canvas (default sampler)", result.steps_per_canvas,
              f"stop: {result.stop_reason}; a random model is never sure, the cap is {steps[0].max_steps if steps else '?'}")
    # tokens_per_second leaves the prefill out (docs/json.md): the note says over which seconds
    check.add(f"sampler:{backend}", "tok/s (one canvas: steps + commit, after the prefill)",
              f"{result.tokens_per_second:.1f}", f"{result.n_new_tokens} tokens in {result.generation_s:.2f} s "
                                                 f"after a {result.prefill_s:.3f} s prefill")
    check.add(f"sampler:{backend}", "step: forward / host work (median)",
              f"{ms(statistics.median(e.forward_s for e in steps))} / {ms(statistics.median(e.sampling_s for e in steps))}")
    check.add(f"sampler:{backend}", "share of the step outside the GPU", f"{host / (forward + host):.1%}",
              "host sampler + bookkeeping; the logits copy is inside the forward" if backend != "graph"
              else "only per-position results leave the graph")
    check.data[f"sampler_{backend}"] = dict(steps=result.steps_per_canvas, tok_s=result.tokens_per_second,
                                            forward_s=forward, host_s=host)


SPLIT_INPUT = re.compile(r"\[(\S+) \(\s*(\d+)([MK])\)\]")


@contextlib.contextmanager
def sched_debug():
    """Models made inside list their scheduler's splits in llama.cpp's log (GGML_SCHED_DEBUG=1, read
    when a context's scheduler is made)."""
    saved = os.environ.get("GGML_SCHED_DEBUG")
    os.environ["GGML_SCHED_DEBUG"] = "1"
    try:
        yield
    finally:
        os.environ.pop("GGML_SCHED_DEBUG") if saved is None else os.environ.__setitem__("GGML_SCHED_DEBUG", saved)


def first_run_splits(fn: Callable[[], Any]) -> list[str]:
    """fn()'s graph as the scheduler split it ("## SPLIT #i: BACKEND # n inputs: [name (size)] ..."),
    from its first run (later runs reuse the graph and log nothing)."""
    from dgcli.runtime import native

    with native.collect_log() as log:
        fn()
    lines = [line for line in log if line.startswith("## SPLIT")]
    starts = [i for i, line in enumerate(lines) if line.startswith("## SPLIT #0:")]
    return lines[starts[-1]:] if starts else lines


def split_summary(lines: list[str]) -> str:
    """'N splits (CPU k), X MiB copied in': what crosses between the backends each run."""
    backends = [line.split(": ", 1)[1].split(" #", 1)[0] if ": " in line else "?" for line in lines]
    mib = sum(int(n) / (1 if unit == "M" else 1024) for line in lines for _, n, unit in SPLIT_INPUT.findall(line))
    on_cpu = sum(1 for b in backends if b.startswith("CPU"))
    return f"{len(lines)} splits ({on_cpu} on the CPU), {mib:,.0f} MiB of split inputs"


def profile_forward(check: Check, path: Path, top: int) -> None:
    """Every node of the canvas forward and of the one-graph step timed on the device (llama.cpp's
    eval callback: the scheduler syncs after each node, so the totals run a little above the
    uninterrupted step), grouped as benchmarks/step_profile.py groups them; and the scheduler's
    splits (GGML_SCHED_DEBUG=1), which name any part of the graph that runs off the GPU."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.profile import NodeProfiler
    from step_profile import group_of

    profiler = NodeProfiler()
    with sched_debug(), native.collect_log() as load_log:
        model = DiffusionModel(path, n_gpu_layers=-1, eval_callback=profiler.eval_callback)
    reserved = [line for line in load_log if "splits =" in line]
    try:
        rng = np.random.default_rng(3)
        model.prefill([2, 105] + [int(t) for t in rng.integers(200, 400, PROMPT_TOKENS - 2)])
        canvas = np.asarray([rng.integers(200, 400, CANVAS)], dtype=np.int32)
        ids = np.stack([rng.choice(model.vocab_size, 64, replace=False) for _ in range(CANVAS)]).astype(np.int32)
        probs = np.full((CANVAS, 64), 1 / 64, dtype=np.float32)
        graphs = {
            "canvas forward (logits out)": lambda: model.decode_canvas(canvas[0]),
            "one-graph step + top-64 SC": lambda: model.denoise_step(
                canvas, np.float32(0.6), rng.random((1, CANVAS)), sc_topk=(ids[None], probs[None]), top_k=64),
            "one-graph step + dense SC": lambda: model.denoise_step(
                canvas, np.float32(0.6), rng.random((1, CANVAS)), next_soft=True,
                sc_soft=np.zeros((1, CANVAS, model.n_embd), np.float32)),
        }
        splits: list[str] = [f"# at load: {line}" for line in reserved]
        if reserved:
            check.add("profile", "scheduler at load", reserved[-1].split(": ", 1)[-1][:120])
        for label, fn in graphs.items():
            split_lines = first_run_splits(fn)  # also the warm-up: kernels loaded, graph reserved
            splits += [f"# {label}", *split_lines[:200]]
            best: dict[str, list] = {}
            totals = []
            for _ in range(3):
                profiler.enabled = True
                fn()
                profiler.enabled = False
                groups: dict[str, list] = {}
                for node in profiler.take():
                    g = groups.setdefault(group_of(node, model.vocab_size, model.n_embd), [0.0, 0, 0])
                    g[0] += node.seconds
                    g[1] += node.multiply_adds()
                    g[2] += 1
                totals.append(sum(g[0] for g in groups.values()))
                for name, g in groups.items():
                    if name not in best or g[0] < best[name][0]:
                        best[name] = g
            check.add("profile", f"{label}: nodes timed one by one (min of 3)", ms(min(totals)),
                      f"{split_summary(split_lines)}; per-node sync adds to the total")
            for name, (secs, macs, count) in sorted(best.items(), key=lambda kv: -kv[1][0])[:top]:
                rate = f", {2 * macs / secs / 1e12:.1f} TFLOP/s" if macs and secs else ""
                check.add("profile", f"  {name}", ms(secs), f"{secs / min(totals):.1%}, {count} nodes{rate}")
            check.data.setdefault("profile", {})[label] = {k: dict(s=v[0], macs=v[1], nodes=v[2]) for k, v in best.items()}
        with open(check.out / "splits.txt", "a") as f:
            f.write("\n".join(splits) + "\n")
    finally:
        model.close()
        profiler.close()


def run_cli(check: Check, paths: dict[str, Path], timeout_s: float) -> None:
    """`dg bench` and `dg compare` on the written pair, every layer offloaded, as a user runs them:
    their tables in DIR/bench.txt and DIR/compare.txt, bench's JSON in DIR/bench.json."""
    env = dict(os.environ, COLUMNS="110", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    models = ["-m", str(paths["diffusion"]), "--ar-model", str(paths["ar"]), "-ngl", "-1"]
    bench_json = check.out / "bench.json"
    bench_json.unlink(missing_ok=True)
    runs = {"bench": ["bench", *models, "-r", "1", "-o", str(bench_json)],
            "compare": ["compare", *models, "Explain KV caching in two sentences."]}
    for name, args in runs.items():
        with open(check.out / f"{name}.txt", "w") as f:
            code = subprocess.run([sys.executable, "-m", "dgcli.cli", *args], cwd=ROOT, env=env, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=max(timeout_s, 30)).returncode
        check.add("cli", f"dg {name} (exit status)", code, f"{name}.txt")
    doc = json.loads(bench_json.read_text())
    sm = doc["speed_model"]
    check.add("cli", "dg bench: canvas step / one-token decode", f"{sm['canvas_forward_s'] * 1e3:.2f} / "
              f"{sm['decode_s'] * 1e3:.2f} ms = {sm['ratio']:.2f}x", sm.get("canvas_step", ""))
    for point in sm["batch_sweep"]:
        check.add("cli", f"dg bench: batch {point['batch']} canvas step / decode",
                  "-" if point["ratio"] is None else f"{point['canvas_s'] * 1e3:.2f} / {point['decode_s'] * 1e3:.2f} ms",
                  point["error"] or "")
    for summary in doc["summaries"]:
        tps = summary["tokens_per_second"]
        check.add("cli", f"dg bench: {summary['mode']} {summary['prompt']} tok/s",
                  "-" if tps is None else f"{tps['median']:.1f}")


def placement_note(report) -> str:
    devices = ", ".join(f"{d} {mib / 1024:.1f} GiB" for d, mib in report.mib_by_device().items())
    layers = f"{report.offloaded_layers}/{report.total_layers} layers" if report.offloaded_layers is not None else "no offload"
    return f"{layers}; {devices}"


def partial_settings(spec: str, n_layer: int) -> list[int]:
    """The --n-cpu-moe values to time; one past the model's layers (the small --cpu-dry-run model has
    two) becomes half of them."""
    values = [int(v) for v in spec.split(",") if v.strip()]
    return [n if n < 0 or n <= n_layer else max(1, n_layer // 2) for n in values]


def measure_partial(check: Check, path: Path, n_cpu_moe: int, reps: int) -> None:
    from dgcli.runtime.model import DiffusionModel

    t0 = time.monotonic()
    with sched_debug():
        model = DiffusionModel(path, n_gpu_layers=-1, n_cpu_moe=n_cpu_moe)
    label = "--cpu-moe" if n_cpu_moe < 0 else f"--n-cpu-moe {n_cpu_moe}"
    try:
        report = model.load_report
        moved = sorted({buft for _, buft in report.overridden})
        check.add("offload", f"{label}: load", f"{time.monotonic() - t0:.1f} s",
                  f"{placement_note(report)}; {len(report.overridden)} tensors kept in {', '.join(moved)}")
        rng = np.random.default_rng(1)
        model.prefill([2, 105] + [int(t) for t in rng.integers(200, 400, PROMPT_TOKENS - 2)])
        canvas = [int(t) for t in rng.integers(200, 400, CANVAS)]
        split_lines = first_run_splits(lambda: model.decode_canvas(canvas))  # the warm-up
        with open(check.out / "splits.txt", "a") as f:
            f.write("\n".join([f"# {label}: canvas forward", *split_lines[:200]]) + "\n")
        check.add("offload", f"{label}: canvas forward's graph", split_summary(split_lines),
                  "split inputs: what is copied to a backend each run (op offload streams CPU experts to the GPU)")
        step = timed(lambda: model.decode_canvas(canvas), reps, warmup=0)
        decode = timed(lambda: model.prefill([int(rng.integers(200, 400))], return_logits=True), reps, warmup=1)
        check.add("offload", f"{label}: canvas forward / one-token decode",
                  f"{ms(statistics.median(step))} / {ms(statistics.median(decode))}", f"{reps} reps, medians")
        check.data[f"offload_{n_cpu_moe}"] = dict(step_s=step, decode_s=decode, buffers=report.buffers)
    finally:
        model.close()


def measure_ar(check: Check, path: Path, reps: int) -> None:
    from dgcli.runtime.model import ArModel

    t0 = time.monotonic()
    with ArModel(path, n_gpu_layers=-1) as ar:
        check.add("ar", "load (every layer offloaded)", f"{time.monotonic() - t0:.1f} s", placement_note(ar.load_report))
        rng = np.random.default_rng(2)
        ar.prefill([2, 105] + [int(t) for t in rng.integers(200, 400, PROMPT_TOKENS - 2)])
        host = []

        def one() -> None:
            logits = ar.decode_token(int(rng.integers(200, 400)))
            t = time.perf_counter()
            int(np.argmax(logits))  # the AR engine's greedy pick, on the host
            host.append(time.perf_counter() - t)

        decode = timed(one, reps * 4, warmup=2)
        med = statistics.median(decode)
        check.add("ar", "decode step (median)", ms(med), f"min {ms(min(decode))}, {len(decode)} tokens")
        check.add("ar", "tok/s (decode only)", f"{1 / med:.1f}")
        check.add("ar", "share of the step outside the GPU", f"{statistics.median(host) / med:.1%}",
                  "greedy argmax over the 262144 logits on the host")
        check.data["ar"] = dict(decode_s=decode)
        diff = check.data.get("diffusion")
        if diff:
            check.add("ar", "diffusion canvas forward / AR decode step",
                      f"{statistics.median(diff['first_s']) / med:.2f}x", f"report: {REPORTED_RATIO}x")
        graph = check.data.get("diffusion_graph_step_s")
        if graph:
            check.add("ar", "diffusion one-graph step / AR decode step", f"{statistics.median(graph) / med:.2f}x",
                      "the step dg runs on a GPU (sampler in the graph, top-64 self-conditioning)")


# -- output ------------------------------------------------------------------------------------------


def write_outputs(check: Check) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dg GPU check")
    for col in ("step", "quantity", "value", "note"):
        table.add_column(col, overflow="fold")
    for r in check.rows:
        table.add_row(r.section, r.quantity, r.value, r.note)
    Console(width=160).print(table)
    check.save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--budget", type=float, default=420, help="seconds for the whole check (steps past it are skipped)")
    parser.add_argument("--n-layer", type=int, default=30, help="layers of the synthetic model (30: the real 26B-A4B)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the GGUFs are written (default: a temp dir)")
    parser.add_argument("--skip-tests", action="store_true", help="no parity tests (speed numbers only)")
    parser.add_argument("--step-backends", default="auto",
                        help="step backends to time: native (host sampler), graph (one-graph step); auto: both when present")
    parser.add_argument("--n-cpu-moe", default="15,-1", help="partial-offload settings to time (-1: --cpu-moe)")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--profile", type=int, default=12, metavar="N",
                        help="time every node of the forward on the device and list the N costliest groups (0: off)")
    parser.add_argument("--cli", action="store_true",
                        help="then `dg bench` and `dg compare` on the pair (DIR/bench.txt, bench.json, compare.txt)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU needed: every step on a small model, to test this script on a CPU machine")
    args = parser.parse_args(argv)
    if args.n_layer < 2:
        parser.error("--n-layer must be at least 2 (the layout needs a sliding and a full-attention layer)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "splits.txt").unlink(missing_ok=True)  # appended to by the steps
    check = Check(out=args.out, budget_s=args.budget)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_stopped)

    try:
        check_gpu(check)
    except SystemExit as stop:
        check.add("gpu", "no GPU", "-", str(stop))
        if not args.cpu_dry_run:
            check.failed.append("gpu")
            write_outputs(check)
            return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dg-gpu-check-", dir="/tmp"))
    t_write = time.monotonic()
    writers = start_writers(workdir, args.n_layer, SMALL_MODEL if args.cpu_dry_run else {})
    try:
        if not args.skip_tests:
            check.step("parity", lambda: run_parity(check), need_s=60)
        paths: dict[str, Path] = {}
        for name in ("diffusion", "ar"):
            check.step("write", lambda name=name: paths.__setitem__(name, wait_writer(check, name, writers[name], t_write)))
        if "diffusion" in paths:
            backends = step_backends(args.step_backends)
            missing = sorted(set(["native", "graph"] if args.step_backends == "auto" else args.step_backends.split(","))
                             - set(backends))
            if missing:
                check.add("diffusion", "step backends not in this build", ", ".join(missing),
                          "the one-graph step (issue 10) adds 'graph'")
            check.step("diffusion", lambda: measure_diffusion(check, paths["diffusion"], backends, args.reps), need_s=40)
            if args.profile:
                check.step("profile", lambda: profile_forward(check, paths["diffusion"], args.profile), need_s=30)
            for n in partial_settings(args.n_cpu_moe, args.n_layer):
                check.step("offload", lambda n=n: measure_partial(check, paths["diffusion"], n, max(2, args.reps // 2)),
                           need_s=40)
        if "ar" in paths:
            check.step("ar", lambda: measure_ar(check, paths["ar"], args.reps), need_s=20)
        if args.cli and {"diffusion", "ar"} <= paths.keys():
            check.step("cli", lambda: run_cli(check, paths, check.left()), need_s=60)
    except Stopped as stop:
        check.failed.append("stopped")
        check.add("stopped", f"by signal {signal.Signals(stop.signum).name}", "-", "the steps after it did not run")
        stopped_code = 128 + stop.signum
    else:
        stopped_code = None
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        for _, proc in writers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if args.workdir is None:
            for path in workdir.glob("*"):
                path.unlink()
            workdir.rmdir()
        check.add("total", "wall time", f"{time.monotonic() - check.started:.0f} s", f"budget {args.budget:.0f} s")
        write_outputs(check)
    return stopped_code or (1 if check.failed else 0)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Stopped as stopped:  # before the steps began: nothing to clean up
        sys.exit(128 + stopped.signum)
