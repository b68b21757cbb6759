"""Self-conditioning in the graph: the reference's dense soft embedding as ONE product (the whole
distribution times a transposed copy of E), the top-k form, and the soft embedding a dense step hands
the next one; torch-free (the Transformers parity at real widths is in test_self_cond_real_width.py).

Two small files: the dg-tiny vocabulary (500 tokens, not whole 32-token blocks: an F32 copy of E^T)
and a 512-token one (a Q8_0 copy outside exact mode, repacked for the LM head's GEMM on AVX2 and
AVX-512 VNNI CPUs, ggml's MUL_MAT elsewhere).
"""

from __future__ import annotations

import numpy as np
import pytest

from dgcli.errors import DgError, InvalidParameter
from native_helpers import requires_native, small_gguf

pytestmark = requires_native

PROMPT = [2, 105, 40, 41, 42, 43, 44, 45, 46, 47, 48, 106, 107, 105, 60, 61]


@pytest.fixture(scope="module")
def blocks_gguf(tmp_path_factory):
    """Small widths, a 512-token vocabulary: whole Q8_0 blocks along E^T's rows."""
    return small_gguf(tmp_path_factory.mktemp("blocks") / "v512.gguf", vocab_size=512)


def _path(request, name: str):
    return request.getfixturevalue(name)


def _embeddings(path) -> np.ndarray:
    """token_embd of an F32 file as float64 [V, n_embd]."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    n_embd, vocab = (int(d) for d in t.shape)
    return np.asarray(t.data, dtype=np.float64).reshape(vocab, n_embd)


def _soft_reference(values: np.ndarray, embd: np.ndarray) -> np.ndarray:
    """The reference's soft embedding, in float64: softmax(values) @ E * sqrt(n_embd)."""
    v = values.astype(np.float64)
    p = np.exp(v - v.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return p @ embd * np.sqrt(embd.shape[1])


def _step_inputs(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (1, 16)), np.float32(0.7), rng.random((1, 16))


# ---- the dense product ----------------------------------------------------------------------------


@pytest.mark.parametrize("gguf_name, exact, tol", [
    ("tiny_gguf", True, 1e-5),      # F32 copy (500 tokens): float32 rounding only
    ("blocks_gguf", True, 1e-5),    # exact mode: F32 whatever the vocabulary
    ("blocks_gguf", False, 2e-2),   # Q8_0 copy and Q8_0 probabilities: ~1/254 per block, averaged
])
def test_dense_step_hands_back_the_reference_soft_embedding(request, gguf_name, exact, tol):
    """denoise_step(next_soft=True) forms softmax(this step's values) @ E * sqrt(n_embd) inside its
    graph: against float64 over the same values and the file's E."""
    from dgcli.runtime.model import DiffusionModel

    path = _path(request, gguf_name)
    with DiffusionModel(path, n_threads=2, exact=exact, n_ctx=256) as m:
        m.prefill(PROMPT)
        canvas, t, u = _step_inputs(m.vocab_size, 1)
        [with_values] = m.denoise_step(canvas, t, u, return_values=True)
        [with_soft] = m.denoise_step(canvas, t, u, next_soft=True)
        weights = m.vocab_size * m.n_embd
        if exact or m.vocab_size % 32:
            assert m.self_cond_bytes() == 4 * weights  # F32
        else:  # Q8_0: 34 bytes per 32 weights, 36 as the LM head GEMM's repack
            assert m.self_cond_bytes() == weights * (34 if m.self_cond_path() == "ggml" else 36) // 32
    assert with_soft.processed is None and with_values.soft is None
    assert with_soft.argmax.tolist() == with_values.argmax.tolist()
    want = _soft_reference(with_values.processed, _embeddings(path))
    err = np.linalg.norm(with_soft.soft - want, axis=1) / np.linalg.norm(want, axis=1)
    print(f"{gguf_name} exact={exact}: relative error of the soft embedding max {err.max():.2e}")
    assert err.max() < tol


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_the_soft_embedding_conditions_the_next_step_as_the_dense_logits_do(blocks_gguf, exact):
    """The three ways into the graph of the same dense input agree: the step's soft embedding
    (sc_soft), the processed logits (sc_logits, softmax on the host) and the probabilities (sc_probs)."""
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.self_cond import dense_self_cond_probs

    with DiffusionModel(blocks_gguf, n_threads=2, exact=exact, n_ctx=256) as m:
        m.prefill(PROMPT)
        canvas, t, u = _step_inputs(m.vocab_size, 2)
        [prev_values] = m.denoise_step(canvas, t, u, return_values=True)
        [prev_soft] = m.denoise_step(canvas, t, u, next_soft=True)
        nxt = _step_inputs(m.vocab_size, 3)[0][0]
        by_logits = m.decode_canvas(nxt, sc_logits=prev_values.processed)
        by_probs = m.decode_canvases(nxt[None], sc_probs=dense_self_cond_probs(prev_values.processed)[None])[0]
        by_soft = m.decode_canvas(nxt, sc_soft=prev_soft.soft)
        plain = m.decode_canvas(nxt)
    np.testing.assert_array_equal(by_probs, by_logits)
    # the step's probabilities come from its own exp (within 2 ulp of numpy's): float rounding apart
    assert float(np.max(np.abs(by_soft - by_logits))) < (1e-4 if exact else 1e-2)
    assert float(np.max(np.abs(by_soft - plain))) > 1e-1  # self-conditioning moves the logits


def test_a_zero_row_is_no_signal_in_every_dense_form(blocks_gguf):
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(blocks_gguf, n_threads=2, exact=True, n_ctx=256) as m:
        m.prefill(PROMPT)
        canvas = _step_inputs(m.vocab_size, 4)[0]
        plain = m.decode_canvases(canvas)
        zeros_probs = m.decode_canvases(canvas, sc_probs=np.zeros((1, 16, m.vocab_size), np.float32))
        zeros_soft = m.decode_canvases(canvas, sc_soft=np.zeros((1, 16, m.n_embd), np.float32))
    np.testing.assert_array_equal(zeros_probs, plain)
    np.testing.assert_array_equal(zeros_soft, plain)


def test_a_top_k_run_makes_no_transposed_copy(blocks_gguf):
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(blocks_gguf, n_threads=2, n_ctx=256) as m:
        m.prefill(PROMPT)
        canvas, t, u = _step_inputs(m.vocab_size, 5)
        [first] = m.denoise_step(canvas, t, u, top_k=8)
        m.denoise_step(canvas, t, u, top_k=8, sc_topk=(first.topk_ids[None], first.topk_probs[None]))
        assert m.self_cond_bytes() == 0
        m.denoise_step(canvas, t, u, next_soft=True)
        assert m.self_cond_bytes() > 0


def test_self_conditioning_inputs_are_checked(blocks_gguf):
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(blocks_gguf, n_threads=1, n_ctx=256) as m:
        m.prefill(PROMPT)
        canvas, t, u = _step_inputs(m.vocab_size, 6)
        V, H = m.vocab_size, m.n_embd
        with pytest.raises(DgError, match="one self-conditioning input"):
            m.decode_canvases(canvas, sc_soft=np.zeros((1, 16, H)), sc_probs=np.zeros((1, 16, V)))
        with pytest.raises(InvalidParameter, match="sc_soft"):
            m.decode_canvases(canvas, sc_soft=np.zeros((1, 16, H + 1)))
        with pytest.raises(InvalidParameter, match="sc_soft"):
            m.decode_canvases(canvas, sc_soft=np.full((1, 16, H), np.nan))
        with pytest.raises(InvalidParameter, match="sc_probs"):
            m.decode_canvases(canvas, sc_probs=-np.ones((1, 16, V)))
        with pytest.raises(DgError, match="exclude each other"):
            m.denoise_step(canvas, t, u, next_soft=True, return_values=True)


# ---- every backend's ops ----------------------------------------------------------------------------


@pytest.mark.parametrize("portable", [False, True], ids=["step-op", "portable-ops"])
def test_the_self_conditioned_step_is_made_of_ops_every_backend_has(blocks_gguf, monkeypatch, portable):
    """With ggml's matmuls and the portable ops (the form a GPU backend runs): no OUT_PROD, which
    ggml-metal's supports_op lacks (the top-k contraction is one only on a CPU with no GPU in use, where
    it spares the gathered rows' transposed copy), and the dense product is one MUL_MAT of E^T
    [V, n_embd] and the probabilities [V, C], input and next-step forms alike."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.profile import NodeProfiler

    for env in ("DG_LM_HEAD", "DG_DENSE_GEMM", "DG_EXPERT_GEMM"):
        monkeypatch.setenv(env, "ggml")
    profiler = NodeProfiler()
    try:
        with DiffusionModel(blocks_gguf, n_threads=1, n_ctx=256, eval_callback=profiler.eval_callback) as m:
            m.prefill(PROMPT)
            canvas, t, u = _step_inputs(m.vocab_size, 7)
            V, H = m.vocab_size, m.n_embd
            [first] = m.denoise_step(canvas, t, u, top_k=4, portable_ops=portable)
            profiler.enabled = True
            m.denoise_step(canvas, t, u, top_k=4, portable_ops=portable,
                           sc_topk=(first.topk_ids[None], first.topk_probs[None]))
            m.denoise_step(canvas, t, u, next_soft=True, portable_ops=portable,
                           sc_probs=np.full((1, 16, V), 1.0 / V, np.float32))
            m.denoise_step(canvas, t, u, next_soft=True, portable_ops=portable, sc_soft=np.ones((1, 16, H)))
            nodes = profiler.take()
    finally:
        profiler.close()
    ops = {n.op for n in nodes}
    [topk] = [n for n in nodes if n.name == "sc_topk_product"]
    cpu_form = not portable and not native.gpu_devices()  # the OUT_PROD only where no GPU is in use
    assert topk.op == ("OUT_PROD" if cpu_form else "MUL_MAT")
    assert "MUL_MAT" in ops and ("OUT_PROD" in ops) == cpu_form
    products = [n for n in nodes if n.name == "sc_dense_product"]
    assert len(products) == 3  # the dense input's, and each dense step's next one
    for n in products:
        assert n.op == "MUL_MAT" and n.shapes[0][:2] == (H, 16) and n.shapes[1][:2] == (V, H), n
    # the step op and the view that orders the product after it, nothing else (none in the ggml-ops form)
    assert {n.name for n in nodes if n.op == "CUSTOM"} == (set() if portable else {"dg_step", "sc_next_probs"})


def test_the_dense_product_takes_the_lm_head_gemm_where_the_cpu_has_it(blocks_gguf, monkeypatch):
    """Outside exact mode, with no GPU, a CPU that has the LM head's int8 kernel runs the product on
    it (a custom op over the repacked Q8_0 copy); the emulated kernel exists on every CPU."""
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.profile import NodeProfiler

    monkeypatch.setenv("DG_LM_HEAD", "emulated")
    profiler = NodeProfiler()
    try:
        with DiffusionModel(blocks_gguf, n_threads=1, n_ctx=256, eval_callback=profiler.eval_callback) as m:
            assert m.self_cond_path() == "emulated" and m.self_cond_path(exact=True) == "ggml"
            m.prefill(PROMPT)
            canvas, t, u = _step_inputs(m.vocab_size, 8)
            profiler.enabled = True
            m.denoise_step(canvas, t, u, next_soft=True)
            nodes = profiler.take()
            assert m.self_cond_bytes() == 512 * 64 * 36 // 32  # the repack: 36 bytes per 32 weights
    finally:
        profiler.close()
    [product] = [n for n in nodes if n.name == "sc_dense_product"]
    assert product.op == "CUSTOM"


# ---- the engine --------------------------------------------------------------------------------------


def test_engine_dense_default_runs_the_product_in_the_graph(blocks_gguf):
    """The engine's default (dense) on the graph step feeds the step's own soft embedding forward:
    the same generation as the host sampler, which passes the processed logits back instead."""
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.runtime.model import DiffusionModel
    from dgcli.params import DiffusionParams

    params = DiffusionParams(max_denoising_steps=6)
    runs = {}
    with DiffusionModel(blocks_gguf, n_threads=2, exact=True, n_ctx=256) as m:
        for backend in ("auto", "native"):
            engine = DiffusionEngine(m, sampler=backend)
            steps = []
            result = engine.generate(PROMPT, params=params, max_new_tokens=16, seed=4,
                                     on_event=lambda e: steps.append(e) if e.kind == "step" else None)
            runs[engine.step_backend] = (result, steps)
    (graph, graph_steps), (host, host_steps) = runs["graph"], runs["native"]
    assert graph.self_conditioning == host.self_conditioning == "dense"
    assert graph.token_ids == host.token_ids
    assert [e.accepted_mask.tolist() for e in graph_steps] == [e.accepted_mask.tolist() for e in host_steps]
    # the graph's probabilities (its exp, its sum's order) and numpy's softmax differ by ~1e-6 at the first
    # self-conditioned step; this random model feeds that back, to ~1e-5 by the sixth step
    graph_entropy, host_entropy = [e.mean_entropy for e in graph_steps], [e.mean_entropy for e in host_steps]
    np.testing.assert_allclose(graph_entropy[:2], host_entropy[:2], rtol=1e-5)
    np.testing.assert_allclose(graph_entropy, host_entropy, rtol=1e-4)


@pytest.mark.parametrize("lm_head", ["emulated", "ggml"])
def test_step_profile_counts_the_dense_product(blocks_gguf, monkeypatch, lm_head):
    """benchmarks/step_profile.py shows the dense product as a group of its own, with V x n_embd
    multiply-adds per canvas position, on our GEMM (a custom op) or ggml's MUL_MAT."""
    import sys
    from pathlib import Path

    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.profile import NodeProfiler

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from step_profile import group_of, multiply_adds

    monkeypatch.setenv("DG_LM_HEAD", lm_head)
    profiler = NodeProfiler()
    try:
        with DiffusionModel(blocks_gguf, n_threads=1, n_ctx=256, eval_callback=profiler.eval_callback) as m:
            m.prefill(PROMPT)
            canvas, t, u = _step_inputs(m.vocab_size, 9)
            profiler.enabled = True
            m.denoise_step(canvas, t, u, next_soft=True)
            nodes = profiler.take()
            V, H = m.vocab_size, m.n_embd
    finally:
        profiler.close()
    [product] = [n for n in nodes if n.name == "sc_dense_product"]
    kind = "repacked int8 GEMM" if lm_head == "emulated" else "MUL_MAT"
    assert group_of(product, V, H) == f"dense self-conditioning product E^T x p ({kind})"
    assert multiply_adds(product, H) == V * H * 16
