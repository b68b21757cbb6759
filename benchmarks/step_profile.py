#!/usr/bin/env python3
"""One denoising step, op by op, against this CPU's measured peaks, for each CPU kernel family, and the
Transformers reference.

    .venv/bin/python benchmarks/step_profile.py [--gguf PATH | --layers 2 --experts 128 --quant q8_0]
                                                [--families auto] [--threads 1,2] [--reps 3]
                                                [--sc-forms 0,64] [--real-layers 30]
                                                [--no-reference] [--json]

For any diffusion-gemma GGUF (default: the real-width synthetic model of benchmarks/native_costs.py,
vocab 262144, hidden 2816, --layers layers of --experts experts (128, top-8: the real model's ~16 tokens
per expert, where the experts' weight reads dominate), written once and cached), per thread count:

1. the step end to end, self-conditioned on the previous step, in each --sc-forms form: dense (0:
   the reference's computation and dg's default; the previous step's soft embedding in, this step's
   product E^T x p out, both inside the graph) and top-k (k > 0): the one-graph step
   (`DiffusionModel.denoise_step`) on each of dg's CPU kernel families (--families; `auto`: every one
   this CPU runs, so an AVX-512 VNNI CPU measures the AVX2 kernels too: DG_CPU_KERNELS=avx512-vnni |
   avx2, read when a model loads); for the first form also on ggml's kernels alone
   (DG_CPU_KERNELS=ggml), and the forward with the logits copied out and sampled on the host
   (`decode_canvas` + the native sampler, dg's previous path); with torch installed, the
   Transformers reference's steps in the same loop (part 4); interleaved, minimum and median of --reps;
2. per family and form, where the graph step's time goes: every node timed through llama.cpp's
   per-node eval callback (dgcli.runtime.profile), grouped by op and node name: seconds, share of the
   step, multiply-adds, achieved G MAC/s per thread against the family's single-thread int8 peak
   (measured here with register-resident instruction chains, `dg_peak_gmacs`: vpdpbusd zmm for
   avx512-vnni; for avx2 vpdpbusd ymm where its tiles run on AVX-VNNI, else the vpmaddubsw + vpmaddwd
   chain) and the bf16 peak, and the op's floor (its
   multiply-adds at the peak: int8 for quantized weights, bf16 otherwise); the dense product is a row
   of its own; this CPU's single-thread read bandwidth is printed beside it, since with ~16 tokens per
   expert the experts' weights are read at about 16 multiply-adds a byte;
3. the real model's step predicted from that profile: nodes of a layer (names ending in -<layer>)
   scaled to --real-layers (30), the rest (LM head, sampler pass, self-conditioning) as measured;
   the floor the same way;
4. with torch installed, the Transformers reference (DiffusionGemmaForBlockDiffusion in bf16 or fp32
   with the GGUF's shapes and random weights) timed through its own `_denoising_step`, one
   two-step generation per repetition: the first step without self-conditioning, the second with
   the dense self-conditioning it always uses after a canvas's first step. Its dense step is
   compared with dg's dense step, dg's top-k steps are rows of their own.

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

from dgcli.errors import DgError  # noqa: E402

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
    ("CUSTOM", "sc_dense_product"): "dense self-conditioning product E^T x p (repacked int8 GEMM)",
    ("MUL_MAT", "sc_dense_product"): "dense self-conditioning product E^T x p (MUL_MAT)",
    ("MUL_MAT", "sc_topk_product"): "top-k self-conditioning: k rows x p (MUL_MAT)",
    ("OUT_PROD", "sc_topk_product"): "top-k self-conditioning: k rows x p (OUT_PROD)",
    ("GET_ROWS", "sc_rows"): "top-k self-conditioning: gather k rows of E",
    ("CONT", "sc_rows_t"): "top-k self-conditioning: transpose the rows",
}
# the dense projections, by node name: through our repacked GEMM (CUSTOM) or ggml's (MUL_MAT)
DENSE_GROUPS = {"Qcur": "attention projections", "Kcur": "attention projections", "Vcur": "attention projections",
                "attn_output": "attention projections", "ffn_gate": "dense FFN gate", "ffn_up": "dense FFN up",
                "ffn_down": "dense FFN down", "sc_ffn_gate": "self-conditioning MLP", "sc_ffn_up": "self-conditioning MLP",
                "sc_ffn_down": "self-conditioning MLP", "sc_signal": "self-conditioning MLP"}
# the experts on our tiles: the GEMM's own name, or the gate+up product's (which it is)
EXPERT_GEMMS = {"experts_gemm", "ffn_moe_gate_up"}
NAMED_GROUPS[("CUSTOM", "experts_act")] = "activations quantized for the experts' GEMMs"
REPACKED_GEMMS = {"lm_head", "sc_dense_product", *DENSE_GROUPS, *EXPERT_GEMMS}


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
    if node.op == "CUSTOM" and base == "lm_head" and node.shapes[1][0] != n_embd // 32 * 36:  # Q8_K activations
        return "LM head (K-quant tile)"
    if (node.op, base) in NAMED_GROUPS:
        return NAMED_GROUPS[(node.op, base)]
    if node.op in ("MUL_MAT", "CUSTOM") and base in DENSE_GROUPS:
        if node.op == "MUL_MAT":
            return DENSE_GROUPS[base] + " (MUL_MAT)"
        return DENSE_GROUPS[base] + (" (K-quant tile)" if q8_k_activations(node.shapes[1][0]) else " (repacked int8 GEMM)")
    if node.op == "FLASH_ATTN_EXT":
        return "attention (FLASH_ATTN_EXT)"
    if not base or base.startswith(("node_", "leaf_")) or " (" in base:
        return f"{node.op} (unnamed)"
    return f"{node.op} {base}"


def q8_k_activations(row: int) -> int:
    """The bytes per 256 inputs of a quantized activation row of `row` bytes if it is the K-quant tiles'
    Q8_K (292: 256 quants, a scale, 8 float sums; 324 with 16 int16 pair sums), else 0: the repacked
    GEMM's Q8_0 (36 per 32, 288 per 256). A row of whole 288-byte pieces is taken as Q8_0 (at K = 2048
    a Q8_K row with int16 sums would read the same, a width no weight of these models has)."""
    if row % 288 == 0:
        return 0
    return next((size for size in (292, 324) if row % size == 0), 0)


def gemm_width(node, n_embd: int) -> int:
    """K of one of our GEMMs (custom ops): n_embd for the experts' gate+up, else from the quantized
    activations' row (q8_k_activations): K/256 Q8_K blocks, or K/32 blocks of 32 quants and a 4-byte scale."""
    if re.sub(r"-\d+$", "", node.name) == "ffn_moe_gate_up":
        return n_embd
    row = node.shapes[1][0]
    per_256 = q8_k_activations(row)
    return row // per_256 * 256 if per_256 else row // 36 * 32


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


LAYER_NAME = re.compile(r"-\d+$")  # llama.cpp names a layer's nodes name-<layer>


def unnamed(node) -> bool:
    """A node no callback named (ggml's node_<i>, or empty): e.g. the MoE down projection's MUL_MAT_ID,
    whose names go to the per-expert scale's MUL after it."""
    return not node.name or node.name.startswith("node_")


def layer_nodes(nodes: list) -> list[bool]:
    """Whether each node (in graph order) belongs to a layer: named name-<layer>, or unnamed between two
    nodes of the same layer."""
    named = [None if unnamed(n) else LAYER_NAME.search(n.name) for n in nodes]
    layer_of = [m.group() if m else "" for m in named]
    before, after = [""] * len(nodes), [""] * len(nodes)
    last = ""
    for i, n in enumerate(nodes):
        before[i] = last
        if not unnamed(n):
            last = layer_of[i]
    last = ""
    for i in range(len(nodes) - 1, -1, -1):
        after[i] = last
        if not unnamed(nodes[i]):
            last = layer_of[i]
    return [bool(layer_of[i]) if not unnamed(n) else bool(before[i]) and before[i] == after[i]
            for i, n in enumerate(nodes)]


# what each family's int8 work is measured against (dg_peak_gmacs kinds, dgcli.runtime.native)
FAMILY_PEAK = {"avx512-vnni": "PEAK_INT8", "avx2": "PEAK_INT8_AVX2", "ggml": "PEAK_INT8"}
KERNEL_IDS = {1: "avx2", 2: "avx512-vnni"}
COMPONENT_VARIABLES = ("DG_LM_HEAD", "DG_DENSE_GEMM", "DG_EXPERT_GEMM")


def cpu_families() -> list[str]:
    """dg's kernel families this CPU runs, widest first (a VNNI CPU runs the AVX2 kernels too)."""
    from dgcli.runtime import native

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
    from dgcli.runtime.model import DiffusionModel

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


def sc_form_name(k: int) -> str:
    return f"top-{k}" if k else "dense"


def first_self_cond(m, canvas, temperature, rng, k: int) -> dict:
    """The self-conditioning input a canvas's second step gets in form k (top-k ids and
    probabilities, or the dense form's soft embedding), from a first step."""
    if k:
        [first] = m.denoise_step(canvas, temperature, rng.random(canvas.shape), top_k=k)
        return {"sc_topk": (first.topk_ids[None], first.topk_probs[None]), "top_k": k}
    [first] = m.denoise_step(canvas, temperature, rng.random(canvas.shape), next_soft=True)
    return {"sc_soft": first.soft[None], "next_soft": True}


def nearer_floor(candidate: dict, best: dict, by_floor: bool) -> bool:
    """Whether a repetition's group beats the best so far: by its time over its floor where both have
    a floor measured against their own peaks, else by its time."""
    if by_floor and candidate["floor_cpu_s"] and best["floor_cpu_s"]:
        return candidate["cpu_s"] / candidate["floor_cpu_s"] < best["cpu_s"] / best["floor_cpu_s"]
    return candidate["cpu_s"] < best["cpu_s"]


def profile_groups(profiled: list, peaks: dict, n_vocab: int, n_embd: int, layer_scale: float,
                   rep_peaks: list | None = None) -> dict:
    """Node times grouped, with each group's share of a real-depth step: its layer nodes times
    layer_scale. Each group is taken from one repetition: the one nearest its floor, where rep_peaks
    gives the peaks measured next to each repetition (a neighbour's load on a shared core moves the
    peak and the step together), else the one with the least CPU time (the box's load only adds)."""
    groups: dict[str, dict] = {}
    for rep, nodes in enumerate(profiled):
        rep_peak = rep_peaks[rep] if rep_peaks else peaks
        sums: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0, 0.0, 0.0, 0.0])
        for node, layered in zip(nodes, layer_nodes(nodes)):
            g = sums[group_of(node, n_vocab, n_embd)]
            macs = multiply_adds(node, n_embd)
            floor = macs / floor_peak(node, rep_peak) / 1e9 if macs else 0.0
            scale = layer_scale if layered else 1.0
            g[0] += node.cpu_seconds
            g[1] += node.seconds
            g[2] += macs
            g[3] += floor
            g[4] += node.cpu_seconds * scale
            g[5] += floor * scale
        for name, (cpu, wall, macs, floor, real_cpu, real_floor) in sums.items():
            candidate = {"cpu_s": cpu, "wall_s": wall, "multiply_adds": macs, "floor_cpu_s": floor,
                         "real_cpu_s": real_cpu, "real_floor_cpu_s": real_floor, "peaks": rep_peak}
            if name not in groups or nearer_floor(candidate, groups[name], by_floor=rep_peaks is not None):
                groups[name] = candidate
    total = sum(g["cpu_s"] for g in groups.values())
    rows = []
    for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["cpu_s"]):
        rate = g["multiply_adds"] / g["cpu_s"] / 1e9 if g["multiply_adds"] and g["cpu_s"] else 0.0
        rows.append(dict(op=name, cpu_s=g["cpu_s"], wall_s=g["wall_s"], share=g["cpu_s"] / total,
                         gmac=g["multiply_adds"] / 1e9, gmacs_per_thread=rate,
                         of_int8_peak=rate / g["peaks"]["int8"][0], of_bf16_peak=rate / g["peaks"]["bf16"][0],
                         int8_peak=g["peaks"]["int8"][0],
                         floor_cpu_s=g["floor_cpu_s"], real_cpu_s=g["real_cpu_s"],
                         real_floor_cpu_s=g["real_floor_cpu_s"]))
    return dict(profiled_cpu_s=total, ops=rows, step_gmac=sum(r["gmac"] for r in rows),
                floor_cpu_s=sum(r["floor_cpu_s"] for r in rows),
                real_cpu_s=sum(r["real_cpu_s"] for r in rows), real_floor_cpu_s=sum(r["real_floor_cpu_s"] for r in rows))


def adjacent_peaks(family: str, seconds: float) -> dict:
    """The family's int8 peak and the bf16 peak, measured now: {"int8": (G MAC/s, what), "bf16": ...}."""
    from dgcli.runtime import native

    return {"int8": native.peak_gmacs(getattr(native, FAMILY_PEAK[family]), seconds),
            "bf16": native.peak_gmacs(native.PEAK_BF16, seconds)}


def mean_peaks(before: dict, after: dict) -> dict:
    """The peaks a repetition ran beside: the mean of those measured just before and just after it."""
    return {kind: ((before[kind][0] + after[kind][0]) / 2, before[kind][1]) for kind in before}


def measure_dg(path: Path, threads: int, reps: int, sc_forms: list[int], peaks: dict, families: list[str],
               real_layers: int, references: dict | None = None, adjacent_peak_seconds: float = 0.3) -> dict:
    """The step on each family in each self-conditioning form, and on ggml's kernels and the host sampler
    in the first form, interleaved; then each family's step node by node, each repetition between two
    measurements of the peaks its groups are judged against. `references`: {name: callable} timing one
    reference generation each, run inside the loop; each returns {row name: (wall, cpu)}."""
    from dgcli.engine.sampler import make_step_sampler
    from dgcli.runtime import native
    from dgcli.runtime.profile import NodeProfiler

    profiler = NodeProfiler()
    models = {}
    try:
        for family in [*families, "ggml"]:
            models[family] = open_model(path, threads, family, eval_callback=profiler.eval_callback)
        rng = np.random.default_rng(0)
        first_model, old = models[families[0]], models["ggml"]
        C, V, n_embd = first_model.canvas_length, first_model.vocab_size, first_model.n_embd
        n_layer = int(first_model.header.get("diffusion-gemma.block_count"))
        prompt = [int(t) for t in rng.integers(200, 400, PROMPT_TOKENS)]
        for m in models.values():
            m.prefill(prompt)
        canvas = rng.integers(0, V, (1, C))
        temperature = np.float32(0.6)
        # a first step gives what the next ones are conditioned on, in each form
        with family_env(families[0]):
            inputs = {k: first_self_cond(first_model, canvas, temperature, rng, k) for k in sc_forms}
            [values] = first_model.denoise_step(canvas, temperature, rng.random((1, C)), return_values=True)
        lead = sc_forms[0]
        host = make_step_sampler("native", n_threads=threads)

        def graph_step(family, k):
            def step():
                with family_env(family):  # the sampler's pass reads the family at every row
                    models[family].denoise_step(canvas, temperature, rng.random((1, C)), **inputs[k])
            return step

        def host_step():
            sc = inputs[lead]
            if lead:
                logits = old.decode_canvas(canvas[0], sc_topk=(sc["sc_topk"][0][0], sc["sc_topk"][1][0]))
                host.process_logits(logits, temperature, rng.random(C), top_k=lead)
            else:  # the host sampler's dense input: the processed logits, softmax on the host
                logits = old.decode_canvas(canvas[0], sc_logits=values.processed)
                host.process_logits(logits, temperature, rng.random(C))

        lead_name = sc_form_name(lead)
        variants = {f"graph step, {family}, {sc_form_name(k)} self-conditioning": graph_step(family, k)
                    for family in families for k in sc_forms}
        variants |= {f"graph step, ggml, {lead_name} self-conditioning": graph_step("ggml", lead),
                     f"previous: forward + host sampler, {lead_name}, ggml matmuls": host_step}
        times: dict[str, list] = {name: [] for name in variants}
        for _ in range(reps):  # interleaved: the box's load hits every variant alike
            for name, fn in variants.items():
                times[name].append(timed(fn))
            for reference in (references or {}).values():
                for row, sample in reference().items():
                    times.setdefault(row, []).append(sample)

        lib = native.lib()._lib
        runs = {}
        for family in families:
            m = models[family]
            profiled: dict[int, list] = {k: [] for k in sc_forms}
            rep_peaks: dict[int, list] = {k: [] for k in sc_forms}
            for _ in range(reps):
                for k in sc_forms:
                    before = adjacent_peaks(family, adjacent_peak_seconds)
                    profiler.enabled = True
                    graph_step(family, k)()
                    profiler.enabled = False
                    profiled[k].append(profiler.take())
                    rep_peaks[k].append(mean_peaks(before, adjacent_peaks(family, adjacent_peak_seconds)))
            family_peaks = dict(peaks, int8=peaks[FAMILY_PEAK[family]])
            runs[family] = dict(lm_head=lib.dg_lm_head_path(m._model).decode(), self_cond_product=m.self_cond_path(),
                                experts_on_dg=lib.dg_expert_gemm_count(m._model), peak_int8=family_peaks["int8"],
                                rep_peaks_int8={sc_form_name(k): [p["int8"][0] for p in rep_peaks[k]] for k in sc_forms},
                                forms={sc_form_name(k): profile_groups(profiled[k], family_peaks, V, n_embd,
                                                                       real_layers / n_layer, rep_peaks[k])
                                       for k in sc_forms})
    finally:
        for m in models.values():
            m.close()
        profiler.close()
    return dict(threads=threads, canvas=C, steps=times, families=runs, layers=n_layer, real_layers=real_layers)


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
    from dgcli.testing.reference import TINY_VISION

    return DiffusionGemmaConfig(text_config=text, vision_config=dict(TINY_VISION),
                                canvas_length=int(value("diffusion.canvas_length")))


class ReferenceSteps:
    """The Transformers reference in `dtype` (bf16 or fp32) with the GGUF's shapes and random weights,
    loaded once; each call runs one two-step generation on `threads` threads and returns the wall and
    CPU seconds of its `_denoising_step`s: the first step (no self-conditioning) and the second (dense
    self-conditioning, as every later step of a canvas)."""

    def __init__(self, path: Path, dtype: str):
        import torch
        from transformers import DiffusionGemmaForBlockDiffusion

        config = reference_config(path)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        self.dtype = dtype
        self.model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=torch_dtype).eval()
        self.config = config
        self.step_times: list[tuple[float, float]] = []
        real_step = self.model._denoising_step

        def timed_step(*args, **kwargs):
            out = []
            self.step_times.append(timed(lambda: out.append(real_step(*args, **kwargs))))
            return out[0]

        self.model._denoising_step = timed_step
        self.prompt = torch.randint(200, 400, (1, PROMPT_TOKENS))

    def __call__(self, threads: int) -> dict[str, tuple[float, float]]:
        import torch
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        torch.set_num_threads(threads)
        self.step_times.clear()
        with torch.no_grad():
            # confidence 1e-30: the adaptive stop never fires, both steps run
            self.model.generate(self.prompt, max_new_tokens=self.config.canvas_length, max_denoising_steps=2,
                                t_min=0.4, t_max=0.8, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
                                stability_threshold=1, confidence_threshold=1e-30)
        first, dense = self.step_times[:2]
        return {f"Transformers {self.dtype}, dense self-conditioning": dense,
                f"Transformers {self.dtype}, no self-conditioning": first}


# ---- report ------------------------------------------------------------------------------------


def print_profile(console, run: dict, family: str, fam: dict, form: str, prof: dict) -> None:
    """One family's step in one self-conditioning form, op by op, and the real depth predicted from it."""
    from rich.table import Table

    t = run["threads"]
    beside = fam.get("rep_peaks_int8", {}).get(form)
    peak = (f"int8 peak {min(beside):.1f}-{max(beside):.1f} G MAC/s beside the repetitions, each group against "
            f"its own" if beside else f"int8 peak {fam['peak_int8'][0]:.1f} G MAC/s")
    table = Table(title=f"{t} thread(s), {family} kernels ({peak}; LM head "
                        f"{fam['lm_head']}; dense product {fam['self_cond_product']}; {fam['experts_on_dg']} expert "
                        f"tensors on dg's GEMM): one step self-conditioned {form}, {prof['step_gmac']:.0f} G "
                        f"multiply-adds, {prof['floor_cpu_s']:.2f} CPU s at the peaks")
    for col in ("op", "CPU s", "wall s", "share", "G MAC", "G MAC/s/thread", "of int8 peak", "of bf16 peak",
                "floor CPU s"):
        table.add_column(col, justify="left" if col == "op" else "right")
    shown, rest = prof["ops"][:12], prof["ops"][12:]
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
    table.add_row("profiled total", f"{prof['profiled_cpu_s']:.3f}", "", "100%", "", "", "", "",
                  f"{prof['floor_cpu_s']:.3f}")
    console.print(table)

    console.print(f"  profiled step {prof['profiled_cpu_s']:.2f} CPU s = "
                  f"{prof['profiled_cpu_s'] / prof['floor_cpu_s']:.2f}x its floor; the {run['real_layers']}-layer "
                  f"step predicted from it (layer nodes x {run['real_layers']}/{run['layers']}): "
                  f"{prof['real_cpu_s']:.2f} CPU s, floor {prof['real_floor_cpu_s']:.2f} s, "
                  f"{prof['real_cpu_s'] / prof['real_floor_cpu_s']:.2f}x")


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    peaks = report["peaks"]
    forms = ", ".join(sc_form_name(k) for k in report["sc_forms"])
    console.print(f"[bold]{report['model']}[/bold]: canvas {report['canvas']}, prompt {PROMPT_TOKENS}, "
                  f"self-conditioning {forms}, {report['reps']} reps; times in CPU seconds "
                  f"of the process (the wait for a core on a shared machine left out), wall seconds beside")
    console.print(f"single-thread peaks: int8 {peaks['PEAK_INT8'][0]:.1f} G MAC/s ({peaks['PEAK_INT8'][1]}), "
                  f"int8 of the AVX2 kernels {peaks['PEAK_INT8_AVX2'][0]:.1f} G MAC/s, "
                  f"bf16 {peaks['bf16'][0]:.1f} G MAC/s ({peaks['bf16'][1]}); "
                  f"read bandwidth {report['read_gbs']:.1f} GB/s")
    for run in report["runs"]:
        t = run["threads"]
        for family, fam in run["families"].items():
            for form, prof in fam["forms"].items():
                print_profile(console, run, family, fam, form, prof)

        # like against like: each row against dg's graph step (the first family's) of the same
        # self-conditioning form
        lead_family = next(iter(run["families"]))
        steps = Table(title=f"{t} thread(s): the step end to end, interleaved (min / median)")
        for col in ("variant", "CPU s", "wall s", f"vs dg's {lead_family} step of its form (min, median)"):
            steps.add_column(col, justify="left" if col == "variant" else "right")
        rows = run["steps"]
        bases = {sc_form_name(k): rows.get(f"graph step, {lead_family}, {sc_form_name(k)} self-conditioning")
                 for k in report["sc_forms"]}

        def base_of(name: str):
            """dg's step of the self-conditioning form a row ran (rows name it: "top-64", "dense")."""
            for form in bases:
                if form != "dense" and form in name:
                    return bases[form]
            if "dense self-conditioning" in name or ", dense," in name:
                return bases.get("dense")
            return None

        for name, samples in rows.items():
            cpu = [c for _, c in samples]
            wall = [w for w, _ in samples]
            base = base_of(name)
            ratio = ""
            if base:
                base_cpu = [c for _, c in base]
                ratio = (f"{min(cpu) / min(base_cpu):.2f}x, "
                         f"{statistics.median(cpu) / statistics.median(base_cpu):.2f}x")
            steps.add_row(name, f"{min(cpu):.2f} / {statistics.median(cpu):.2f}",
                          f"{min(wall):.2f} / {statistics.median(wall):.2f}", ratio)
        console.print(steps)
        dense = bases.get("dense")
        for form, samples in bases.items():
            if form != "dense" and dense and samples:
                d = [c for _, c in dense]
                k = [c for _, c in samples]
                console.print(f"dg {lead_family} dense / top-k {form}: {min(d) / min(k):.2f}x (min), "
                              f"{statistics.median(d) / statistics.median(k):.2f}x (median), CPU s")


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
    parser.add_argument("--sc-forms", default="0,64",
                        help="comma-separated self-conditioning forms: 0 dense (the reference's), k top-k")
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
        print_report(report)
        return 0

    from dgcli.runtime import native

    try:
        try:
            threads_list = [int(t) for t in args.threads.split(",") if t.strip()]
            sc_forms = [int(k) for k in args.sc_forms.split(",") if k.strip()]
        except ValueError:
            raise DgError(f"--threads and --sc-forms take comma-separated integers, got {args.threads!r}, "
                          f"{args.sc_forms!r}") from None
        if not threads_list or min(threads_list) < 1 or args.reps < 1:
            raise DgError("--threads needs counts >= 1 and --reps >= 1")
        if not sc_forms or min(sc_forms) < 0 or len(set(sc_forms)) != len(sc_forms):
            raise DgError("--sc-forms needs distinct widths >= 0 (0: dense)")
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
        references = {}
        if not args.no_reference:
            try:
                import torch  # noqa: F401
                import transformers  # noqa: F401
            except ImportError:
                print("(torch/transformers not installed: no reference rows)", file=sys.stderr)
            else:
                references = {dtype: ReferenceSteps(Path(path), dtype) for dtype in dtypes}
        runs = [measure_dg(path, t, args.reps, sc_forms, peaks, families, args.real_layers,
                           {d: (lambda r=r, t=t: r(t)) for d, r in references.items()}) for t in threads_list]
        report = dict(model=Path(path).name, canvas=runs[0]["canvas"], sc_forms=sc_forms, reps=args.reps,
                      cpu_threads=os.cpu_count(), peaks=peaks, read_gbs=read_gbs, runs=runs)
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
