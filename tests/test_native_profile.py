"""The measuring tools behind benchmarks/step_profile.py: per-node times through llama.cpp's eval
callback, and this CPU's multiply-add peaks. Torch-free."""

from __future__ import annotations

import numpy as np

from native_helpers import requires_native

pytestmark = requires_native


def test_profiler_times_every_node_only_while_enabled(tiny_gguf):
    from dgcli.engine.model import DiffusionModel
    from dgcli.engine.profile import NodeProfiler

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
    from dgcli.engine import native

    for kind in (native.PEAK_INT8, native.PEAK_BF16, native.PEAK_F32):
        rate, name = native.peak_gmacs(kind, 0.05)
        assert rate > 0.1 and name
