"""The Transformers reference on tiny random DiffusionGemma models (tests, examples, training only).

torch and transformers are imported inside the functions, so importing this module is free.

- `tiny_config(**overrides)`: a DiffusionGemmaConfig with sliding AND full layers, MoE, k_eq_v full
  layers with their own head dim, and the dg-tiny vocabulary.
- `random_model(config, seed)`: every tensor randomized (norms, router scales, self-conditioning,
  and the encoder and decoder layer scalars with different values), float32, eval, eager attention.
- `save_checkpoint(model, dir, config_form=...)`: a checkpoint dir in Google's config form or the
  form Transformers' save_pretrained writes.
- `ReferenceRunner` / `reference_logits` / `reference_causal_logits`: the reference forward passes
  the native engine is compared against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dgcli.errors import DgError
from dgcli.testing.tiny import TINY_CANVAS_LENGTH, TINY_TEXT_CONFIG

# The vision tower is never converted; it only has to exist, so it is as small as it can be.
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=16)

TOP_LEVEL_KEYS = ("canvas_length", "boi_token_id", "eoi_token_id", "image_token_id", "tie_word_embeddings")


def _require_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DgError(f"the Transformers reference needs torch and transformers ({exc})") from None


def tiny_config(**overrides: Any):
    """A tiny DiffusionGemmaConfig. Overrides name text-config fields or top-level ones (canvas_length).

    Changing num_hidden_layers without layer_types uses Transformers' 5:1 pattern.
    """
    _require_torch()
    from transformers import DiffusionGemmaConfig

    from dgcli.testing.tiny import tiny_vocab

    text = dict(TINY_TEXT_CONFIG, vocab_size=tiny_vocab().vocab_size)
    top: dict[str, Any] = {"canvas_length": TINY_CANVAS_LENGTH}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        text.pop("layer_types")
    for key, value in overrides.items():
        (top if key in TOP_LEVEL_KEYS else text)[key] = value
    return DiffusionGemmaConfig(text_config=text, vision_config=dict(TINY_VISION), **top)


def _uniform(generator, shape, low: float, high: float):
    import torch

    return torch.rand(shape, generator=generator, dtype=torch.float32) * (high - low) + low


def random_model(config=None, seed: int = 0):
    """DiffusionGemmaForBlockDiffusion with every tensor drawn from `seed` (float32, eval, eager)."""
    _require_torch()
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    config = config if config is not None else tiny_config()
    config._attn_implementation = "eager"
    config.get_text_config()._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)

    with torch.no_grad():
        # named_parameters() lists a tied tensor once, so filling in place keeps the ties.
        for name, param in model.named_parameters():
            if param.ndim == 1 or name.endswith(("router.scale", "per_expert_scale")):
                # norms and scales: positive, away from 1 so a missing multiply shows
                param.copy_(_uniform(generator, param.shape, 0.5, 1.5))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in ** 0.5)
        encoder_layers = model.model.encoder.language_model.layers
        decoder_layers = model.model.decoder.layers
        for enc, dec in zip(encoder_layers, decoder_layers):
            enc.layer_scalar.copy_(_uniform(generator, (1,), 0.5, 0.9))
            dec.layer_scalar.copy_(_uniform(generator, (1,), 1.1, 1.5))
    check_ties(model)
    return model


def check_ties(model) -> None:
    """Encoder and decoder share every weight and differ in every layer scalar; raise otherwise."""
    import torch

    enc = model.model.encoder.language_model
    dec = model.model.decoder
    enc_state = {k: v for k, v in enc.state_dict().items() if "layer_scalar" not in k}
    dec_state = dec.state_dict()
    for key, value in enc_state.items():
        if key not in dec_state:
            continue
        if not torch.equal(value, dec_state[key]):
            raise AssertionError(f"encoder/decoder tie broken at {key}")
    if not torch.equal(model.lm_head.weight, dec.embed_tokens.weight):
        raise AssertionError("lm_head is not tied to the embedding")
    for i, (e, d) in enumerate(zip(enc.layers, dec.layers)):
        if torch.equal(e.layer_scalar, d.layer_scalar):
            raise AssertionError(f"layer {i}: encoder and decoder layer_scalar are equal")


def to_google_config(saved: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a save_pretrained config.json into Google's form (global_head_dim, num_global_key_value_heads)."""
    out = json.loads(json.dumps(saved))
    text = out["text_config"]
    per_layer = text.pop("per_layer_config", None) or {}
    full_layers = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    overrides = [per_layer.get(str(i), per_layer.get(i, {})) for i in full_layers]
    head_dims = {o.get("head_dim", text["head_dim"]) for o in overrides}
    kv_heads = {o.get("num_key_value_heads", text["num_key_value_heads"]) for o in overrides}
    if len(head_dims) > 1 or len(kv_heads) > 1:
        raise DgError("Google's config form cannot express full layers with different head dims")
    text["global_head_dim"] = head_dims.pop() if head_dims else text["head_dim"]
    text["num_global_key_value_heads"] = kv_heads.pop() if kv_heads else text["num_key_value_heads"]
    return out


def save_checkpoint(model, directory: str | Path, config_form: str = "google", vocab=None,
                    generation_nulls: bool = False) -> Path:
    """Write model.safetensors, config.json, generation_config.json and the tokenizer files.

    config_form "saved" keeps what save_pretrained writes (per_layer_config); "google" rewrites
    text_config the way Google's published config.json carries it. `generation_nulls` writes a
    generation_config.json whose diffusion fields are null (as a saved toy's can be).
    """
    _require_torch()
    if config_form not in ("google", "saved"):
        raise DgError(f"config_form must be 'google' or 'saved', got {config_form!r}")
    from dgcli.testing.tiny import tiny_vocab

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    config_path = directory / "config.json"
    if config_form == "google":
        saved = json.loads(config_path.read_text())
        config_path.write_text(json.dumps(to_google_config(saved), indent=2))
    generation = {
        "bos_token_id": 2, "pad_token_id": 0, "eos_token_id": [1, 106],
        "max_denoising_steps": None if generation_nulls else 48,
        "t_min": None if generation_nulls else 0.4,
        "t_max": None if generation_nulls else 0.8,
        "stability_threshold": None if generation_nulls else 1,
        "confidence_threshold": None if generation_nulls else 0.005,
        # `_cls_name` as Transformers serialises the dataclass, so its from_pretrained reads it back
        "sampler_config": None if generation_nulls else {"entropy_bound": 0.1,
                                                         "_cls_name": "EntropyBoundSamplerConfig"},
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (vocab or tiny_vocab()).save_hf(directory)
    return directory


# -- reference forward passes ---------------------------------------------------------------------


class ReferenceRunner:
    """Step-level reference: the encoder appends to a DynamicCache, the decoder reads it.

    Mirrors the engine's DiffusionModel (prefill / commit / decode_canvas) so tests can drive both
    the same way.
    """

    def __init__(self, model):
        _require_torch()
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        self.n_past = 0

    def _encode(self, ids: Sequence[int]) -> None:
        import torch

        if len(ids) == 0:
            return
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        with torch.no_grad():
            self.model.model.encoder(input_ids=input_ids, past_key_values=self.cache)
        self.n_past += len(ids)

    def prefill(self, ids: Sequence[int]) -> None:
        self._encode(ids)

    def commit(self, canvas: Sequence[int]) -> None:
        self._encode(canvas)

    def decode_canvas(self, canvas: Sequence[int], sc_logits=None):
        """[C, V] float32 softcapped logits (numpy); the cache is not changed."""
        import numpy as np
        import torch

        if self.n_past == 0:
            raise DgError("the reference decoder needs a prefilled cache")
        canvas_t = torch.tensor([list(canvas)], dtype=torch.long)
        sc = None
        if sc_logits is not None:
            sc = torch.as_tensor(np.asarray(sc_logits, dtype=np.float32))[None]
        with torch.no_grad():
            out = self.model(decoder_input_ids=canvas_t, self_conditioning_logits=sc, past_key_values=self.cache)
        return out.logits[0].float().numpy()


def reference_logits(model, prompt_ids: Sequence[int], canvases_to_commit: Sequence[Sequence[int]] = (),
                     canvas: Sequence[int] | None = None, sc_logits=None):
    """Decoder logits [C, V] for `canvas` after encoding the prompt and then each committed canvas."""
    runner = ReferenceRunner(model)
    runner.prefill(prompt_ids)
    for committed in canvases_to_commit:
        runner.commit(committed)
    if canvas is None:
        raise DgError("reference_logits needs a canvas to decode")
    return runner.decode_canvas(canvas, sc_logits)


def reference_causal_logits(model, ids: Sequence[int]):
    """[T, V] causal logits of the encoder stack (+ final norm, tied head, softcap): the AR gemma4 twin."""
    _require_torch()
    import torch

    input_ids = torch.tensor([list(ids)], dtype=torch.long)
    with torch.no_grad():
        hidden = model.model.encoder(input_ids=input_ids).last_hidden_state
        logits = model.lm_head(hidden).float()
        cap = model.config.get_text_config().final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits[0].numpy()
