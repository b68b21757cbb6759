"""Dense self-conditioning at the real widths (vocabulary 262144, hidden 2816, the 26B-A4B's heads and
dense FFN) against the Transformers reference: the soft embedding softmax(logits) @ E * sqrt(n_embd)
as the reference computes it, through dg's one product of the probabilities and the transposed
embeddings.

A random model of those widths but two layers (one sliding, one full) of four experts and a 16-token
canvas, so that it stays fast and within a shared machine's memory (~4 GB of F32 weights, held by one
side at a time: the reference's logits are taken, its model dropped, then the converted GGUF is
loaded). Its embeddings are scaled so that the logits spread as the small-vocabulary tests' do (std
~4: tests/test_native_model.py), so that absolute logit differences mean the same in both.

Budgets. The soft embedding itself, against float64 over the same values and the file's E: float32
rounding (relative 1e-5). The logits, exact mode: the small-vocabulary budget (1e-4, 2.7x that model's
measured 3.7e-5) grows with the widths float32 sums run over: here the first step, with no
self-conditioning at all, measured 2.2e-4 from the reference (6x), the self-conditioned one 3.9e-4 to
5.0e-4 (depending on how the product's sums are split); EXACT_TOL_HERE keeps the ~2x margin, and
top-64 self-conditioning of the same distribution lands far outside it (checked). Default mode: the
small-vocabulary (1.5, 5e-2).
"""

from __future__ import annotations

import gc
import shutil

import numpy as np
import pytest

from native_helpers import requires_native

pytestmark = [requires_native, pytest.mark.reference, pytest.mark.slow]

VOCAB, HIDDEN, CANVAS = 262144, 2816, 16
EXACT_TOL_HERE = 1e-3
DEFAULT_TOL = (1.5, 5e-2)
PROMPT = [2, 105, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 106, 107, 105]


@pytest.fixture(scope="module")
def real_width(tmp_path_factory):
    """(GGUF path, canvas, previous step's processed logits, reference logits without and with them)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    from dgcli.convert import convert_checkpoint
    from dgcli.testing.reference import ReferenceRunner, random_model, save_checkpoint, tiny_config
    from dgcli.testing.tiny import TinyVocab

    torch.set_num_threads(2)
    config = tiny_config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2112, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
                         layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2,
                         sliding_window=8, num_experts=4, top_k_experts=2, moe_intermediate_size=704,
                         canvas_length=CANVAS)
    model = random_model(config, seed=0)
    with torch.no_grad():  # the tiny tests' logit spread: E's std 0.5 at hidden 64 gives logits of std ~4
        model.model.decoder.embed_tokens.weight.mul_((64 / HIDDEN) ** 0.5)
    rng = np.random.default_rng(1)
    canvas = [int(t) for t in rng.integers(0, VOCAB, CANVAS)]
    # peaked enough that the soft embeddings differ from a uniform mixture (as the small tests' inputs)
    sc = (rng.standard_normal((CANVAS, VOCAB)) * 4.0).astype(np.float32)
    ref = ReferenceRunner(model)
    ref.prefill(PROMPT)
    first, self_cond = ref.decode_canvas(canvas), ref.decode_canvas(canvas, sc)
    assert 3.0 < float(first.std()) < 5.0

    work = tmp_path_factory.mktemp("real-width")
    checkpoint = save_checkpoint(model, work / "ckpt", vocab=TinyVocab(extra_tokens=VOCAB - TinyVocab().vocab_size))
    del model, ref
    gc.collect()
    path = convert_checkpoint(checkpoint, work / "real-width-f32.gguf", "f32")
    shutil.rmtree(checkpoint)
    return path, canvas, sc, first, self_cond


def _maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def _soft_float64(values: np.ndarray, path) -> np.ndarray:
    """softmax(values) @ E * sqrt(n_embd) in float64, E read from the GGUF a slice of tokens at a time."""
    import gguf

    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    embd = np.asarray(t.data).reshape(VOCAB, HIDDEN)
    v = values.astype(np.float64)
    p = np.exp(v - v.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    soft = np.zeros((len(v), HIDDEN))
    for v0 in range(0, VOCAB, 16384):
        soft += p[:, v0:v0 + 16384] @ embd[v0:v0 + 16384].astype(np.float64)
    return soft * np.sqrt(HIDDEN)


def test_exact_mode_dense_self_conditioning_matches_the_reference(real_width):
    from dgcli.runtime.model import DiffusionModel

    path, canvas, sc, first, self_cond = real_width
    with DiffusionModel(path, n_threads=2, exact=True, n_ctx=256, n_ubatch=32) as m:
        assert (m.vocab_size, m.n_embd) == (VOCAB, HIDDEN)
        m.prefill(PROMPT)
        got_first = m.decode_canvas(canvas)
        got = m.decode_canvas(canvas, sc_logits=sc)
        assert m.self_cond_bytes() == VOCAB * HIDDEN * 4  # exact mode's F32 transposed copy
        # a plausible mistake the budget must see: the top-64 of the same distribution instead of all of it
        order = np.argsort(-sc, axis=1)[:, :64].astype(np.int32)
        p = np.exp(sc.astype(np.float64) - sc.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        top64 = m.decode_canvas(canvas, sc_topk=(order, np.take_along_axis(p, order, axis=1).astype(np.float32)))
        # the one-graph step's own product, for the next step: against float64, and as it conditions that step
        u = np.random.default_rng(2).random((1, CANVAS))
        [values] = m.denoise_step(np.asarray([canvas]), np.float32(0.6), u, return_values=True)
        [soft] = m.denoise_step(np.asarray([canvas]), np.float32(0.6), u, next_soft=True)
        by_logits = m.decode_canvas(canvas, sc_logits=values.processed)
        by_soft = m.decode_canvas(canvas, sc_soft=soft.soft)
    want = _soft_float64(values.processed, path)
    soft_err = float(np.max(np.linalg.norm(soft.soft - want, axis=1) / np.linalg.norm(want, axis=1)))
    print(f"real widths, exact: first {_maxdiff(got_first, first):.2e}, self-conditioned {_maxdiff(got, self_cond):.2e}, "
          f"top-64 instead {_maxdiff(top64, self_cond):.2e}; the step's soft embedding vs float64 {soft_err:.2e}, "
          f"as the next step's input vs the logits' {_maxdiff(by_soft, by_logits):.2e}")
    assert soft_err < 1e-5
    assert _maxdiff(got_first, first) < EXACT_TOL_HERE
    assert _maxdiff(got, self_cond) < EXACT_TOL_HERE
    assert _maxdiff(self_cond, first) > 1000 * EXACT_TOL_HERE  # the self-conditioning input is seen
    assert _maxdiff(top64, self_cond) > 10 * EXACT_TOL_HERE  # and the whole distribution, not its top
    assert _maxdiff(by_soft, by_logits) < EXACT_TOL_HERE


def test_default_mode_dense_self_conditioning_matches_the_reference_loosely(real_width):
    """Default mode: the Q8_0 transposed copy (the int8 GEMM where the CPU has it), F16 K/V, the GELU table."""
    from dgcli.runtime.model import DiffusionModel

    path, canvas, sc, _, self_cond = real_width
    with DiffusionModel(path, n_threads=2, n_ctx=256, n_ubatch=32) as m:
        m.prefill(PROMPT)
        got = m.decode_canvas(canvas, sc_logits=sc)
        assert m.self_cond_bytes() in (VOCAB * HIDDEN // 32 * 34, VOCAB * HIDDEN // 32 * 36)  # Q8_0, or repacked
    diff, mean = _maxdiff(got, self_cond), float(np.mean(np.abs(got - self_cond)))
    print(f"real widths, default mode: self-conditioned max {diff:.2e}, mean {mean:.2e}")
    assert diff < DEFAULT_TOL[0] and mean < DEFAULT_TOL[1]
