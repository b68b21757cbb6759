"""The measuring tools behind benchmarks/step_profile.py: per-node times through llama.cpp's eval
callback, and this CPU's multiply-add peaks. Torch-free."""

from __future__ import annotations

import numpy as np
import pytest

from native_helpers import requires_native, small_q4_k_m_gguf

pytestmark = requires_native


def test_profiler_times_every_node_only_while_enabled(tiny_gguf):
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.profile import NodeProfiler

    profiler = NodeProfiler()
    with DiffusionModel(tiny_gguf, n_threads=1, n_ctx=128, eval_callback=profiler.eval_callback) as m:
        m.prefill([2, 105, 40, 41, 42])
        canvas = np.arange(50, 66)
        plain = m.decode_canvas(canvas)
        assert profiler.take() == []  # disabled: the graph ran uninterrupted, nothing recorded
        profiler.enabled = True
        profiled = m.decode_canvas(canvas)
        profiler.enabled = False
        nodes = profiler.take()
    profiler.close()
    # one node at a time computes the same logits
    assert np.array_equal(plain, profiled)
    assert len(nodes) > 50 and all(n.seconds >= 0 and n.cpu_seconds >= 0 for n in nodes)
    ops = {n.op for n in nodes}
    assert {"MUL_MAT", "MUL_MAT_ID", "RMS_NORM", "TANH"} <= ops
    lm_head = [n for n in nodes if n.op == "MUL_MAT" and n.shapes[1][1] == m.vocab_size]
    assert len(lm_head) == 1
    # n_embd x vocab x canvas multiply-adds
    assert lm_head[0].multiply_adds() == 64 * m.vocab_size * 16
    assert lm_head[0].src0_type == "f32"


def test_peaks_are_measured_and_named(monkeypatch):
    from dgcli.runtime import native

    for kind in (native.PEAK_INT8, native.PEAK_BF16, native.PEAK_F32, native.PEAK_INT8_AVX2):
        rate, name = native.peak_gmacs(kind, 0.05)
        assert rate > 0.1 and name
    # the AVX2 kernels' chain, whatever wider instructions the CPU has (the family switch's peak): AVX-VNNI's
    # where their tiles run on it, else vpmaddubsw's
    lib = native.lib()._lib
    _, name = native.peak_gmacs(native.PEAK_INT8_AVX2, 0.05)
    assert name in (("int8 AVX-VNNI (vpdpbusd ymm)",) if lib.dg_avx_vnni_in_use() else
                    ("int8 AVX2 (vpmaddubsw + vpmaddwd)", "fp32 scalar"))
    monkeypatch.setenv("DG_AVX_VNNI", "0")
    assert not lib.dg_avx_vnni_in_use()
    _, name = native.peak_gmacs(native.PEAK_INT8_AVX2, 0.05)
    assert name in ("int8 AVX2 (vpmaddubsw + vpmaddwd)", "fp32 scalar")


def _step_profile():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import step_profile

    return step_profile


def test_step_profile_counts_the_repacked_experts_and_the_k_quant_head(tmp_path, monkeypatch):
    """benchmarks/step_profile.py's groups and multiply-adds on the AVX2 family (DG_CPU_KERNELS=avx2, which
    every x86 CPU with AVX2 runs): the experts, repacked while loading, are MUL_MAT_ID nodes, gate+up and
    down apart, each routed (token, expert) pair costing n_out x K; the Q6_K LM head on its tile costs
    n_embd x vocabulary per canvas token."""

    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.profile import NodeProfiler

    if not native.lib()._lib.dg_expert_buffer_type(1):
        pytest.skip("this CPU lacks AVX2: no dg kernel family")
    group_of, multiply_adds = _step_profile().group_of, _step_profile().multiply_adds
    for name in ("DG_LM_HEAD", "DG_DENSE_GEMM", "DG_EXPERT_GEMM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DG_CPU_KERNELS", "avx2")
    # Q4_K gate+up in both layers; down: Q4_K in layer 0, Q6_K in layer 1; a Q6_K LM head
    path = small_q4_k_m_gguf(tmp_path / "q4_k_m.gguf")
    profiler = NodeProfiler()
    try:
        with DiffusionModel(path, n_threads=1, n_ctx=128, eval_callback=profiler.eval_callback) as m:
            assert native.lib()._lib.dg_expert_gemm_count(m._model) == 4
            m.prefill([2, 105, 40, 41, 42])
            profiler.enabled = True
            m.decode_canvas(np.arange(50, 66))
            profiler.enabled = False
            every = profiler.take()
    finally:
        profiler.close()
    nodes = [n for n in every if n.op == "MUL_MAT_ID"]
    groups = sorted(group_of(n, m.vocab_size, m.n_embd) for n in nodes)
    assert groups == ["MoE down (MUL_MAT_ID)"] * 2 + ["MoE gate+up (MUL_MAT_ID)"] * 2
    pairs = 16 * 2  # canvas tokens x experts used
    for node in nodes:
        gate_up = group_of(node, m.vocab_size, m.n_embd).startswith("MoE gate+up")
        assert multiply_adds(node, m.n_embd) == pairs * (2 * 256 if gate_up else 256) * 256
    [head] = [n for n in every if group_of(n, m.vocab_size, m.n_embd).startswith("LM head")]
    assert group_of(head, m.vocab_size, m.n_embd) == "LM head (K-quant tile)"
    assert multiply_adds(head, m.n_embd) == 256 * m.vocab_size * 16


def test_step_profile_predicts_the_real_depth_from_the_layer_nodes():
    """The real model's step from a shallow file's profile: a layer's nodes (named name-<layer>, or
    unnamed between two nodes of one layer, as the MoE down projection's MUL_MAT_ID) scaled by real /
    profiled layers, the others (LM head, the sampler's op, an unnamed node between layers) once; the
    floor the same way."""
    from dgcli.runtime.profile import NodeTime

    sp = _step_profile()
    zero = ((0, 0, 0, 0),) * 4
    q8 = ((100, 4, 1, 1), (32, 100, 1, 1), (32, 4, 1, 1), (0, 0, 0, 0))  # 32 x 100 x 4 multiply-adds
    nodes = [NodeTime("ffn_moe_geglu-0", "GEGLU", "f32", zero, 0.25, 0.25),
             NodeTime("node_17", "MUL_MAT_ID", "f32", zero, 0.125, 0.125),
             NodeTime("ffn_moe_down-0", "ADD", "f32", zero, 1.0, 1.0),
             NodeTime("node_30", "ADD", "f32", zero, 8.0, 8.0),  # between layer 0 and layer 1
             NodeTime("ffn_moe_down-1", "ADD", "f32", zero, 2.0, 2.0),
             NodeTime("result_output", "MUL_MAT", "q8_0", q8, 4.0, 4.0),
             NodeTime("dg_step", "CUSTOM", "f32", zero, 0.5, 0.5)]
    assert sp.layer_nodes(nodes) == [True, True, True, False, True, False, False]
    peaks = {"int8": (6400.0, "x"), "bf16": (1.0, "y")}
    report = sp.profile_groups([nodes], peaks, n_vocab=100, n_embd=32, layer_scale=30 / 2)
    assert report["profiled_cpu_s"] == 15.875
    assert report["real_cpu_s"] == (0.25 + 0.125 + 1.0 + 2.0) * 15 + 8.0 + 4.0 + 0.5
    assert report["floor_cpu_s"] == report["real_floor_cpu_s"] == 32 * 100 * 4 / 6400 / 1e9


def test_step_profile_judges_each_repetition_against_the_peaks_beside_it():
    """With the peaks measured next to each repetition, a group is taken from the repetition nearest its
    floor at that repetition's peak (a neighbour on the core slows both), not from the fastest one, and
    its share of the peak is against that repetition's peak; without them, from the fastest."""
    from dgcli.runtime.profile import NodeTime

    sp = _step_profile()
    q8 = ((1000, 100, 1, 1), (32, 1000, 1, 1), (32, 100, 1, 1), (0, 0, 0, 0))  # 32 x 1000 x 100 multiply-adds
    macs = 32 * 1000 * 100

    def rep(seconds: float) -> list:
        return [NodeTime("result_output", "MUL_MAT", "q8_0", q8, seconds, seconds)]

    quiet, loaded = {"int8": (400.0, "x"), "bf16": (1.0, "y")}, {"int8": (100.0, "x"), "bf16": (1.0, "y")}
    # the second repetition ran slower beside a peak a quarter as high: nearer its floor
    report = sp.profile_groups([rep(1e-5), rep(2e-5)], quiet, n_vocab=1000, n_embd=32, layer_scale=1.0,
                               rep_peaks=[quiet, loaded])
    [head] = report["ops"]
    assert head["cpu_s"] == 2e-5 and head["int8_peak"] == 100.0
    assert head["of_int8_peak"] == pytest.approx(macs / 2e-5 / 1e9 / 100.0)
    assert report["floor_cpu_s"] == pytest.approx(macs / 100.0 / 1e9)
    [fastest] = sp.profile_groups([rep(1e-5), rep(2e-5)], quiet, n_vocab=1000, n_embd=32, layer_scale=1.0)["ops"]
    assert fastest["cpu_s"] == 1e-5 and fastest["int8_peak"] == 400.0


def test_step_profile_tells_the_dense_gemms_apart_by_their_activations():
    """A dense product's custom op is the repacked int8 GEMM (Q8_0 activations, 36 bytes per 32 inputs:
    288 per 256, or a width that is not whole 256s, as the dense FFN's 2112) or a K-quant tile (Q8_K: 292,
    or 324 with the Q6_K tile's int16 sums, a multiple of 36 too), and its multiply-adds count K as that
    format gives it."""
    from dgcli.runtime.profile import NodeTime

    sp = _step_profile()

    def gemm(act_bytes: int) -> NodeTime:
        return NodeTime("Vcur-3", "CUSTOM", "i8", ((512, 256, 1, 1), (act_bytes, 256, 1, 1)) + ((0, 0, 0, 0),) * 2,
                        1.0, 1.0)

    n_super = 2816 // 256
    assert sp.group_of(gemm(288 * n_super), 1000, 2816) == "attention projections (repacked int8 GEMM)"
    assert sp.group_of(gemm(292 * n_super), 1000, 2816) == "attention projections (K-quant tile)"
    assert sp.group_of(gemm(324 * n_super), 1000, 2816) == "attention projections (K-quant tile)"
    assert sp.gemm_width(gemm(324 * n_super), 2816) == sp.gemm_width(gemm(292 * n_super), 2816) == 2816
    assert sp.gemm_width(gemm(288 * n_super), 2816) == 2816
    ffn_down = gemm(36 * 2112 // 32)  # Q5_0 / Q8_0 rows of the dense FFN's width
    assert sp.group_of(ffn_down, 1000, 2816) == "attention projections (repacked int8 GEMM)"
    assert sp.gemm_width(ffn_down, 2816) == 2112
