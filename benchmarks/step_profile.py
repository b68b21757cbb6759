#!/usr/bin/env python3
"""One denoising step, op by op, against this CPU's measured peaks, for each CPU kernel family.

    .venv/bin/python benchmarks/step_profile.py [--gguf PATH | --layers 2 --experts 128 --quant q8_0]
                                                [--families auto] [--threads 1,2] [--reps 3]
                                                [--sc-top-k 64] [--real-layers 30]
                                                [--no-reference] [--json]

For any diffusion-gemma GGUF (default: the real-width synthetic model of benchmarks/native_costs.py,
vocab 262144, hidden 2816, --layers layers of --experts experts (128, top-8: the real model's ~16 tokens
per expert, where the experts' weight reads dominate), written once and cached), per thread count:

1. the step end to end, self-conditioned on the previous step's top-k (what `dg generate` runs on
   this vocabulary): the one-graph step (`DiffusionModel.denoise_step`) on each of dg's CPU kernel
   families (--families; `auto`: every one this CPU runs, so an AVX-512 VNNI CPU measures the AVX2
   kernels too: DG_CPU_KERNELS=avx512-vnni | avx2, read when a model loads) and on ggml's kernels alone
   (DG_CPU_KERNELS=ggml), interleaved, minimum and median of --reps;
2. per family, where the graph step's time goes: every node timed through llama.cpp's per-node eval
   callback (dgcli.engine.profile), grouped by op and node name: seconds, share of the step,
   multiply-adds, achieved G MAC/s per thread against the family's single-thread int8 peak (measured
   here with register-resident instruction chains, `dg_peak_gmacs`: vpdpbusd zmm for avx512-vnni, the
   vpmaddubsw + vpmaddwd chain for avx2) and the bf16 peak, and the op's floor (its multiply-adds at
   the peak: int8 for quantized weights, bf16 otherwise); this CPU's single-thread read bandwidth is
   printed beside it, since with ~16 tokens per expert the experts' weights are read at about 16
   multiply-adds a byte;
3. the real model's step predicted from that profile: nodes of a layer (names ending in -<layer>)
   scaled to --real-layers (30), the rest (LM head, sampler pass, self-conditioning MLP) as measured;
   the floor the same way;
4. with torch installed, the Transformers reference (DiffusionGemmaForBlockDiffusion in bf16 or fp32 with
   the GGUF's shapes and random weights) timed through its own `_denoising_step`: with the dense
   self-conditioning it always uses after a canvas's first step, and without (the first step).

The per-node timing runs the graph one node at a time, so its total is a little above the
uninterrupted step of part 1; the shares are what to read from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgcli.engine.types import DgError  # noqa: E402

PROMPT_TOKENS = 64


def synthetic_model(layers: int, quant: str, experts: int) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from native_costs import synthetic_model as cached_synthetic_model

    return cached_synthetic_model(layers, quant, experts)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) of fn(): on a shared machine the CPU time
    is what the work cost, the wall time also holds the waits for a core."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


# ---- dg: the step end to end, and op by op --------------------------------------------------------


NAMED_GROUPS = {
    ("CUSTOM", "lm_head"): "LM head (repacked int8 GEMM)",
    ("CUSTOM", "repacked_act"): "activations quantized for the repacked GEMMs",
    ("CUSTOM", "dg_step"): "step: softcap, softmax, entropy, sample, top-k",
}
# the dense projections, by node name: through our repacked GEMM (CUSTOM) or ggml's (MUL_MAT)
DENSE_GROUPS = {"Qcur": "attention projections", "Kcur": "attention projections", "Vcur": "attention projections",
                "attn_output": "attention projections", "ffn_gate": "dense FFN gate", "ffn_up": "dense FFN up",
                "ffn_down": "dense FFN down", "sc_ffn_gate": "self-conditioning MLP", "sc_ffn_up": "self-conditioning MLP",
                "sc_ffn_down": "self-conditioning MLP", "sc_signal": "self-conditioning MLP"}
# the experts on our tiles: the GEMM's own name, or the gate+up product's (which it is)
EXPERT_GEMMS = {"experts_gemm", "ffn_moe_gate_up"}
NAMED_GROUPS[("CUSTOM", "experts_act")] = "activations quantized for the experts' GEMMs"
REPACKED_GEMMS = {"lm_head", *DENSE_GROUPS, *EXPERT_GEMMS}


def group_of(node, n_vocab: int, n_embd: int) -> str:
    """A readable group for a graph node: its op and its name without the layer suffix."""
    base = re.sub(r"-\d+$", "", node.name)
    if node.op == "MUL_MAT" and node.shapes[1][1] == n_vocab:
        return "LM head (ggml MUL_MAT)"
    if node.op == "MUL_MAT_ID":  # by shape (the down product's name sits on its per-expert scale's MUL): down
        # projections give n_embd outputs, gate+up 2 x the experts' width
        return "MoE down (MUL_MAT_ID)" if node.shapes[1][1] == n_embd else "MoE gate+up (MUL_MAT_ID)"
    if node.op == "CUSTOM" and base in EXPERT_GEMMS:  # the down product's name sits on its scale's MUL
        return ("MoE gate+up" if base == "ffn_moe_gate_up" else "MoE down") + " (experts on our tiles)"
    if node.op == "CUSTOM" and base == "lm_head" and node.shapes[1][0] % 36:  # Q8_K activations: a K-quant head
        return "LM head (K-quant tile)"
    if (node.op, base) in NAMED_GROUPS:
        return NAMED_GROUPS[(node.op, base)]
    if node.op in ("MUL_MAT", "CUSTOM") and base in DENSE_GROUPS:
        if node.op == "MUL_MAT":
            return DENSE_GROUPS[base] + " (MUL_MAT)"
        return DENSE_GROUPS[base] + (" (repacked int8 GEMM)" if node.shapes[1][0] % 36 == 0 else " (K-quant tile)")
    if node.op == "FLASH_ATTN_EXT":
        return "attention (FLASH_ATTN_EXT)"
    if not base or base.startswith(("node_", "leaf_")) or " (" in base:
        return f"{node.op} (unnamed)"
    return f"{node.op} {base}"


def gemm_width(node, n_embd: int) -> int:
    """K of one of our GEMMs (custom ops): n_embd for the experts' gate+up, else from the quantized
    activations' row: K/32 blocks of 32 quants and a 4-byte scale, or for Q4_K and Q6_K weights K/256
    blocks of 256 quants, a 4-byte scale and 8 4-byte sums (a row that is not whole 36-byte blocks)."""
    if re.sub(r"-\d+$", "", node.name) == "ffn_moe_gate_up":
        return n_embd
    row = node.shapes[1][0]
    return row // 36 * 32 if row % 36 == 0 else row // 292 * 256


def multiply_adds(node, n_embd: int) -> int:
    # our repacked GEMMs are custom ops: K multiply-adds per output
    if node.op == "CUSTOM" and re.sub(r"-\d+$", "", node.name) in REPACKED_GEMMS:
        return gemm_width(node, n_embd) * node.shapes[0][0] * node.shapes[0][1] * node.shapes[0][2]  # experts: [n_out, n_used, tokens]
    return node.multiply_adds()


def floor_peak(node, peaks: dict) -> float:
    """The single-thread peak an op's multiply-adds could run at: int8 for quantized weights."""
    quantized = node.src0_type.startswith(("q", "iq", "tq")) or (
        node.op == "CUSTOM" and re.sub(r"-\d+$", "", node.name) in REPACKED_GEMMS)
    return peaks["int8"][0] if quantized else peaks["bf16"][0]


def in_layer(node) -> bool:
    """Whether a node belongs to a layer (llama.cpp names a layer's nodes name-<layer>)."""
    return re.search(r"-\d+$", node.name) is not None


# what each family's int8 work is measured against (dg_peak_gmacs kinds, dgcli.engine.native)
FAMILY_PEAK = {"avx512-vnni": "PEAK_INT8", "avx2": "PEAK_INT8_AVX2", "ggml": "PEAK_INT8"}
KERNEL_IDS = {1: "avx2", 2: "avx512-vnni"}
COMPONENT_VARIABLES = ("DG_LM_HEAD", "DG_DENSE_GEMM", "DG_EXPERT_GEMM")


def cpu_families() -> list[str]:
    """dg's kernel families this CPU runs, widest first (a VNNI CPU runs the AVX2 kernels too)."""
    from dgcli.engine import native

    lib = native.lib()._lib
    return [name for kernel, name in sorted(KERNEL_IDS.items(), reverse=True) if lib.dg_expert_buffer_type(kernel)]


@contextlib.contextmanager
def family_env(family: str):
    """DG_CPU_KERNELS=family for the block, the per-component variables cleared so that the family
    decides: the GEMMs read it when a model loads and builds its first graph, the sampler's pass at
    every row."""
    env = {"DG_CPU_KERNELS": family, **{k: None for k in COMPONENT_VARIABLES}}
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def open_model(path: Path, threads: int, family: str, eval_callback=None):
    """A DiffusionModel on one CPU kernel family."""
    from dgcli.engine.model import DiffusionModel

    with family_env(family):
        m = DiffusionModel(path, n_threads=threads, n_ctx=2048, eval_callback=eval_callback)
        m.decode_canvas(np.zeros(m.canvas_length, np.int32))
    return m


def read_bandwidth_gbs(seconds: float = 1.0) -> float:
    """This thread's read bandwidth from memory (GB/s): the fastest of a few sums over 512 MiB."""
    data = np.ones(1 << 26, dtype=np.float64)  # 512 MiB, far beyond any cache
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds or best == 0.0:
        t0 = time.perf_counter()
        data.sum()
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def profile_groups(profiled: list, peaks: dict, n_vocab: int, n_embd: int, layer_scale: float) -> dict:
    """Node times grouped (the repetition with the least CPU time per group: the box's load only adds),
    with each group's share of a real-depth step: its layer nodes times layer_scale."""
    groups: dict[str, dict] = {}
    for nodes in profiled:
        sums: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0, 0.0, 0.0, 0.0])
        for node in nodes:
            g = sums[group_of(node, n_vocab, n_embd)]
            macs = multiply_adds(node, n_embd)
            floor = macs / floor_peak(node, peaks) / 1e9 if macs else 0.0
            scale = layer_scale if in_layer(node) else 1.0
            g[0] += node.cpu_seconds
            g[1] += node.seconds
            g[2] += macs
            g[3] += floor
            g[4] += node.cpu_seconds * scale
            g[5] += floor * scale
        for name, (cpu, wall, macs, floor, real_cpu, real_floor) in sums.items():
            if name not in groups or cpu < groups[name]["cpu_s"]:
                groups[name] = {"cpu_s": cpu, "wall_s": wall, "multiply_adds": macs, "floor_cpu_s": floor,
                                "real_cpu_s": real_cpu, "real_floor_cpu_s": real_floor}
    total = sum(g["cpu_s"] for g in groups.values())
    rows = []
    for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["cpu_s"]):
        rate = g["multiply_adds"] / g["cpu_s"] / 1e9 if g["multiply_adds"] and g["cpu_s"] else 0.0
        rows.append(dict(op=name, cpu_s=g["cpu_s"], wall_s=g["wall_s"], share=g["cpu_s"] / total,
                         gmac=g["multiply_adds"] / 1e9, gmacs_per_thread=rate,
                         of_int8_peak=rate / peaks["int8"][0], of_bf16_peak=rate / peaks["bf16"][0],
                         floor_cpu_s=g["floor_cpu_s"], real_cpu_s=g["real_cpu_s"],
                         real_floor_cpu_s=g["real_floor_cpu_s"]))
    return dict(profiled_cpu_s=total, ops=rows, step_gmac=sum(r["gmac"] for r in rows),
                floor_cpu_s=sum(r["floor_cpu_s"] for r in rows),
                real_cpu_s=sum(r["real_cpu_s"] for r in rows), real_floor_cpu_s=sum(r["real_floor_cpu_s"] for r in rows))


def measure_dg(path: Path, threads: int, reps: int, sc_top_k: int, peaks: dict, families: list[str],
               real_layers: int) -> dict:
    """The step on each family and on ggml's kernels, interleaved; then each family's step node by node."""
    from dgcli.engine import native
    from dgcli.engine.profile import NodeProfiler

    profiler = NodeProfiler()
    models = {}
    try:
        for family in [*families, "ggml"]:
            models[family] = open_model(path, threads, family, eval_callback=profiler.eval_callback)
        rng = np.random.default_rng(0)
        first_model = next(iter(models.values()))
        C, V, n_embd = first_model.canvas_length, first_model.vocab_size, first_model.n_embd
        n_layer = int(first_model.header.get("diffusion-gemma.block_count"))
        prompt = [int(t) for t in rng.integers(200, 400, PROMPT_TOKENS)]
        for m in models.values():
            m.prefill(prompt)
        canvas = rng.integers(0, V, (1, C))
        temperature = np.float32(0.6)
        # a first step (no self-conditioning) gives the top-k the next ones are conditioned on
        [first] = first_model.denoise_step(canvas, temperature, rng.random((1, C)), top_k=sc_top_k)
        sc = (first.topk_ids[None], first.topk_probs[None])

        families_of = {id(m): family for family, m in models.items()}

        def graph_step(m):
            def step():
                with family_env(families_of[id(m)]):
                    m.denoise_step(canvas, temperature, rng.random((1, C)), sc_topk=sc, top_k=sc_top_k)
            return step

        times: dict[str, list] = {f"graph step, {family}": [] for family in models}
        for _ in range(reps):  # interleaved: the box's load hits every variant alike
            for family, m in models.items():
                times[f"graph step, {family}"].append(timed(graph_step(m)))

        lib = native.lib()._lib
        runs = {}
        for family in families:
            m = models[family]
            profiled = []
            for _ in range(reps):
                profiler.enabled = True
                graph_step(m)()
                profiler.enabled = False
                profiled.append(profiler.take())
            family_peaks = dict(peaks, int8=peaks[FAMILY_PEAK[family]])
            runs[family] = dict(lm_head=lib.dg_lm_head_path(m._model).decode(),
                                experts_on_dg=lib.dg_expert_gemm_count(m._model), peak_int8=family_peaks["int8"],
                                **profile_groups(profiled, family_peaks, V, n_embd, real_layers / n_layer))
    finally:
        for m in models.values():
            m.close()
        profiler.close()
    return dict(threads=threads, steps=times, families=runs, layers=n_layer, real_layers=real_layers)


# ---- the Transformers reference ------------------------------------------------------------------


def reference_config(path: Path):
    """A DiffusionGemmaConfig with the GGUF's shapes (read with the gguf package)."""
    import gguf
    from transformers import DiffusionGemmaConfig

    reader = gguf.GGUFReader(str(path))

    def value(key, default=None):
        field = reader.fields.get(key)
        if field is None:
            return default
        parts = [field.parts[i].tolist() for i in field.data]
        flat = [p[0] if isinstance(p, list) and len(p) == 1 else p for p in parts]
        return flat if len(flat) > 1 else flat[0]

    def scalar(v):
        return v[0] if isinstance(v, list) else v

    arch = "diffusion-gemma"
    n_layer = int(value(f"{arch}.block_count"))
    sliding = value(f"{arch}.attention.sliding_window_pattern")
    sliding = [bool(s) for s in (sliding if isinstance(sliding, list) else [sliding])]
    kv = value(f"{arch}.attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * n_layer
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    text = dict(
        vocab_size=int(embd.shape[1]), hidden_size=int(value(f"{arch}.embedding_length")),
        intermediate_size=int(scalar(value(f"{arch}.feed_forward_length"))), num_hidden_layers=n_layer,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        num_attention_heads=int(scalar(value(f"{arch}.attention.head_count"))),
        num_key_value_heads=int(next(k for k, s in zip(kv, sliding) if s)),
        num_global_key_value_heads=int(next(k for k, s in zip(kv, sliding) if not s)),
        head_dim=int(value(f"{arch}.attention.key_length_swa")),
        global_head_dim=int(value(f"{arch}.attention.key_length")),
        sliding_window=int(value(f"{arch}.attention.sliding_window")),
        num_experts=int(value(f"{arch}.expert_count")), top_k_experts=int(value(f"{arch}.expert_used_count")),
        moe_intermediate_size=int(scalar(value(f"{arch}.expert_feed_forward_length"))),
        rms_norm_eps=float(value(f"{arch}.attention.layer_norm_rms_epsilon")),
        final_logit_softcapping=float(value(f"{arch}.final_logit_softcapping", 30.0)),
        max_position_embeddings=int(value(f"{arch}.context_length", 262144)),
    )
    from dgcli.reference import TINY_VISION

    return DiffusionGemmaConfig(text_config=text, vision_config=dict(TINY_VISION),
                                canvas_length=int(value("diffusion.canvas_length")))


def measure_reference(path: Path, threads_list: list[int], reps: int, dtype: str = "bf16") -> dict:
    """Seconds per `_denoising_step` of the reference in `dtype` (bf16 or fp32): the first step of
    a canvas (no self-conditioning), and the later ones (dense self-conditioning)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    config = reference_config(path)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=torch_dtype).eval()
    step_times: list[tuple[float, float]] = []
    real_step = model._denoising_step

    def timed_step(*args, **kwargs):
        out = []
        step_times.append(timed(lambda: out.append(real_step(*args, **kwargs))))
        return out[0]

    model._denoising_step = timed_step
    prompt = torch.randint(200, 400, (1, PROMPT_TOKENS))
    results = {}
    for threads in threads_list:
        torch.set_num_threads(threads)
        step_times.clear()
        with torch.no_grad():
            # confidence 1e-30: the adaptive stop never fires, every step runs
            model.generate(prompt, max_new_tokens=config.canvas_length, max_denoising_steps=1 + reps,
                           t_min=0.4, t_max=0.8, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
                           stability_threshold=1, confidence_threshold=1e-30)
        results[threads] = {"no_sc_s": step_times[0], "dense_sc_s": list(step_times[1:])}  # (wall, CPU) each
    return results


# ---- report ------------------------------------------------------------------------------------


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    peaks = report["peaks"]
    console.print(f"[bold]{report['model']}[/bold]: canvas {report['canvas']}, prompt {PROMPT_TOKENS}, "
                  f"self-conditioning top-{report['sc_top_k']}, {report['reps']} reps; times in CPU seconds "
                  f"of the process (the wait for a core on a shared machine left out), wall seconds beside")
    console.print(f"single-thread peaks: int8 {peaks['PEAK_INT8'][0]:.1f} G MAC/s ({peaks['PEAK_INT8'][1]}), "
                  f"int8 of the AVX2 kernels {peaks['PEAK_INT8_AVX2'][0]:.1f} G MAC/s, "
                  f"bf16 {peaks['bf16'][0]:.1f} G MAC/s ({peaks['bf16'][1]}); "
                  f"read bandwidth {report['read_gbs']:.1f} GB/s")
    for run in report["runs"]:
        t = run["threads"]
        for family, fam in run["families"].items():
            table = Table(title=f"{t} thread(s), {family} kernels (int8 peak {fam['peak_int8'][0]:.1f} G MAC/s; LM head "
                                f"{fam['lm_head']}; {fam['experts_on_dg']} expert tensors on dg's GEMM): one "
                                f"self-conditioned step, {fam['step_gmac']:.0f} G multiply-adds, "
                                f"{fam['floor_cpu_s']:.2f} CPU s at the peaks")
            for col in ("op", "CPU s", "wall s", "share", "G MAC", "G MAC/s/thread", "of int8 peak", "of bf16 peak",
                        "floor CPU s"):
                table.add_column(col, justify="left" if col == "op" else "right")
            shown, rest = fam["ops"][:12], fam["ops"][12:]
            for r in shown:
                has = r["gmac"] > 0
                table.add_row(r["op"], f"{r['cpu_s']:.3f}", f"{r['wall_s']:.3f}", f"{r['share']:.1%}",
                              f"{r['gmac']:.1f}" if has else "", f"{r['gmacs_per_thread']:.1f}" if has else "",
                              f"{r['of_int8_peak']:.0%}" if has else "", f"{r['of_bf16_peak']:.0%}" if has else "",
                              f"{r['floor_cpu_s']:.3f}" if has else "")
            if rest:
                table.add_row(f"({len(rest)} more groups)", f"{sum(r['cpu_s'] for r in rest):.3f}",
                              f"{sum(r['wall_s'] for r in rest):.3f}", f"{sum(r['share'] for r in rest):.1%}",
                              "", "", "", "", "")
            table.add_row("profiled total", f"{fam['profiled_cpu_s']:.3f}", "", "100%", "", "", "", "",
                          f"{fam['floor_cpu_s']:.3f}")
            console.print(table)
            console.print(f"  profiled step {fam['profiled_cpu_s']:.2f} CPU s = {fam['profiled_cpu_s'] / fam['floor_cpu_s']:.2f}x "
                          f"its floor; the {run['real_layers']}-layer step predicted from it (layer nodes x "
                          f"{run['real_layers']}/{run['layers']}): {fam['real_cpu_s']:.2f} CPU s, floor "
                          f"{fam['real_floor_cpu_s']:.2f} s, {fam['real_cpu_s'] / fam['real_floor_cpu_s']:.2f}x")

        steps = Table(title=f"{t} thread(s): the step end to end, interleaved (min / median)")
        for col in ("variant", "CPU s", "wall s", "CPU vs the first"):
            steps.add_column(col, justify="left" if col == "variant" else "right")
        rows = dict(run["steps"])
        base = min(c for _, c in next(iter(rows.values())))
        for dtype, by_threads in (report.get("reference") or {}).items():
            ref = by_threads.get(t)
            if ref:
                rows[f"Transformers {dtype}, dense self-conditioning"] = ref["dense_sc_s"]
                rows[f"Transformers {dtype}, no self-conditioning"] = [ref["no_sc_s"]]
        for name, samples in rows.items():
            cpu = [c for _, c in samples]
            wall = [w for w, _ in samples]
            steps.add_row(name, f"{min(cpu):.2f} / {statistics.median(cpu):.2f}",
                          f"{min(wall):.2f} / {statistics.median(wall):.2f}", f"{min(cpu) / base:.2f}x")
        console.print(steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="a diffusion-gemma GGUF (default: synthetic)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--families", default="auto",
                        help="comma-separated CPU kernel families (avx512-vnni, avx2); auto: every one this CPU runs")
    parser.add_argument("--real-layers", type=int, default=30, help="the depth the step is predicted for")
    parser.add_argument("--quant", default="q8_0", choices=["q8_0", "q4_k_m", "f16"])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sc-top-k", type=int, default=64)
    parser.add_argument("--peak-seconds", type=float, default=1.0)
    parser.add_argument("--no-reference", action="store_true", help="skip the Transformers reference")
    parser.add_argument("--reference-dtype", default="bf16",
                        help="comma-separated Transformers dtypes: bf16 (the issue's comparison), fp32")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--from-json", type=Path, default=None, help="print the tables of a saved --json report")
    args = parser.parse_args(argv)

    if args.from_json is not None:
        try:
            report = json.loads(args.from_json.read_text())
        except (OSError, ValueError) as err:
            print(f"error: cannot read {args.from_json}: {err}", file=sys.stderr)
            return 1
        # JSON object keys are strings: the thread counts back to ints
        report["reference"] = {dtype: {int(t): v for t, v in by_threads.items()}
                               for dtype, by_threads in (report.get("reference") or {}).items()}
        print_report(report)
        return 0

    from dgcli.engine import native

    try:
        try:
            threads_list = [int(t) for t in args.threads.split(",") if t.strip()]
        except ValueError:
            raise DgError(f"--threads takes comma-separated counts, got {args.threads!r}") from None
        if not threads_list or min(threads_list) < 1 or args.reps < 1:
            raise DgError("--threads needs counts >= 1 and --reps >= 1")
        dtypes = [d.strip() for d in args.reference_dtype.split(",") if d.strip()]
        if any(d not in ("bf16", "fp32") for d in dtypes):
            raise DgError(f"--reference-dtype takes bf16 and/or fp32, got {args.reference_dtype!r}")
        available = cpu_families()
        families = available if args.families == "auto" else [f.strip() for f in args.families.split(",") if f.strip()]
        if not families or any(f not in available for f in families):
            raise DgError(f"--families takes some of {', '.join(available) or '(none: this CPU runs no dg kernels)'}, "
                          f"got {args.families!r}")
        if args.real_layers < 1:
            raise DgError("--real-layers needs a count >= 1")
        path = args.gguf or synthetic_model(args.layers, args.quant, args.experts)
        peaks = {"PEAK_INT8": native.peak_gmacs(native.PEAK_INT8, args.peak_seconds),
                 "PEAK_INT8_AVX2": native.peak_gmacs(native.PEAK_INT8_AVX2, args.peak_seconds),
                 "bf16": native.peak_gmacs(native.PEAK_BF16, args.peak_seconds)}
        read_gbs = read_bandwidth_gbs()
        runs = [measure_dg(path, t, args.reps, args.sc_top_k, peaks, families, args.real_layers) for t in threads_list]
        report = dict(model=Path(path).name, canvas=256, sc_top_k=args.sc_top_k, reps=args.reps,
                      cpu_threads=os.cpu_count(), peaks=peaks, read_gbs=read_gbs, runs=runs)
        if not args.no_reference:
            try:
                import torch  # noqa: F401
                import transformers  # noqa: F401
            except ImportError:
                print("(torch/transformers not installed: no reference column)", file=sys.stderr)
            else:
                report["reference"] = {dtype: measure_reference(Path(path), threads_list, args.reps, dtype)
                                       for dtype in dtypes}
    except DgError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
