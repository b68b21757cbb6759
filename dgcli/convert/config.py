"""The checkpoint's configuration in the published layout's terms: LayoutParams from config.json
(Google's form or the save_pretrained form) and the sampler defaults from generation_config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dgcli.errors import DgError
from dgcli.params import DiffusionParams

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
NO_ROTATION_FACTOR = 1e30
# The reference's logit softcap: a class constant of its text config, so config.json never carries it.
DEFAULT_SOFTCAP = 30.0


@dataclass
class LayoutParams:
    """Everything the GGUF keys and tensor shapes are derived from."""

    n_layer: int
    n_embd: int
    n_ff: int  # shared dense FFN
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    n_head: int
    is_swa: list[bool]  # per layer, True = sliding
    head_count_kv: list[int]  # per layer
    head_dim_full: int
    head_dim_swa: int
    sliding_window: int
    vocab_size: int
    context_length: int = 131072
    rms_eps: float = 1e-6
    rope_base_full: float = 1_000_000.0
    rope_base_swa: float = 10_000.0
    partial_rotary_factor: float = 0.25
    softcap: float = DEFAULT_SOFTCAP
    canvas_length: int = 256
    diffusion: DiffusionParams = field(default_factory=DiffusionParams)
    # fields ("softcap" and DiffusionParams names) the checkpoint left out, so they hold the reference's defaults
    reference_defaults: tuple[str, ...] = ()

    # what a config can ask for before it is certainly wrong (the 26B: 30 layers, 2816 wide, 262144
    # tokens): a bound here keeps a corrupt config from sizing tensors and buffers
    LIMITS = {"n_layer": 1 << 12, "n_embd": 1 << 17, "n_ff": 1 << 20, "n_ff_exp": 1 << 20, "n_expert": 1 << 12,
              "n_expert_used": 1 << 12, "n_head": 1 << 12, "head_dim_full": 1 << 14, "head_dim_swa": 1 << 14,
              "sliding_window": 1 << 26, "vocab_size": 1 << 24, "context_length": 1 << 26, "canvas_length": 1 << 16}

    def validate(self) -> "LayoutParams":
        for name, limit in self.LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise DgError(f"config.json: {name} = {value!r} is not an integer from 1 to {limit}")
        for name in ("rms_eps", "rope_base_full", "rope_base_swa", "softcap"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise DgError(f"config.json: {name} = {value!r} must be a finite number > 0")
        if not 0 < self.partial_rotary_factor <= 1:
            raise DgError(f"config.json: partial_rotary_factor = {self.partial_rotary_factor!r} must be in (0, 1]")
        if self.n_layer < 1 or len(self.is_swa) != self.n_layer or len(self.head_count_kv) != self.n_layer:
            raise DgError(f"inconsistent layer count: {self.n_layer} layers, {len(self.is_swa)} layer types, "
                          f"{len(self.head_count_kv)} kv-head entries")
        if all(self.is_swa):
            raise DgError("the model needs at least one full-attention layer")
        if not 1 <= self.n_expert_used <= self.n_expert:
            raise DgError(f"top_k_experts={self.n_expert_used} must be between 1 and num_experts={self.n_expert}")
        for i, kv in enumerate(self.head_count_kv):
            if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or self.n_head % kv:
                raise DgError(f"layer {i}: {self.n_head} heads are not a multiple of {kv} kv heads")
        if self.head_dim_full % 2 or self.head_dim_swa % 2:
            raise DgError("head dims must be even for rope")
        if self.canvas_length < 1:
            raise DgError(f"canvas_length must be >= 1, got {self.canvas_length}")
        self.diffusion.validate()
        return self

    def head_dim(self, layer: int) -> int:
        return self.head_dim_swa if self.is_swa[layer] else self.head_dim_full

    def rope_freq_factors(self) -> np.ndarray:
        n_pairs = self.head_dim_full // 2
        # same rounding as Transformers' proportional rope: int(factor * head_dim // 2)
        rotated = int(self.partial_rotary_factor * self.head_dim_full // 2)
        factors = np.full(n_pairs, NO_ROTATION_FACTOR, dtype=np.float32)
        factors[:rotated] = 1.0
        return factors


def _default_layer_types(n_layer: int) -> list[str]:
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layer)]
    types[-1] = "full_attention"
    return types


def params_from_hf_config(config: dict[str, Any], generation: dict[str, Any] | None = None) -> LayoutParams:
    """LayoutParams from a config.json (Google's form or the save_pretrained form) + generation_config.json."""
    if not isinstance(config, dict):
        raise DgError("config.json must hold a JSON object")
    model_type = config.get("model_type")
    if model_type != "diffusion_gemma":
        raise DgError(f"unsupported model_type {model_type!r} in config.json (expected 'diffusion_gemma')")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise DgError("config.json has no text_config object")
    tied = config.get("tie_word_embeddings")  # Transformers' default: true
    if tied is not None and tied is not True:
        # false unties the LM head from the embedding and the encoder from the decoder (Transformers'
        # DiffusionGemmaConfig); the layout has one copy of each: the LM head is token_embd
        raise DgError(f"config.json has tie_word_embeddings = {json.dumps(tied)}: a separate LM head and encoder "
                      "weights are not supported (the GGUF layout ties the LM head to token_embd and shares "
                      "the encoder's weights with the decoder)")

    def need(key: str) -> Any:
        if text.get(key) is None:
            raise DgError(f"config.json text_config lacks {key!r}")
        return text[key]

    def integer(key: str, value: Any = None) -> int:
        """`value` (default: text_config's `key`, which must be there) as an int: a string, a bool or a
        fraction is refused, not converted (int() would take "64" and 64.9 for 64)."""
        value = need(key) if value is None else value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise DgError(f"config.json: {key} = {value!r} is not an integer")
        return value

    def optional(key: str, default: int, source: dict | None = None) -> int:
        """text_config's (or `source`'s) `key`, `default` when it is absent or null (0 is a value, not
        an absent key: canvas_length 0 is refused, never read as the default 256)."""
        value = (text if source is None else source).get(key)
        return default if value is None else integer(key, value)

    try:
        n_layer = integer("num_hidden_layers")
        layer_types = text.get("layer_types")
        if not layer_types:  # the default list has n_layer entries: bound it first, before building it
            limit = LayoutParams.LIMITS["n_layer"]
            if not 1 <= n_layer <= limit:
                raise DgError(f"config.json: num_hidden_layers = {n_layer} is not an integer from 1 to {limit}")
            layer_types = _default_layer_types(n_layer)
        layer_types = list(layer_types)
        if len(layer_types) != n_layer:
            raise DgError(f"text_config.layer_types has {len(layer_types)} entries for {n_layer} layers")
        bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if bad:
            raise DgError(f"unknown layer type(s) {bad} in text_config.layer_types")
        if layer_types[-1] != "full_attention":
            layer_types[-1] = "full_attention"  # Transformers forces this too
        if text.get("use_bidirectional_attention") == "all":
            raise DgError("use_bidirectional_attention='all' (non-causal encoder) is not supported")
        activation = text.get("hidden_activation", "gelu_pytorch_tanh")
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise DgError(f"unsupported hidden_activation {activation!r} (gelu_pytorch_tanh expected)")
        if text.get("attention_bias"):
            raise DgError("attention_bias=true is not supported by the published layout")

        head_dim = optional("head_dim", 256)
        n_kv = optional("num_key_value_heads", 4)
        if "per_layer_config" in text and text["per_layer_config"] is not None:
            per_layer = {str(k): v or {} for k, v in dict(text["per_layer_config"]).items()}
            layer_head_dim = [optional("head_dim", head_dim, per_layer.get(str(i), {})) for i in range(n_layer)]
            layer_kv = [optional("num_key_value_heads", n_kv, per_layer.get(str(i), {})) for i in range(n_layer)]
        else:
            # Google's form; Transformers' defaults when a key is missing (global_head_dim 512).
            global_head_dim = optional("global_head_dim", 512)
            global_kv = optional("num_global_key_value_heads", n_kv)
            layer_head_dim = [head_dim if t == "sliding_attention" else global_head_dim for t in layer_types]
            layer_kv = [n_kv if t == "sliding_attention" else global_kv for t in layer_types]
        is_swa = [t == "sliding_attention" for t in layer_types]
        swa_dims = {d for d, s in zip(layer_head_dim, is_swa) if s}
        full_dims = {d for d, s in zip(layer_head_dim, is_swa) if not s}
        if len(swa_dims) > 1 or len(full_dims) > 1:
            raise DgError(f"layers of one type must share a head dim (sliding {sorted(swa_dims)}, full {sorted(full_dims)})")
        head_dim_full = full_dims.pop()
        head_dim_swa = swa_dims.pop() if swa_dims else head_dim

        rope = text.get("rope_parameters") or {}
        rope_full = rope.get("full_attention") or {}
        rope_swa = rope.get("sliding_attention") or {}
        if rope_full.get("rope_type", "proportional") not in ("proportional", "default"):
            raise DgError(f"unsupported full-attention rope_type {rope_full.get('rope_type')!r}")
        partial = rope_full.get("partial_rotary_factor", 0.25 if rope_full.get("rope_type", "proportional") == "proportional" else 1.0)

        if text.get("num_experts") in (None, 0):
            raise DgError("config.json text_config has no num_experts: only the MoE model is supported")
        softcap = text.get("final_logit_softcapping")
        diffusion, diffusion_defaults = diffusion_params_from_generation(generation)
        params = LayoutParams(
            n_layer=n_layer,
            n_embd=integer("hidden_size"),
            n_ff=integer("intermediate_size"),
            n_ff_exp=integer("moe_intermediate_size"),
            n_expert=integer("num_experts"),
            n_expert_used=integer("top_k_experts"),
            n_head=integer("num_attention_heads"),
            is_swa=is_swa,
            head_count_kv=layer_kv,
            head_dim_full=head_dim_full,
            head_dim_swa=head_dim_swa,
            sliding_window=optional("sliding_window", 512),
            vocab_size=integer("vocab_size"),
            context_length=optional("max_position_embeddings", 131072),
            rms_eps=float(text.get("rms_norm_eps") or 1e-6),
            rope_base_full=float(rope_full.get("rope_theta", 1_000_000.0)),
            rope_base_swa=float(rope_swa.get("rope_theta", 10_000.0)),
            partial_rotary_factor=float(partial),
            softcap=float(softcap) if softcap else DEFAULT_SOFTCAP,
            canvas_length=optional("canvas_length", 256, config),
            diffusion=diffusion,
            reference_defaults=(() if softcap else ("softcap",)) + diffusion_defaults,
        )
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        if isinstance(exc, DgError):
            raise
        raise DgError(f"config.json has a malformed value: {exc}") from None
    return params.validate()


def diffusion_params_from_generation(generation: dict[str, Any] | None) -> tuple[DiffusionParams, tuple[str, ...]]:
    """The sampler defaults from generation_config.json, and the fields it left missing or null
    (those take the reference's defaults)."""
    generation = generation if isinstance(generation, dict) else {}
    sampler = generation.get("sampler_config")
    sampler = sampler if isinstance(sampler, dict) else {}
    given = {
        "max_denoising_steps": generation.get("max_denoising_steps"),
        "t_min": generation.get("t_min"),
        "t_max": generation.get("t_max"),
        "entropy_bound": sampler.get("entropy_bound", generation.get("entropy_bound")),
        "stability_threshold": generation.get("stability_threshold"),
        "confidence_threshold": generation.get("confidence_threshold"),
    }
    defaulted = tuple(name for name, value in given.items() if value is None)
    return DiffusionParams().replace(**given).validate(), defaulted
