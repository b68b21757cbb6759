"""Dense self-conditioning at the real widths (vocabulary 262144, hidden 2816) against the Transformers
reference: the soft embedding softmax(logits) @ E * sqrt(n_embd) as the reference computes it, through
dg's one product of the probabilities and the transposed embeddings.

A random model with the real vocabulary, hidden size, heads and dense FFN, but two layers (one
sliding, one full) of four experts and a 16-token canvas, so that it stays fast and within a shared
machine's memory (~4 GB of F32 weights, held by one side at a time: the reference's logits are taken,
its model dropped, then the converted GGUF is loaded). Budgets: the small-vocabulary tests' (
tests/test_native_model.py): exact mode 1e-4 of max |logit difference|, default mode (1.5, 5e-2).
"""

from __future__ import annotations

import gc
import shutil

import numpy as np
import pytest

from native_helpers import requires_native

pytestmark = [requires_native, pytest.mark.slow]

VOCAB, HIDDEN, CANVAS = 262144, 2816, 16
# the small-vocabulary budgets (tests/test_native_model.py): max |logit difference| in exact mode, and
# (max, mean) in default mode
EXACT_TOL = 1e-4
DEFAULT_TOL = (1.5, 5e-2)
PROMPT = [2, 105, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 106, 107, 105]


@pytest.fixture(scope="module")
def real_width(tmp_path_factory):
    """(GGUF path, canvas, previous step's processed logits, reference logits without and with them)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    from dgcli.convert import convert_checkpoint
    from dgcli.reference import ReferenceRunner, random_model, save_checkpoint, tiny_config
    from dgcli.tiny import TinyVocab

    torch.set_num_threads(2)
    config = tiny_config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2112, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
                         layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2,
                         sliding_window=8, num_experts=4, top_k_experts=2, moe_intermediate_size=704,
                         canvas_length=CANVAS)
    model = random_model(config, seed=0)
    rng = np.random.default_rng(1)
    canvas = [int(t) for t in rng.integers(0, VOCAB, CANVAS)]
    # peaked enough that the soft embeddings differ from a uniform mixture (as the small tests' inputs)
    sc = (rng.standard_normal((CANVAS, VOCAB)) * 4.0).astype(np.float32)
    ref = ReferenceRunner(model)
    ref.prefill(PROMPT)
    first, self_cond = ref.decode_canvas(canvas), ref.decode_canvas(canvas, sc)

    work = tmp_path_factory.mktemp("real-width")
    checkpoint = save_checkpoint(model, work / "ckpt", vocab=TinyVocab(extra_tokens=VOCAB - TinyVocab().vocab_size))
    del model, ref
    gc.collect()
    path = convert_checkpoint(checkpoint, work / "real-width-f32.gguf", "f32")
    shutil.rmtree(checkpoint)
    return path, canvas, sc, first, self_cond


def _maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def test_exact_mode_dense_self_conditioning_matches_the_reference(real_width):
    from dgcli.engine.model import DiffusionModel

    path, canvas, sc, first, self_cond = real_width
    with DiffusionModel(path, n_threads=2, exact=True, n_ctx=256, n_ubatch=32) as m:
        assert (m.vocab_size, m.n_embd) == (VOCAB, HIDDEN)
        m.prefill(PROMPT)
        got_first = m.decode_canvas(canvas)
        got = m.decode_canvas(canvas, sc_logits=sc)
        assert m.self_cond_bytes() == VOCAB * HIDDEN * 4  # exact mode's F32 transposed copy
        # the one-graph step's own product, handed to the next step, conditions it as the logits do
        u = np.random.default_rng(2).random((1, CANVAS))
        [values] = m.denoise_step(np.asarray([canvas]), np.float32(0.6), u, return_values=True)
        [soft] = m.denoise_step(np.asarray([canvas]), np.float32(0.6), u, next_soft=True)
        by_logits = m.decode_canvas(canvas, sc_logits=values.processed)
        by_soft = m.decode_canvas(canvas, sc_soft=soft.soft)
    print(f"real widths, exact: first {_maxdiff(got_first, first):.2e}, self-conditioned {_maxdiff(got, self_cond):.2e}, "
          f"step's soft embedding vs its logits {_maxdiff(by_soft, by_logits):.2e}")
    assert _maxdiff(got_first, first) < EXACT_TOL
    assert _maxdiff(got, self_cond) < EXACT_TOL
    assert _maxdiff(self_cond, first) > 100 * EXACT_TOL  # the self-conditioning input is seen
    assert _maxdiff(by_soft, by_logits) < EXACT_TOL


def test_default_mode_dense_self_conditioning_matches_the_reference_loosely(real_width):
    """Default mode: the Q8_0 transposed copy (the int8 GEMM where the CPU has it), F16 K/V, the GELU table."""
    from dgcli.engine.model import DiffusionModel

    path, canvas, sc, _, self_cond = real_width
    with DiffusionModel(path, n_threads=2, n_ctx=256, n_ubatch=32) as m:
        m.prefill(PROMPT)
        got = m.decode_canvas(canvas, sc_logits=sc)
        assert m.self_cond_bytes() in (VOCAB * HIDDEN // 32 * 34, VOCAB * HIDDEN // 32 * 36)  # Q8_0, or repacked
    diff, mean = _maxdiff(got, self_cond), float(np.mean(np.abs(got - self_cond)))
    print(f"real widths, default mode: self-conditioned max {diff:.2e}, mean {mean:.2e}")
    assert diff < DEFAULT_TOL[0] and mean < DEFAULT_TOL[1]
