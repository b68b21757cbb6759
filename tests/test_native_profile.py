"""The measuring tools behind benchmarks/step_profile.py: per-node times through llama.cpp's eval
callback, and this CPU's multiply-add peaks. Torch-free."""

from __future__ import annotations

import numpy as np

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


def test_peaks_are_measured_and_named():
    from dgcli.runtime import native

    for kind in (native.PEAK_INT8, native.PEAK_BF16, native.PEAK_F32):
        rate, name = native.peak_gmacs(kind, 0.05)
        assert rate > 0.1 and name


def test_step_profile_counts_the_work_on_our_tiles(tmp_path, monkeypatch):
    """benchmarks/step_profile.py's groups and multiply-adds for the experts' custom ops: gate+up and
    down apart, K from the quantized row in either layout (Q8_0-like for Q5_0 / Q8_0 experts, Q8_K for
    Q4_K and Q6_K ones), so their G MAC/s are right: every routed (token, expert) pair costs n_out x K.
    And the Q6_K LM head on its tile: n_embd x vocabulary per canvas token."""
    import sys
    from pathlib import Path

    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.profile import NodeProfiler

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from step_profile import group_of, multiply_adds

    # the K-quant tiles are AVX2's: forced, so an AVX-512 CPU (whose automatic choice differs) runs them too
    for variable in ("DG_EXPERT_GEMM", "DG_DENSE_GEMM", "DG_LM_HEAD"):
        monkeypatch.setenv(variable, "avx2")
    # Q4_K gate+up in both layers; down: Q4_K in layer 0, Q6_K in layer 1; a Q6_K LM head
    path = small_q4_k_m_gguf(tmp_path / "q4_k_m.gguf")
    profiler = NodeProfiler()
    try:
        with DiffusionModel(path, n_threads=1, n_ctx=128, eval_callback=profiler.eval_callback) as m:
            m.prefill([2, 105, 40, 41, 42])
            profiler.enabled = True
            m.decode_canvas(np.arange(50, 66))
            profiler.enabled = False
            every = profiler.take()
            nodes = [n for n in every if "experts on our tiles" in group_of(n, m.vocab_size, m.n_embd)]
    finally:
        profiler.close()
    if not nodes:
        import pytest

        pytest.skip("this CPU runs no Q4_K experts on our tiles (it has no AVX2)")
    groups = sorted(group_of(n, m.vocab_size, m.n_embd) for n in nodes)
    assert groups == ["MoE down (experts on our tiles)"] * 2 + ["MoE gate+up (experts on our tiles)"] * 2
    pairs = 16 * 2  # canvas tokens x experts used
    for node in nodes:
        gate_up = group_of(node, m.vocab_size, m.n_embd).startswith("MoE gate+up")
        assert multiply_adds(node, m.n_embd) == pairs * (2 * 256 if gate_up else 256) * 256
    [head] = [n for n in every if group_of(n, m.vocab_size, m.n_embd).startswith("LM head")]
    assert group_of(head, m.vocab_size, m.n_embd) == "LM head (K-quant tile)"
    assert multiply_adds(head, m.n_embd) == 256 * m.vocab_size * 16
