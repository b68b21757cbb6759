"""dg's CUDA kernel changes (issue 24) measured in one device run: the pieces benchmarks/gpu_check.py
runs for them.

Every change is off unless its environment variable asks for it (ggml/src/ggml-cuda/dg-cuda.cuh in
native/patch lists them); the variables are read again at each graph compute and a CUDA graph
captured under other values is captured anew, so one process times each setting against the base:

    DG_CUDA_MOE_TILE     MMQ MUL_MAT_ID tile width from the tokens per expert ("mean", "mean:F", N)
    DG_CUDA_MOE_COMPACT  the MUL_MAT_ID grid compacted to the tiles with tokens
    DG_CUDA_MOE_MMF      F16/BF16 experts through mmf at any batch (no per-expert synchronizing loop)
    DG_CUDA_TOPK         "radix": TOP_K by radix select instead of a full segmented sort
    DG_CUDA_DENSE        "bf16" / "bf16:MxK,...": dense quantized products as BF16 cuBLAS GEMMs
    DG_CUDA_FUSED_STEP   the step's sampler pass over the logits in two kernels (dg-step.cu)

Pieces: the standalone kernel test (native/tests/dg_cuda_kernel_test.cu, built by gpu_bundle.py),
test-backend-ops built from the same tree (test mode: each changed kernel against the CPU; perf
mode: the model's own shapes), the one-graph step and one-token decode per variant (interleaved
rounds, min / median), and the results file benchmarks/results/gpu-<date>.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

SWITCHES = ("DG_CUDA_MOE_TILE", "DG_CUDA_MOE_COMPACT", "DG_CUDA_MOE_MMF", "DG_CUDA_TOPK", "DG_CUDA_DENSE",
            "DG_CUDA_FUSED_STEP")

# Built by benchmarks/gpu_bundle.py next to the wheels it carries (.whl/bin/).
KERNEL_TEST = "dg_cuda_kernel_test"
TEST_BACKEND_OPS = "test-backend-ops"

CANVAS = 256
SC_TOP_K = 64
TOPK_CASE = f"top_k:262144:{CANVAS}:{SC_TOP_K}"
# F16/BF16 experts are not in the files dg ships but are what DG_CUDA_MOE_MMF is for: the two MoE
# shapes of the real model at those types
HALF_EXPERT_TYPES = ("bf16", "f16")


@contextlib.contextmanager
def switched(env: dict[str, str]) -> Iterator[None]:
    """The kernel switches set to `env` (the others unset) for the duration; restored after."""
    saved = {k: os.environ.get(k) for k in SWITCHES}
    try:
        for k in SWITCHES:
            if k in env:
                os.environ[k] = env[k]
            else:
                os.environ.pop(k, None)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def variants(dense_shapes: list[str]) -> dict[str, dict[str, str]]:
    """The settings one run compares, in the order each round times them. `dense_shapes` ("MxK")
    are the dense products test-backend-ops found faster as BF16 GEMMs (dense_auto)."""
    out = {
        "base": {},
        "moe_tile_mean": {"DG_CUDA_MOE_TILE": "mean"},
        "moe_tile_32": {"DG_CUDA_MOE_TILE": "32"},
        "moe_compact_mean": {"DG_CUDA_MOE_TILE": "mean", "DG_CUDA_MOE_COMPACT": "1"},
        "moe_compact_32": {"DG_CUDA_MOE_TILE": "32", "DG_CUDA_MOE_COMPACT": "1"},
        "topk_radix": {"DG_CUDA_TOPK": "radix"},
        "dense_bf16": {"DG_CUDA_DENSE": "bf16"},
        "fused_step": {"DG_CUDA_FUSED_STEP": "1"},
    }
    dense_auto = {"DG_CUDA_DENSE": "bf16:" + ",".join(dense_shapes)} if dense_shapes else {}
    if dense_shapes:
        out["dense_auto"] = dense_auto
    out["all"] = {"DG_CUDA_MOE_TILE": "mean", "DG_CUDA_MOE_COMPACT": "1", "DG_CUDA_MOE_MMF": "1",
                  "DG_CUDA_TOPK": "radix", "DG_CUDA_FUSED_STEP": "1", **dense_auto}
    return out


# -- the model's shapes ---------------------------------------------------------------------------------


def model_cases(path: Path, n_tokens: int = CANVAS) -> dict[str, list[str]]:
    """test-backend-ops cases (DG_TBO_CASES items) for the products of one forward of `n_tokens`
    tokens through the GGUF at `path`: its MoE products at their types, the F16/BF16 experts of the
    same shapes, its dense decoder products (one per type and shape) and the step's TOP_K."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    used = int(reader.fields[f"{arch}.expert_used_count"].contents())
    moe, dense = [], []
    moe_shapes = set()
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name.lower()
        shape = [int(n) for n in t.shape]  # ggml order: [k, m, experts]
        if qtype in ("q4_k", "q5_k", "q6_k", "q2_k", "q3_k"):
            qtype = qtype[:-1] + "K"  # ggml's names: q4_K
        if "_exps." in t.name and len(shape) == 3:
            k, m, n_exp = shape
            moe.append(f"mul_mat_id:{qtype}:{n_exp}:{used}:{m}:{n_tokens}:{k}")
            moe_shapes.add((n_exp, m, k))
        elif len(shape) == 2 and t.name.endswith(".weight") and qtype not in ("f32", "f16", "bf16"):
            # token_embd included: the LM head's product where the output is tied to it
            k, m = shape
            dense.append(f"mul_mat:{qtype}:{m}:{n_tokens}:{k}")
    half = [f"mul_mat_id:{ty}:{e}:{used}:{m}:{n_tokens}:{k}" for (e, m, k) in sorted(moe_shapes) for ty in HALF_EXPERT_TYPES]
    # the dense self-conditioning product (the engine's default): E^T, made at load as Q8_0 where the
    # vocabulary is whole 32-token blocks (native/patch/src/diffusion-gemma-embd-t.h), times the probabilities
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is not None:
        n_embd, n_vocab = (int(n) for n in embd.shape[:2])
        if n_vocab % 32 == 0:
            dense.append(f"mul_mat:q8_0:{n_embd}:{n_tokens}:{n_vocab}")
    return {"moe": sorted(set(moe)), "moe_half": half, "dense": sorted(set(dense)), "topk": [TOPK_CASE]}


# -- test-backend-ops -----------------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")
TBO_LINE = re.compile(r"^\s+([A-Z_]+)\((.*)\):\s+(.*)$")
TBO_PERF = re.compile(r"(\d+) runs -\s+([\d.]+) us/run")


def parse_tbo(text: str) -> list[dict[str, Any]]:
    """test-backend-ops' console lines: one dict per case with its op, parameters and either a
    status (test mode: OK, FAIL, not supported) or the time per run (perf mode)."""
    out = []
    for raw in text.splitlines():
        line = ANSI.sub("", raw)
        m = TBO_LINE.match(line)
        if not m:
            continue
        op, params, rest = m.groups()
        perf = TBO_PERF.search(rest)
        entry: dict[str, Any] = {"op": op, "params": params}
        if perf:
            entry["runs"], entry["us"] = int(perf[1]), float(perf[2])
        elif rest.endswith("OK"):
            entry["status"] = "OK"
        elif "FAIL" in rest:
            entry["status"] = "FAIL"
            entry["detail"] = rest[:200]
        elif rest.startswith("not supported"):
            entry["status"] = "not supported"
        else:
            continue
        out.append(entry)
    return out


def case_key(entry: dict[str, Any]) -> str:
    """A short name for a case from its parameters: type, m x k (and experts)."""
    p = dict(kv.split("=", 1) for kv in re.split(r",(?=[a-z_]+=)", entry["params"]) if "=" in kv)
    if entry["op"] == "MUL_MAT_ID":
        return f"moe {p.get('type_a')} {p.get('m')}x{p.get('k')} e{p.get('n_mats')}/{p.get('n_used')} n{p.get('n')}"
    if entry["op"] == "MUL_MAT":
        return f"dense {p.get('type_a')} {p.get('m')}x{p.get('k')} n{p.get('n')}"
    return f"{entry['op'].lower()} {p.get('ne', '')} k={p.get('k', '')}"


def tbo_env(lib_dirs: list[str]) -> dict[str, str]:
    """test-backend-ops links libggml.so.0 and libggml-base.so.0 (the slim wheel keeps libggml.so
    alone: a folder with that link comes first), libggml-cuda its CUDA runtime from the pip wheels."""
    return dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        [*lib_dirs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]))


def ggml_lib_dirs(llama_lib: Path, scratch: Path) -> list[str]:
    """The folders test-backend-ops loads its libraries from: a scratch folder with libggml.so.0
    (a link to the wheel's libggml.so), the wheel's lib folder, NVIDIA's pip wheels' lib folders."""
    from dgcli.runtime import native

    scratch.mkdir(parents=True, exist_ok=True)
    link = scratch / "libggml.so.0"
    if not link.exists() and (llama_lib / "libggml.so").exists() and not (llama_lib / "libggml.so.0").exists():
        link.symlink_to(llama_lib / "libggml.so")
    return [str(scratch), str(llama_lib), *native.cuda_library_dirs()]


def run_tbo(binary: Path, mode: str, cases: list[str], switches: dict[str, str], lib_dirs: list[str],
            backend: str, timeout_s: float, log: Path) -> list[dict[str, Any]]:
    """test-backend-ops in `mode` (test / perf) on `cases` with the kernel `switches` set; its output
    appended to `log`, its cases parsed."""
    env = tbo_env(lib_dirs)
    for k in SWITCHES:
        env.pop(k, None)
    env.update(switches)
    env["DG_TBO_CASES"] = ";".join(cases)
    cmd = [str(binary), mode, "-b", backend]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(timeout_s, 5))
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(f'{k}={v}' for k, v in switches.items())} {' '.join(cmd)}\n")
        f.write(proc.stdout + proc.stderr)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"test-backend-ops {mode} exited {proc.returncode}: "
                           + " ".join((proc.stderr or proc.stdout).split())[-200:])
    return parse_tbo(proc.stdout)


def faster_as_bf16(mmq: list[dict[str, Any]], bf16: list[dict[str, Any]]) -> list[str]:
    """The dense shapes ("MxK") whose BF16 GEMM ran faster than MMQ in perf mode."""
    base = {e["params"]: e["us"] for e in mmq if "us" in e}
    out = []
    for e in bf16:
        if "us" in e and e["params"] in base and e["us"] < base[e["params"]]:
            p = dict(kv.split("=", 1) for kv in re.split(r",(?=[a-z_]+=)", e["params"]) if "=" in kv)
            shape = f"{p['m']}x{p['k']}"
            if shape not in out:
                out.append(shape)
    return out


# -- the kernel test ------------------------------------------------------------------------------------


def run_kernel_test(binary: Path, timeout_s: float, log: Path) -> dict[str, Any]:
    """The standalone kernel test: exit status, its summary line and its timing (last line, JSON)."""
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=max(timeout_s, 5))
    log.write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    timing: dict[str, Any] = {}
    if lines and lines[-1].startswith("{"):
        timing = json.loads(lines[-1])
    summary = next((line for line in reversed(lines) if "checks," in line), lines[-1] if lines else "no output")
    return {"exit": proc.returncode, "summary": summary, "timing": timing,
            "device": next((line[8:] for line in lines if line.startswith("device: ")), None)}


# -- timing the step and the decode ---------------------------------------------------------------------


def time_interleaved(settings: dict[str, dict[str, str]], fns: dict[str, Callable[[], Any]], rounds: int,
                     reps: int, restart: Callable[[], Any] = lambda: None) -> dict[str, dict[str, list[float]]]:
    """Each round runs every setting in turn: `restart()` (the same context for each), then under its
    switches each fn twice untimed (the first run after a switch change executes without a CUDA
    graph, the second captures one) and `reps` timed runs. Returns {setting: {fn name: seconds}}."""
    out: dict[str, dict[str, list[float]]] = {name: {f: [] for f in fns} for name in settings}
    for _ in range(rounds):
        for name, env in settings.items():
            restart()
            with switched(env):
                for fname, fn in fns.items():
                    fn()
                    fn()
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        fn()
                        out[name][fname].append(time.perf_counter() - t0)
    return out


# A setting's step against the base's on the same inputs: float rounding (BF16 against Q8_1
# activations, another summation order) moves a near-tie's argmax; a wrong kernel moves nearly all.
MIN_AGREEMENT = 0.8


def agreement_with_base(settings: dict[str, dict[str, str]], step: Callable[[], Any],
                        restart: Callable[[], None]) -> dict[str, dict[str, float]]:
    """Each setting's step record (the second run: from its CUDA graph) against the base's."""
    import numpy as np

    records = {}
    for name, env in settings.items():
        restart()
        with switched(env):
            step()
            records[name] = step()
    base = records["base"]
    out = {}
    for name, r in records.items():
        topk = (float(np.mean([len(set(a) & set(b)) / max(1, len(a)) for a, b in zip(r.topk_ids, base.topk_ids)]))
                if r.topk_ids is not None else 1.0)
        soft = 0.0
        if getattr(r, "soft", None) is not None and getattr(base, "soft", None) is not None:
            soft = float(np.max(np.abs(r.soft - base.soft)) / max(float(np.max(np.abs(base.soft))), 1e-30))
        out[name] = {"argmax": float(np.mean(r.argmax == base.argmax)), "sampled": float(np.mean(r.sampled == base.sampled)),
                     "topk": topk, "entropy": float(np.max(np.abs(r.entropy.astype(np.float64) - base.entropy))),
                     "soft": soft}
    return out


def graphs_reused(model) -> int:
    """llama.cpp's count of compute graphs reused by this model's context."""
    return int(model._lib.llama_perf_context(model._ctx).n_reused)


def alternating_step(model, fns: dict[str, Callable[[], Any]], restart: Callable[[], None], env: dict[str, str],
                     n: int) -> dict[str, Any]:
    """The step timed right after a one-token decode, as dg bench's speed model pairs them (and a
    generation runs a commit between canvases): llama.cpp keeps one graph, so each call rebuilds."""
    restart()
    with switched(env):
        seconds = []
        before = graphs_reused(model)
        for _ in range(n):
            fns["decode"]()
            t0 = time.perf_counter()
            fns["step"]()
            seconds.append(time.perf_counter() - t0)
        reused = graphs_reused(model) - before
    return {"step_ms": summary_ms(seconds), "reused": reused, "calls": 2 * n}


def summary_ms(seconds: list[float]) -> dict[str, float]:
    return {"min": round(min(seconds) * 1e3, 3), "median": round(statistics.median(seconds) * 1e3, 3),
            "n": len(seconds)}


def step_and_decode(model, rng) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    """The one-graph step as the engine runs it by default (256-token canvas, dense self-conditioning:
    the previous step's soft embedding in, this step's probabilities times E out, the sampler's pass
    in the graph), the same step with top-64 self-conditioning (the earlier default), the one-token
    decode (encoder, logits out: an AR decode on these weights), the decoder over a one-token row
    (logits out), and the commit (the encoder over a finished canvas: a 256-token prefill) on the
    same weights; and the restart that puts the 64-token prompt back in an empty cache (decodes add
    a token each, commits a canvas)."""
    import numpy as np

    C = int(model.canvas_length)
    V = int(model.vocab_size)
    k = min(SC_TOP_K, V)
    prompt = [2, 105] + [int(t) for t in rng.integers(200, 400, 61)] + [106]

    def restart() -> None:
        model.reset()
        model.prefill(prompt)

    canvas = np.asarray([rng.integers(200, 400, C)], dtype=np.int32)
    ids = np.stack([rng.choice(V, k, replace=False) for _ in range(C)]).astype(np.int32)
    probs = np.full((C, k), 1 / k, dtype=np.float32)
    soft = rng.standard_normal((1, C, int(model.n_embd))).astype(np.float32)  # as dg bench's speed model
    uniforms = rng.random((1, C))

    def step():
        return model.denoise_step(canvas, np.float32(0.6), uniforms, sc_soft=soft, next_soft=True)[0]

    def step_top64():
        return model.denoise_step(canvas, np.float32(0.6), uniforms, sc_topk=(ids[None], probs[None]), top_k=k)[0]

    def decode() -> None:
        model.prefill([int(rng.integers(200, 400))], return_logits=True)

    def decoder_row() -> None:
        model.decode_canvas([int(rng.integers(200, 400))])

    def commit() -> None:  # last: the cache grows by a canvas
        model.commit(canvas[0])

    return {"step": step, "step_top64": step_top64, "decode": decode, "decoder_row": decoder_row,
            "commit": commit}, restart


# -- the results file -----------------------------------------------------------------------------------


def results_document(device: str, quants: dict[str, dict[str, Any]], primary: str, extra: dict[str, Any]) -> dict:
    """benchmarks/results/gpu-<date>.json: device, quant (the file the top-level figures are of),
    step_ms (the shipped default's one-graph step, min), decode_ms (one-token decode, min), variants
    (name -> step ms, min), then every quant's figures and the kernel checks."""
    q = quants.get(primary, {})
    return {
        "device": device,
        "quant": primary,
        "step_ms": q.get("step_ms", {}).get("base", {}).get("min"),
        "decode_ms": q.get("decode_ms", {}).get("base", {}).get("min"),
        "variants": {name: s["min"] for name, s in q.get("step_ms", {}).items()},
        "quants": quants,
        **extra,
    }


def write_results(out_dir: Path, doc: dict[str, Any]) -> Path:
    path = out_dir / f"gpu-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def unpack_tools(folder: Path, dest: Path) -> dict[str, Path | None]:
    """The kernel test and test-backend-ops the bundle carries (gpu_bundle.py: folder/NAME.gz), unpacked
    into `dest` and made executable; a plain folder/NAME is used as it is; None where neither is."""
    import gzip
    import shutil

    out: dict[str, Path | None] = {}
    for name in (KERNEL_TEST, TEST_BACKEND_OPS):
        packed, plain = folder / f"{name}.gz", folder / name
        if plain.is_file():
            out[name] = plain
        elif packed.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            exe = dest / name
            with gzip.open(packed, "rb") as src, open(exe, "wb") as f:
                shutil.copyfileobj(src, f)
            exe.chmod(0o755)
            out[name] = exe
        else:
            out[name] = None
    return out


# -- the check's steps (benchmarks/gpu_check.py: `check` is its Check) ----------------------------------

# Which switches change which kernels: test mode runs each group's cases under each of its settings.
TEST_GROUPS = {
    "moe": ["moe_tile_mean", "moe_compact_mean", "moe_compact_32"],
    "moe_half": ["moe_mmf"],
    "topk": ["topk_radix"],
    "dense": ["dense_bf16"],
}
# Perf mode: the base and each setting, per group.
PERF_GROUPS = {
    "moe": ["base", "moe_tile_mean", "moe_tile_32", "moe_compact_mean", "moe_compact_32"],
    "moe_half": ["base", "moe_mmf"],
    "topk": ["base", "topk_radix"],
    "dense": ["base", "dense_bf16"],
}
# test mode computes each case on the CPU too: the LM head's product (262144 rows) is left to perf mode
TEST_MAX_ELEMENTS = 64 * 2**20


def switch_sets() -> dict[str, dict[str, str]]:
    sets = variants([])
    sets["moe_mmf"] = {"DG_CUDA_MOE_MMF": "1"}
    return sets


def _small_enough(case: str) -> bool:
    parts = case.split(":")
    if parts[0] == "mul_mat":
        return int(parts[2]) * int(parts[4]) <= TEST_MAX_ELEMENTS
    return True


def step_kernel_test(check, binary: Path | None, dry_run: bool) -> None:
    """The fused step's kernels and the MoE layout kernel alone against their host twins."""
    if binary is None:
        check.add("kernels", "kernel test", "not built", "benchmarks/gpu_bundle.py builds .whl/bin/dg_cuda_kernel_test")
        return
    res = run_kernel_test(binary, min(120.0, check.left()), check.out / "kernel-test.log")
    check.data["kernel_test"] = res
    if res["exit"] == 2 and dry_run:
        check.add("kernels", "kernel test", "no GPU", "dry run: the binary ran and found no CUDA device")
        return
    check.add("kernels", "kernel test (fused step, MoE layout) vs host", res["summary"], "kernel-test.log")
    timing = res["timing"]
    for key, label in (("step_ms_top64", "top-64"), ("step_ms_top0", "no top-k")):
        if key in timing:
            check.add("kernels", f"fused pass, 256 x 262144 logits, {label}",
                      f"{timing[key]['min']:.3f} ms", f"median {timing[key]['median']:.3f} ms (kernels alone)")
    if res["exit"] != 0:
        raise RuntimeError(f"kernel test exited {res['exit']}: {res['summary']}")


def step_ops(check, binary: Path | None, mode: str, cases: dict[str, list[str]], lib_dirs: list[str],
             backend: str) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """test-backend-ops in test mode (each group's cases under each of its settings, against the CPU)
    or perf mode (under the base and each setting). Returns {group: {setting: parsed cases}}."""
    if binary is None:
        check.add(f"ops-{mode}", "test-backend-ops", "not built", "benchmarks/gpu_bundle.py builds .whl/bin/test-backend-ops")
        return {}
    sets = switch_sets()
    groups = TEST_GROUPS if mode == "test" else PERF_GROUPS
    log = check.out / "test-backend-ops.log"  # both modes: the device returns at most 8 files
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    failed = []
    for group, settings in groups.items():
        group_cases = [c for c in cases.get(group, []) if mode == "perf" or _small_enough(c)]
        if not group_cases:
            continue
        for setting in settings:
            if check.left() < 20:
                check.add(f"ops-{mode}", f"{group} / {setting}", "skipped", "out of time budget")
                continue
            parsed = run_tbo(binary, mode, group_cases, sets[setting], lib_dirs, backend,
                             min(120.0, check.left() - 10), log)
            results.setdefault(group, {})[setting] = parsed
            if mode == "test":
                bad = [case_key(e) for e in parsed if e.get("status") != "OK"]
                failed += [f"{setting}: {b}" for b in bad]
                check.add("ops-test", f"{group} under {setting}",
                          f"{sum(e.get('status') == 'OK' for e in parsed)}/{len(parsed)} OK",
                          ("; ".join(bad)[:150]) if bad else f"{len(group_cases)} cases vs the CPU")
    if mode == "perf":
        for group, by_setting in results.items():
            base = {case_key(e): e["us"] for e in by_setting.get("base", []) if "us" in e}
            for setting, parsed in by_setting.items():
                for e in parsed:
                    if "us" not in e:
                        continue
                    key = case_key(e)
                    vs = f", {base[key] / e['us']:.2f}x base" if setting != "base" and key in base else ""
                    check.add("ops-perf", f"{key} [{setting}]", f"{e['us']:.1f} us", f"{e['runs']} runs{vs}")
    check.data.setdefault("test_backend_ops", {})[mode] = results
    if failed:
        raise RuntimeError(f"{len(failed)} cases failed against the CPU: {'; '.join(failed)[:200]}")
    return results


def dense_auto_shapes(perf: dict[str, dict[str, list[dict[str, Any]]]], dense_cases: list[str]) -> list[str]:
    """Of `dense_cases`, the shapes whose BF16 GEMM beat MMQ in perf mode."""
    dense = perf.get("dense", {})
    wanted = {f"{c.split(':')[2]}x{c.split(':')[4]}" for c in dense_cases}
    return [s for s in faster_as_bf16(dense.get("base", []), dense.get("dense_bf16", [])) if s in wanted]


def step_variants(check, path: Path, quant: str, dense_shapes: list[str], rounds: int, reps: int) -> dict[str, Any]:
    """The one-graph step and the one-token decode under every setting, interleaved rounds."""
    import numpy as np

    from dgcli.runtime.model import DiffusionModel

    t0 = time.monotonic()
    model = DiffusionModel(path, n_gpu_layers=-1)
    check.add(f"variants {quant}", "load (every layer offloaded)", f"{time.monotonic() - t0:.1f} s")
    try:
        fns, restart = step_and_decode(model, np.random.default_rng(0))
        settings = variants(dense_shapes)
        agreement = {form: agreement_with_base(settings, fns[form], restart) for form in ("step", "step_top64")}
        times = time_interleaved(settings, fns, rounds, reps, restart)
        alternating = {name: alternating_step(model, fns, restart, settings[name], rounds * reps)
                       for name in ("base", "all")}
    finally:
        model.close()
    ms = {f: {name: summary_ms(t[f]) for name, t in times.items()} for f in fns}
    base = ms["step"]["base"]["min"]
    for name in settings:
        s, t64, d, row, c = (ms[f][name] for f in ("step", "step_top64", "decode", "decoder_row", "commit"))
        check.add(f"variants {quant}", f"{name}: step / decode (min)", f"{s['min']:.2f} / {d['min']:.2f} ms",
                  f"median {s['median']:.2f} / {d['median']:.2f}; step {base / s['min']:.2f}x base, "
                  f"{s['min'] / d['min']:.1f}x decode; top-64 step {t64['min']:.2f}, decoder row {row['min']:.2f}, "
                  f"commit {c['min']:.2f} ms")
    for form, by_name in agreement.items():
        for name, a in by_name.items():
            if name != "base":
                check.add(f"variants {quant}", f"{name}: same {form.replace('_', ' ')} as base",
                          f"argmax {a['argmax']:.3f}",
                          f"sample {a['sampled']:.3f}, top-k ids {a['topk']:.3f}, max |entropy diff| "
                          f"{a['entropy']:.2e}, soft embedding max rel diff {a['soft']:.2e}")
    for name, a in alternating.items():
        check.add(f"variants {quant}", f"{name}: step right after a decode (min)", f"{a['step_ms']['min']:.2f} ms",
                  f"median {a['step_ms']['median']:.2f}; llama.cpp reused {a['reused']} of {a['calls']} graphs "
                  "(it keeps one: a rebuilt graph also restarts ggml-cuda's CUDA graph warm-up)")
    out = {"step_ms": ms["step"], "step_top64_ms": ms["step_top64"], "decode_ms": ms["decode"],
           "decoder_row_ms": ms["decoder_row"],
           "commit_ms": ms["commit"], "agreement_with_base": agreement, "step_after_decode": alternating,
           "settings": settings, "rounds": rounds, "reps": reps}
    check.data.setdefault("quants", {})[quant] = out
    wrong = [f"{name} ({form})" for form, by_name in agreement.items() for name, a in by_name.items()
             if a["argmax"] < MIN_AGREEMENT]
    if wrong:
        raise RuntimeError(f"settings whose step disagrees with the base: {', '.join(wrong)} (argmax agreement "
                           f"below {MIN_AGREEMENT}); their timings are in the table")
    return out


def step_speed_model(check, path: Path, switches: dict[str, str], batch_sizes: list[int], repeat: int) -> None:
    """dg bench's speed model and batch sweep (dgcli.bench.measure_speed_model, what `dg bench` runs
    after its prompts) on the diffusion weights, with `switches` set."""
    from dgcli.bench import measure_speed_model
    from dgcli.runtime.model import DiffusionModel

    with switched(switches):
        model = DiffusionModel(path, n_gpu_layers=-1, n_seq_max=max(batch_sizes))
        try:
            sm, notes = measure_speed_model(model, batch_sizes=batch_sizes, repeat=repeat)
        finally:
            model.close()
    check.add("bench", "speed model: canvas step / one-token decode",
              f"{sm.canvas_forward_s * 1e3:.2f} / {sm.decode_s * 1e3:.2f} ms = {sm.ratio:.2f}x", sm.canvas_step)
    for p in sm.batch_sweep:
        check.add("bench", f"batch {p.batch}: canvas step / decode",
                  "-" if p.ratio is None else f"{p.canvas_s * 1e3:.2f} / {p.decode_s * 1e3:.2f} ms",
                  p.error or (f"{p.ratio:.2f}x" if p.ratio is not None else ""))
    check.data["speed_model"] = {"switches": switches, "canvas_step_ms": sm.canvas_forward_s * 1e3,
                                 "decode_ms": sm.decode_s * 1e3, "ratio": sm.ratio, "notes": notes,
                                 "batch_sweep": [{"batch": p.batch, "canvas_ms": None if p.canvas_s is None else p.canvas_s * 1e3,
                                                  "decode_ms": None if p.decode_s is None else p.decode_s * 1e3,
                                                  "ratio": p.ratio, "note": p.error} for p in sm.batch_sweep]}


if __name__ == "__main__":
    sys.exit("run benchmarks/gpu_check.py; this module holds its kernel steps")
