"""The seed's EXP A on our own stack: a freshly initialised model has near-uniform logits, so the
entropy bound admits only its at-least-one token per step and the adaptive stop never fires."""

from __future__ import annotations

import math

import pytest

from dgcli.params import DiffusionParams
from native_helpers import requires_native


@pytest.fixture(scope="module")
def untrained_gguf(tmp_path_factory):
    from dgcli.testing.tiny import write_tiny_random_gguf

    return write_tiny_random_gguf(tmp_path_factory.mktemp("untrained") / "untrained.gguf", seed=0, init="untrained")


@requires_native
def test_untrained_model_commits_one_token_per_step_and_never_stops_early(untrained_gguf):
    from dgcli.engine.diffusion import DiffusionEngine

    steps = []
    with DiffusionEngine(untrained_gguf, n_threads=1) as engine:
        params = DiffusionParams(max_denoising_steps=12)
        result = engine.generate("what is 3+5", params=params, max_new_tokens=2 * engine.model.canvas_length,
                                 seed=0, on_event=lambda e: steps.append(e) if e.kind == "step" else None)
        uniform = math.log(engine.model.vocab_size)
    assert result.steps_per_canvas == [12, 12]
    assert [e.n_accepted for e in steps] == [1] * 24
    assert not any(e.stopped for e in steps)
    # Near the uniform bound: the reason nothing else gets accepted.
    assert min(e.mean_entropy for e in steps) > 0.95 * uniform


def test_untrained_init_is_fresh_transformers_init(untrained_gguf):
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(untrained_gguf))
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    assert np.all(tensors["blk.0.attn_norm.weight"] == 1.0)
    assert np.all(tensors["blk.0.layer_output_scale.weight"] == 1.0)
    assert abs(float(tensors["token_embd.weight"].std()) - 0.02) < 0.002
