"""The one-graph denoising step (DiffusionModel.denoise_step), torch-free (dg's matmul kernels:
test_native_gemm.py).

The step runs the decoder forward and, where the logits are, the sampler's per-position pass
(softcap, / temperature, softmax entropy, argmax, inverse-CDF sample, the next step's top-k); only
per-position results leave the graph. It must give what the same forward's logits give through the
host samplers (the native one bit for bit in exact mode, numpy up to float rounding), for several
canvases in one forward as for one, and its ggml-ops form (what non-CPU backends run) must agree.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from dgcli.errors import DgError, InvalidParameter
from native_helpers import requires_native, small_gguf

pytestmark = requires_native

PROMPT = [2, 105, 40, 41, 42, 43, 44, 45, 46, 47, 48, 106, 107, 105, 60, 61]


@pytest.fixture(scope="module")
def exact_model(tiny_gguf):
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(tiny_gguf, n_threads=2, exact=True, n_ctx=256, n_seq_max=2) as m:
        m.prefill(PROMPT)
        yield m


def _canvas(seed: int, vocab: int, length: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, length)


def _host_sampler():
    from dgcli.engine.sampler import make_step_sampler

    return make_step_sampler("native", n_threads=2)


def _same_stats(got, want, exact: bool = True) -> None:
    assert got.argmax.tolist() == want.argmax.tolist()
    assert got.sampled.tolist() == want.sampled.tolist()
    # the graph hands entropies back as float32: the acceptance rule's precision
    np.testing.assert_allclose(got.entropy, want.entropy, rtol=1e-6 if exact else 1e-4, atol=1e-7)
    if want.topk_ids is not None:
        assert got.topk_ids.tolist() == want.topk_ids.tolist()
        np.testing.assert_allclose(got.topk_probs, want.topk_probs, rtol=1e-6 if exact else 1e-4, atol=1e-9)
        np.testing.assert_allclose(got.dropped_mass, want.dropped_mass, atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 1, 8])
def test_graph_step_equals_the_forward_then_the_native_sampler(exact_model, top_k):
    m = exact_model
    canvas = _canvas(1, m.vocab_size)
    t = np.float32(0.6)
    u = np.random.default_rng(2).random(len(canvas))
    host = _host_sampler().process_logits(m.decode_canvas(canvas), t, u, top_k=top_k)
    [step] = m.denoise_step(canvas[None], t, u[None], top_k=top_k, return_values=True)
    # exact mode: softcap with libm's tanh and the division by t are bit-identical to the ggml ops +
    # host pass, so every decision is the same
    assert np.array_equal(step.processed, host.processed)
    _same_stats(step, host)


def test_graph_step_agrees_with_the_numpy_reference(exact_model):
    from dgcli.engine.sampler import NumpyStepSampler

    m = exact_model
    canvas = _canvas(3, m.vocab_size)
    t = np.float32(0.45)
    u = np.random.default_rng(4).random(len(canvas))
    reference = NumpyStepSampler().process_logits(m.decode_canvas(canvas), t, u, top_k=5)
    [step] = m.denoise_step(canvas[None], t, u[None], top_k=5)
    assert step.processed is None  # not asked for: no [C, V] array leaves the graph
    assert step.argmax.tolist() == reference.argmax.tolist()
    assert step.sampled.tolist() == reference.sampled.tolist()
    np.testing.assert_allclose(step.entropy, reference.entropy, rtol=1e-5, atol=1e-7)
    for r in range(len(canvas)):
        assert set(step.topk_ids[r].tolist()) == set(reference.topk_ids[r].tolist())


@pytest.mark.parametrize("form", ["dense", "topk"])
def test_graph_step_with_self_conditioning_input(exact_model, form):
    m = exact_model
    canvas = _canvas(5, m.vocab_size)
    rng = np.random.default_rng(6)
    previous = (rng.standard_normal((len(canvas), m.vocab_size)) * 4).astype(np.float32)
    prev_stats = _host_sampler().process_logits(previous.copy(), np.float32(0.7), rng.random(len(canvas)), top_k=6)
    sc = ({"sc_logits": prev_stats.processed} if form == "dense"
          else {"sc_topk": (prev_stats.topk_ids, prev_stats.topk_probs)})
    t, u = np.float32(0.55), rng.random(len(canvas))
    host = _host_sampler().process_logits(m.decode_canvas(canvas, **sc), t, u, top_k=4)
    batched = {k: (tuple(a[None] for a in v) if k == "sc_topk" else v[None]) for k, v in sc.items()}
    [step] = m.denoise_step(canvas[None], t, u[None], top_k=4, **batched)
    _same_stats(step, host)


def test_several_canvases_in_one_forward_equal_one_at_a_time(exact_model):
    """Two canvases of two requests (own temperature, own self-conditioning) in one forward."""
    m = exact_model
    a, b = _canvas(7, m.vocab_size), _canvas(8, m.vocab_size)
    rng = np.random.default_rng(9)
    ids = rng.integers(0, m.vocab_size, (2, 16, 3)).astype(np.int32)
    probs = rng.dirichlet(np.ones(3), (2, 16)).astype(np.float32)
    temps = np.array([0.8, 0.5], np.float32)
    u = rng.random((2, 16))
    both = m.denoise_step(np.stack([a, b]), temps, u, sc_topk=(ids, probs), top_k=4)
    one_a = m.denoise_step(a[None], temps[0], u[:1], sc_topk=(ids[:1], probs[:1]), top_k=4)[0]
    one_b = m.denoise_step(b[None], temps[1], u[1:], sc_topk=(ids[1:], probs[1:]), top_k=4)[0]
    # one forward of 32 rows against two of 16: float summation may differ in the last bits
    _same_stats(both[0], one_a, exact=False)
    _same_stats(both[1], one_b, exact=False)
    assert both[0].argmax.tolist() != both[1].argmax.tolist()


def _sample_margin(values_row: np.ndarray, u: float, picked: int) -> float:
    """How far u is from the CDF edges of the picked token (float64 softmax of the row)."""
    w = np.exp(values_row.astype(np.float64) - values_row.max())
    cdf = np.cumsum(w) / w.sum()
    lower = cdf[picked - 1] if picked > 0 else 0.0
    return min(cdf[picked] - u, u - lower)


def test_portable_ggml_ops_step_agrees_with_the_step_op(exact_model):
    """The step as ggml ops (F32 softmax, cumulative sum and comparison) is what non-CPU backends
    run; forced here on the CPU. Same decisions except a sample within float rounding of a CDF edge."""
    m = exact_model
    canvas = _canvas(10, m.vocab_size)
    t = np.float32(0.6)
    u = np.random.default_rng(11).random(len(canvas))
    [fused] = m.denoise_step(canvas[None], t, u[None], top_k=6, return_values=True)
    [ops] = m.denoise_step(canvas[None], t, u[None], top_k=6, return_values=True, portable_ops=True)
    np.testing.assert_allclose(ops.processed, fused.processed, rtol=1e-6, atol=1e-5)
    assert ops.argmax.tolist() == fused.argmax.tolist()
    np.testing.assert_allclose(ops.entropy, fused.entropy, rtol=1e-4, atol=1e-5)
    assert ops.topk_ids.tolist() == fused.topk_ids.tolist()
    np.testing.assert_allclose(ops.topk_probs, fused.topk_probs, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(ops.dropped_mass, fused.dropped_mass, atol=1e-5)
    for r, (a, b) in enumerate(zip(ops.sampled, fused.sampled)):
        if a != b:
            assert _sample_margin(fused.processed[r], u[r], int(b)) < 1e-5, r


def test_argmax_ties_go_to_the_lowest_id_on_the_cpu(tmp_path):
    """Two tokens with the same output row tie exactly. dg's argmax (the token a canvas commits) takes
    the lower id, as the reference's torch.argmax: the step op, both host samplers, and the ggml-ops
    form a GPU runs, where ggml's argmax has no such rule (its CPU kernel keeps the last maximum,
    CUDA's and Metal's one by thread order) and the tie is broken among the step's top k."""
    from dgcli.engine.sampler import make_step_sampler
    from dgcli.runtime.model import DiffusionModel
    from dgcli.testing.tiny import write_tiny_random_gguf
    from native_helpers import rewrite_gguf

    twins = [300, 301]

    def tie(name, data):
        if name == "token_embd.weight":  # tied: the LM head's rows
            data = data.copy()
            data[twins] = 40 * data[310]
        return data

    path = rewrite_gguf(write_tiny_random_gguf(tmp_path / "t.gguf", seed=0), tmp_path / "tied.gguf", tensor_edit=tie)
    with DiffusionModel(path, n_threads=1, n_ctx=128) as m:
        m.prefill(PROMPT)
        canvas = _canvas(20, m.vocab_size)
        u = np.random.default_rng(21).random(len(canvas))
        [op] = m.denoise_step(canvas[None], 1.0, u[None], top_k=4, return_values=True)
        [ops] = m.denoise_step(canvas[None], 1.0, u[None], top_k=4, return_values=True, portable_ops=True)
        logits = m.decode_canvas(canvas)
    hosts = [make_step_sampler(kind, n_threads=1).process_logits(logits.copy(), np.float32(1.0), u)
             for kind in ("native", "numpy")]
    for stats in (op, ops):
        assert np.array_equal(stats.processed[:, twins[0]], stats.processed[:, twins[1]])
    tied = [r for r in range(len(canvas)) if op.processed[r, twins[0]] == op.processed[r].max()]
    assert len(tied) >= 3
    got = {name: stats.argmax[tied].tolist() for name, stats in zip(("op", "ops", "native", "numpy"), (op, ops, *hosts))}
    assert got == {name: [twins[0]] * len(tied) for name in got}


def test_fast_mode_softcap_is_within_rounding_of_libm(tiny_gguf):
    """Outside exact mode the softcap's tanh is vectorised (~2 ulp): the values stay within float
    rounding of the ggml ops path, and the decisions are the same."""
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(tiny_gguf, n_threads=2, n_ctx=128) as m:
        m.prefill(PROMPT)
        canvas = _canvas(12, m.vocab_size)
        t = np.float32(0.5)
        u = np.random.default_rng(13).random(len(canvas))
        host = _host_sampler().process_logits(m.decode_canvas(canvas), t, u)
        [step] = m.denoise_step(canvas[None], t, u[None], return_values=True)
    assert float(np.max(np.abs(step.processed - host.processed))) < 1e-4
    assert step.argmax.tolist() == host.argmax.tolist()
    np.testing.assert_allclose(step.entropy, host.entropy, rtol=1e-4, atol=1e-6)


def test_graph_step_leaves_the_cache_unchanged_and_graphs_are_rebuilt_per_form(exact_model):
    m = exact_model
    canvas = _canvas(14, m.vocab_size)
    before = m.decode_canvas(canvas)
    n_past = m.n_past
    u = np.random.default_rng(15).random((1, 16))
    results = [m.denoise_step(canvas[None], 0.6, u, top_k=k, return_values=values)[0]
               for k, values in ((4, False), (8, True), (0, False), (4, False))]
    assert m.n_past == n_past
    assert np.array_equal(m.decode_canvas(canvas), before)
    # the same request after other forms gives the same answer (no stale graph reused)
    _same_stats(results[3], results[0])
    assert results[1].topk_ids.shape == (16, 8) and results[2].topk_ids is None


def test_graph_step_checks_its_inputs(exact_model):
    m = exact_model
    canvas = _canvas(16, m.vocab_size)[None]
    u = np.full((1, 16), 0.5)
    with pytest.raises(InvalidParameter, match="temperatures"):
        m.denoise_step(canvas, 0.0, u)
    with pytest.raises(InvalidParameter, match="temperatures"):
        m.denoise_step(canvas, np.nan, u)
    with pytest.raises(InvalidParameter, match="temperatures"):
        m.denoise_step(canvas, [0.5, 0.6], u)
    with pytest.raises(InvalidParameter, match="uniforms"):
        m.denoise_step(canvas, 0.5, np.ones((1, 16)))
    with pytest.raises(InvalidParameter, match="uniforms"):
        m.denoise_step(canvas, 0.5, u[:, :8])
    with pytest.raises(InvalidParameter, match="top_k"):
        m.denoise_step(canvas, 0.5, u, top_k=m.vocab_size + 1)
    with pytest.raises(InvalidParameter, match="canvases"):
        m.denoise_step(np.zeros((3, 16), np.int64), 0.5, np.zeros((3, 16)))
    with pytest.raises(InvalidParameter):
        m.denoise_step(np.full((1, 16), m.vocab_size), 0.5, u)
    with pytest.raises(DgError, match="one self-conditioning input"):
        m.denoise_step(canvas, 0.5, u, sc_logits=np.zeros((1, 16, m.vocab_size), np.float32),
                       sc_topk=(np.zeros((1, 16, 2), np.int32), np.zeros((1, 16, 2), np.float32)))


@pytest.fixture(scope="module")
def wide_vocab_gguf(tmp_path_factory):
    """Small widths, a 65536-token vocabulary: a [16, V] logits array is 4 MiB."""
    return small_gguf(tmp_path_factory.mktemp("wide") / "wide.gguf", vocab_size=65536)


def test_graph_step_moves_no_logits_to_the_host(wide_vocab_gguf):
    """Without return_values the step allocates nothing of the logits' size on the host (the
    forward-then-sample path copies all of them out: the check sees that)."""
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(wide_vocab_gguf, n_threads=2, n_ctx=128) as m:
        m.prefill(PROMPT)
        canvas = _canvas(17, m.vocab_size)
        logits_bytes = len(canvas) * m.vocab_size * 4
        u = np.random.default_rng(18).random((1, 16))
        m.denoise_step(canvas[None], 0.6, u, top_k=64)  # warm-up: graph build and allocation

        def peak_of(fn) -> int:
            tracemalloc.start()
            try:
                fn()
                return tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()

        step_peak = peak_of(lambda: m.denoise_step(canvas[None], 0.6, u, top_k=64))
        forward_peak = peak_of(lambda: m.decode_canvas(canvas))
    assert forward_peak >= logits_bytes
    assert step_peak < logits_bytes // 16


# ---- the engine on the graph step ----------------------------------------------------------------


@pytest.mark.parametrize("top_k", [None, 8])
@pytest.mark.slow
def test_engine_on_the_graph_step_generates_what_the_host_sampler_does(tiny_gguf, top_k):
    """`dg generate`'s loop: the graph step (the default where the model has one) and the forward +
    host native sampler give the same generation, step by step.

    Top-k self-conditioning: both paths form the next step's input from the same top-k, so every step is
    equal. Dense: the graph step forms the next soft embedding from its own probabilities (its exp, within
    2 ulp of numpy's; its sum in another order), the host path from numpy's softmax of the processed
    logits, ~1e-6 of the entropy apart at the first self-conditioned step. This random model feeds that
    back and amplifies it 3-10x a step (measured on an AVX2 EPYC: 1.2e-6, 1.5e-6, 1.3e-5, ... 4.8e-2 by
    the eighth step, where a sampled token flipped), so the dense run stops each canvas after 3 steps,
    where the two stayed within 7.8e-6 there: equal tokens then do not depend on how a machine rounds."""
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.params import DiffusionParams
    from dgcli.runtime.model import DiffusionModel

    params = DiffusionParams(max_denoising_steps=8 if top_k else 3)
    runs = {}
    with DiffusionModel(tiny_gguf, n_threads=2, exact=True, n_ctx=256) as m:
        for backend in ("auto", "native"):
            engine = DiffusionEngine(m, sampler=backend, self_cond_top_k=top_k)
            events = []
            result = engine.generate(PROMPT, params=params, max_new_tokens=32, seed=3,
                                     on_event=lambda e: events.append(e) if e.kind == "step" else None)
            runs[engine.step_backend] = (result, events)
    (graph, graph_steps), (host, host_steps) = runs["graph"], runs["native"]
    assert graph.token_ids == host.token_ids
    assert graph.steps_per_canvas == host.steps_per_canvas
    graph_entropy, host_entropy = [e.mean_entropy for e in graph_steps], [e.mean_entropy for e in host_steps]
    if top_k:
        assert graph_entropy == host_entropy
    else:
        np.testing.assert_allclose(graph_entropy, host_entropy, rtol=1e-4)
    assert [e.accepted_mask.tolist() for e in graph_steps] == [e.accepted_mask.tolist() for e in host_steps]


def test_engine_backend_choice(tiny_gguf):
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(tiny_gguf, n_threads=1, n_ctx=128) as m:
        assert DiffusionEngine(m).step_backend == "graph"
        assert DiffusionEngine(m, sampler="graph").step_backend == "graph"
        assert DiffusionEngine(m, sampler="numpy").step_backend == "numpy"
        with pytest.raises(DgError, match="invalid sampler backend 'gpu'"):
            DiffusionEngine(m, sampler="gpu")
