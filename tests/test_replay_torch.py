"""Replay proof, torch backend: our loop over TorchDiffusionModel vs the reference's `generate`.

Both sides take the same random draws: the reference's `torch.randint` / `torch.multinomial` are
patched for the duration of the call to read a seeded RngStream, and our engine gets a twin
stream. Same draws + same forward => identical committed tokens, steps per canvas and
tokens per forward, unless the sampler loop differs from the reference somewhere.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the replay needs torch + transformers (test extras)")
pytest.importorskip("transformers", reason="the replay needs the Transformers reference")

from dgcli.engine.diffusion import DiffusionEngine  # noqa: E402
from dgcli.engine.rng import RngStream  # noqa: E402
from dgcli.engine.sampler import count_valid_tokens  # noqa: E402
from dgcli.engine.types import answer_token_ids
from dgcli.params import DiffusionParams  # noqa: E402
from dgcli.testing.reference import random_model, tiny_config  # noqa: E402
from dgcli.testing.torch_model import TorchDiffusionModel  # noqa: E402

pytestmark = pytest.mark.reference

# Two cores shared by everyone: torch's default thread pool makes these tiny forwards ~50x slower.
torch.set_num_threads(1)

END_TOKEN_IDS = [1, 106]
PAD_TOKEN_ID = 0
PROMPT = [2, 105, 120, 121, 122, 123, 106, 10, 105, 130]


@contextmanager
def reference_draws_from(stream: RngStream, calls: list[str]):
    """Route the reference's random draws to `stream` (call order recorded in `calls`)."""
    real_randint, real_multinomial = torch.randint, torch.multinomial

    def randint(*args, **kwargs):
        low, high, size = 0, None, kwargs.get("size")
        positional = [a for a in args if not isinstance(a, (tuple, list, torch.Size))]
        shapes = [a for a in args if isinstance(a, (tuple, list, torch.Size))]
        if len(positional) == 1:
            high = positional[0]
        elif len(positional) >= 2:
            low, high = positional[:2]
        low, high = kwargs.get("low", low), kwargs.get("high", high)
        size = tuple(size if size is not None else shapes[0])
        assert low == 0, "the reference draws canvases from [0, vocab)"
        calls.append("randint")
        ints = stream.renoise(math.prod(size), int(high))
        return torch.as_tensor(ints, dtype=torch.long, device=kwargs.get("device")).view(size)

    def multinomial(probs, num_samples, *args, **kwargs):
        assert num_samples == 1
        calls.append("multinomial")
        picks = stream.multinomial(probs.detach().to(torch.float32).cpu().numpy())
        return torch.as_tensor(picks, dtype=torch.long, device=probs.device)[:, None]

    torch.randint, torch.multinomial = randint, multinomial
    try:
        yield
    finally:
        torch.randint, torch.multinomial = real_randint, real_multinomial


def run_reference(hf_model, prompt, params: DiffusionParams, max_new_tokens: int, seed: int):
    """The reference generate under a seeded stream: (new tokens, steps per canvas, tokens/forward, calls)."""
    hf_model.generation_config.eos_token_id = list(END_TOKEN_IDS)
    hf_model.generation_config.pad_token_id = PAD_TOKEN_ID
    forward_log: list[str] = []
    real_forward = hf_model.forward

    def counting_forward(*args, **kwargs):
        forward_log.append("decoder")
        return real_forward(*args, **kwargs)

    hook = hf_model.model.encoder.register_forward_hook(lambda *a: forward_log.append("encoder"))
    hf_model.forward = counting_forward  # generate() calls self.forward directly (no module hooks)
    calls: list[str] = []
    try:
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        with reference_draws_from(RngStream(seed), calls):
            out = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                max_denoising_steps=params.max_denoising_steps, t_min=params.t_min, t_max=params.t_max,
                sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(params.entropy_bound)),
                stability_threshold=params.stability_threshold,
                confidence_threshold=float(params.confidence_threshold))
    finally:
        del hf_model.forward
        hook.remove()
    steps: list[int] = []
    for entry in forward_log:
        if entry == "encoder":
            steps.append(0)
        else:
            steps[-1] += 1
    new_tokens = out.sequences[0, len(prompt):].tolist()
    return new_tokens, steps, float(out.tokens_per_forward[0]), calls


def run_ours(hf_model, prompt, params: DiffusionParams, max_new_tokens: int, seed: int, model=None,
             sampler: str = "numpy"):
    """Our engine over `model` (default: TorchDiffusionModel around `hf_model`)."""
    if model is None:
        model = TorchDiffusionModel(hf_model, end_token_ids=END_TOKEN_IDS, pad_token_id=PAD_TOKEN_ID)
    engine = DiffusionEngine(model, sampler=sampler)
    stream = RngStream(seed)
    canvases: list[list[int]] = []
    events: list = []

    def on_event(event):
        events.append(event)

    result = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, rng=stream, on_event=on_event)
    calls = ["randint" if c in ("canvas_init", "renoise") else c for c in stream.calls]
    return result, calls, events, canvases


def reference_tokens_per_forward(result) -> float:
    """The reference's figure: every non-pad canvas token (end token included) per decoder forward."""
    return count_valid_tokens(np.array(result.canvas_token_ids), PAD_TOKEN_ID) / result.decoder_forwards


@pytest.fixture(scope="module")
def random_hf_model():
    return random_model(tiny_config(), seed=3)


def make_confident_model(seed: int = 5):
    """The random model made confident: layer and self-conditioning outputs damped so the decoder
    nearly copies its input canvas (a token's own embedding wins the tied LM head by a wide margin),
    and the final norm doubled so that margin is far above the temperature. Entropies fall to ~1e-3:
    whole canvases are accepted per step and the adaptive stop fires after a few steps, while the
    damped layers still let the context and the self-conditioning move the argmax now and then."""
    model = random_model(tiny_config(), seed=seed)
    with torch.no_grad():
        for layer in model.model.decoder.layers:
            layer.post_attention_layernorm.weight.mul_(0.3)
            layer.post_feedforward_layernorm.weight.mul_(0.3)
        model.model.decoder.self_conditioning.down_proj.weight.mul_(0.3)
        model.model.decoder.norm.weight.mul_(2.0)
    return model


@pytest.fixture(scope="module")
def confident_hf_model():
    return make_confident_model()


def assert_same_generation(hf_model, params: DiffusionParams, max_new_tokens: int, seed: int, model=None,
                           sampler: str = "numpy"):
    ref_tokens, ref_steps, ref_tpf, ref_calls = run_reference(hf_model, PROMPT, params, max_new_tokens, seed)
    result, our_calls, events, _ = run_ours(hf_model, PROMPT, params, max_new_tokens, seed, model=model,
                                            sampler=sampler)
    canvas_length = hf_model.config.canvas_length

    assert our_calls == ref_calls
    assert result.steps_per_canvas == ref_steps
    assert result.decoder_forwards == sum(ref_steps)
    # the reference divides in float32
    assert np.float32(reference_tokens_per_forward(result)) == np.float32(ref_tpf)
    # the same canvases, end token and padding included
    assert result.canvas_token_ids == ref_tokens
    assert len(ref_tokens) % canvas_length == 0
    # the answer: before the end token, pads dropped, at most max_new_tokens
    assert result.token_ids == answer_token_ids(ref_tokens, END_TOKEN_IDS, PAD_TOKEN_ID, max_new_tokens)
    # the CanvasEvents carry the same tokens as the result
    canvas_tokens = [t for e in events if e.kind == "canvas" for t in e.token_ids]
    assert canvas_tokens == result.token_ids
    return result


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
def test_random_model_replays_reference(random_hf_model, seed):
    params = DiffusionParams(max_denoising_steps=6)
    result = assert_same_generation(random_hf_model, params, max_new_tokens=40, seed=seed)
    # an unconfident model never stops early: every canvas runs to the cap
    assert all(steps == 6 for steps in result.steps_per_canvas)


def test_random_model_default_params_two_canvases(random_hf_model):
    result = assert_same_generation(random_hf_model, DiffusionParams(), max_new_tokens=32, seed=11)
    assert len(result.steps_per_canvas) >= 1


@pytest.mark.parametrize("seed", [0, 4, 9])
def test_confident_model_replays_reference_with_adaptive_stop(confident_hf_model, seed):
    params = DiffusionParams(max_denoising_steps=20)
    result = assert_same_generation(confident_hf_model, params, max_new_tokens=48, seed=seed)
    assert any(steps < 20 for steps in result.steps_per_canvas), result.steps_per_canvas
    assert reference_tokens_per_forward(result) > 2.0


@pytest.mark.parametrize("stability_threshold", [0, 2])
def test_confident_model_replays_reference_stability_thresholds(confident_hf_model, stability_threshold):
    params = DiffusionParams(max_denoising_steps=12, stability_threshold=stability_threshold)
    assert_same_generation(confident_hf_model, params, max_new_tokens=32, seed=3)


@pytest.mark.parametrize("seed", [0, 4])
def test_native_sampler_replays_reference(confident_hf_model, random_hf_model, tmp_path_factory, seed):
    from test_sampler import build_native_sampler

    native = build_native_sampler(tmp_path_factory)
    assert_same_generation(confident_hf_model, DiffusionParams(max_denoising_steps=20), max_new_tokens=48,
                           seed=seed, sampler=native)
    assert_same_generation(random_hf_model, DiffusionParams(max_denoising_steps=6), max_new_tokens=40,
                           seed=seed, sampler=native)
