"""HF DiffusionGemma checkpoint -> GGUF in the published layout (`dg convert`), and the AR gemma4 twin.

No torch: safetensors are read with numpy memmaps (F32/F16/BF16), tensors are written one by
one (3-D expert tensors one expert at a time), so memory stays near one tensor's size.

Layout notes (checked against llama.cpp's gemma4 loader, src/models/gemma4.cpp, and the
Transformers reference):
- Linear weights keep the HF [out, in] order; ggml reads that as {in, out}. Expert tensors keep
  [E, 2*I, H] (gate rows first, then up, as both `chunk(2)` and llama.cpp's gate_up split expect)
  and [E, H, I].
- RMSNorm weights are copied as they are: the reference multiplies by the weight directly
  (no Gemma-3 style `1 + w`), and so does llama.cpp.
- The router's `scale` becomes `ffn_gate_inp.scale`; llama.cpp applies the 1/sqrt(n_embd) itself.
  `per_expert_scale` becomes `ffn_down_exps.scale`.
- Full layers have no v_proj (V = K), so `attn_v` exists on sliding layers only.
- Encoder and decoder share every weight except the per-layer scalar: the decoder's goes to
  `layer_output_scale`, the encoder's to `enc_layer_output_scale`. The AR twin (stock gemma4)
  takes the ENCODER scalar as its `layer_output_scale`.
- Proportional rope of the full layers is written as `rope_freqs`: 1.0 for the rotated pairs,
  1e30 (no rotation) for the rest.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from dgcli.errors import DgError
from dgcli.modelfile.hparams import AR_ARCH, DIFFUSION_ARCH
from dgcli.modelfile.layout import layout_tensors
from dgcli.outputs import OutputFile, check_distinct, writing
from dgcli.params import DIFFUSION_PARAM_KEYS, REFERENCE_DEFAULTS_KEY, DiffusionParams
from dgcli.units import format_bytes

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
NO_ROTATION_FACTOR = 1e30
# The reference's logit softcap: a class constant of its text config, so config.json never carries it.
DEFAULT_SOFTCAP = 30.0


# ---------------------------------------------------------------------------------------------
# Hyperparameters in the published layout's terms
# ---------------------------------------------------------------------------------------------


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
        fraction is refused, not converted (int() made "64" 64 and 64.9 64)."""
        value = need(key) if value is None else value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise DgError(f"config.json: {key} = {value!r} is not an integer")
        return value

    def optional(key: str, default: int, source: dict | None = None) -> int:
        """text_config's (or `source`'s) `key`, `default` when it is absent or null (0 is a value: it
        was taken for absent, so canvas_length 0 became 256)."""
        value = (text if source is None else source).get(key)
        return default if value is None else integer(key, value)

    try:
        n_layer = integer("num_hidden_layers")
        layer_types = text.get("layer_types")
        if not layer_types:  # the default list has n_layer entries: bound it first (10**9 took minutes and GBs)
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


# ---------------------------------------------------------------------------------------------
# The tensor plan: names, shapes and what each one is
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One GGUF tensor. `shape` is the numpy shape (ggml's ne reversed); `role` says what it holds."""

    name: str
    shape: tuple[int, ...]
    role: str  # e.g. "attn_q", "layer_scalar_decoder", "token_embd"
    layer: int | None = None


# role (modelfile.layout: the GGUF's name) -> the reference checkpoint's tensor under a layer's prefix
HF_LAYER_SUFFIX = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "attn_output": "self_attn.o_proj.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "post_ffw_norm_1": "post_feedforward_layernorm_1.weight",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2.weight",
    "ffn_gate_inp": "router.proj.weight",
    "ffn_gate_inp_scale": "router.scale",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.down_proj",
    "ffn_down_exps_scale": "router.per_expert_scale",
    "post_ffw_norm_2": "post_feedforward_layernorm_2.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
}
# role -> the reference checkpoint's tensor under the decoder's prefix
HF_SELF_COND = {
    "self_cond_pre_norm": "self_conditioning.pre_norm.weight",
    "self_cond_gate": "self_conditioning.gate_proj.weight",
    "self_cond_up": "self_conditioning.up_proj.weight",
    "self_cond_down": "self_conditioning.down_proj.weight",
}


def _layer_shapes(p: LayoutParams, i: int) -> dict[str, tuple[int, ...]]:
    hd = p.head_dim(i)
    kv = p.head_count_kv[i] * hd
    H = p.n_embd
    return {
        "attn_norm": (H,),
        "attn_q": (p.n_head * hd, H),
        "attn_k": (kv, H),
        "attn_v": (kv, H),
        "attn_q_norm": (hd,),
        "attn_k_norm": (hd,),
        "attn_output": (H, p.n_head * hd),
        "post_attention_norm": (H,),
        "ffn_norm": (H,),
        "ffn_gate": (p.n_ff, H),
        "ffn_up": (p.n_ff, H),
        "ffn_down": (H, p.n_ff),
        "post_ffw_norm_1": (H,),
        "pre_ffw_norm_2": (H,),
        "ffn_gate_inp": (p.n_expert, H),
        "ffn_gate_inp_scale": (H,),
        "ffn_gate_up_exps": (p.n_expert, 2 * p.n_ff_exp, H),
        "ffn_down_exps": (p.n_expert, H, p.n_ff_exp),
        "ffn_down_exps_scale": (p.n_expert,),
        "post_ffw_norm_2": (H,),
        "post_ffw_norm": (H,),
    }


def tensor_plan(p: LayoutParams, arch: str = DIFFUSION_ARCH) -> list[TensorSpec]:
    """Every tensor of the published layout (or of the AR twin), in file order."""
    if arch not in (DIFFUSION_ARCH, AR_ARCH):
        raise DgError(f"unknown architecture {arch!r} (expected {DIFFUSION_ARCH!r} or {AR_ARCH!r})")
    H = p.n_embd
    shapes = {"token_embd": (p.vocab_size, H), "rope_freqs": (p.head_dim_full // 2,), "output_norm": (H,),
              "layer_scalar_decoder": (1,), "layer_scalar_encoder": (1,),
              "self_cond_pre_norm": (H,), "self_cond_gate": (p.n_ff, H), "self_cond_up": (p.n_ff, H),
              "self_cond_down": (H, p.n_ff)}
    layer_shapes = [_layer_shapes(p, i) for i in range(p.n_layer)]
    return [TensorSpec(name, layer_shapes[i][role] if role in HF_LAYER_SUFFIX else shapes[role], role, i)
            for name, role, i in layout_tensors(p.is_swa, arch)]


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a dependency
        raise DgError("the 'gguf' package is needed to write GGUF files (pip install gguf)") from None
    return gguf


def storage_type(spec: TensorSpec, outtype: str):
    """The ggml type a tensor is stored as: vectors, scalars and the router stay F32."""
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    if outtype not in OUTTYPES:
        raise DgError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    if len(spec.shape) == 1 or spec.role in ("ffn_gate_inp", "rope_freqs"):
        return T.F32
    if outtype == "f32":
        return T.F32
    if outtype == "f16":
        return T.F16
    if outtype == "bf16":
        return T.BF16
    block = gguf.GGML_QUANT_SIZES[T.Q8_0][0]
    # llama.cpp's converters fall back the same way for rows that do not fill whole blocks
    return T.Q8_0 if spec.shape[-1] % block == 0 else T.F16


def encode_as(data: np.ndarray, qtype) -> np.ndarray:
    """float32 data -> the bytes/array written for `qtype` (F32, F16, BF16, Q8_0; Q5_0 for test models)."""
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == T.F32:
        return data
    if qtype == T.F16:
        return data.astype(np.float16)
    if qtype in (T.BF16, T.Q8_0, T.Q5_0):
        try:
            return gguf.quants.quantize(data, qtype)
        except Exception as exc:  # gguf raises NotImplementedError/ValueError for unsupported types
            raise DgError(f"cannot quantize to {qtype.name} with this gguf package: {exc}") from None
    raise DgError(f"unsupported tensor type {qtype!r}")


def _nbytes(shape: Sequence[int], qtype) -> int:
    gguf = _gguf()
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    return n // block * type_size


def _byte_shape(shape: Sequence[int], qtype) -> tuple[int, ...]:
    gguf = _gguf()
    return tuple(gguf.quants.quant_shape_to_byte_shape(tuple(shape), qtype))


def _write_streamed(writer, nbytes: int, chunks: Iterable[np.ndarray]) -> None:
    """Write one tensor's data from chunks (same bookkeeping as GGUFWriter.write_tensor_data)."""
    from gguf.gguf_writer import WriterState

    fout = writer.fout[0]
    name = next(iter(writer.tensors[0]))
    info = writer.tensors[0].pop(name)
    if info.nbytes != nbytes:
        raise DgError(f"internal: tensor {name} expects {info.nbytes} bytes, got {nbytes}")
    writer.write_padding(fout, fout.tell())
    written = 0
    for chunk in chunks:
        chunk = np.ascontiguousarray(chunk)
        # through the file object, not ndarray.tofile: a failed write then says why (ENOSPC, EFBIG)
        # instead of numpy's '6144 requested and 1936 written'
        fout.write(chunk.data)
        written += chunk.nbytes
    if written != nbytes:
        raise DgError(f"internal: tensor {name} wrote {written} bytes, expected {nbytes}")
    writer.write_padding(fout, nbytes)
    writer.state = WriterState.WEIGHTS


# A tensor source yields a tensor's float32 data in row-major chunks (whole leading slices).
TensorSource = Callable[[TensorSpec], Iterable[np.ndarray]]
# Raw sources may yield already-encoded chunks for a given storage type (synthetic benchmarks).
RawTensorSource = Callable[[TensorSpec, Any], Iterable[np.ndarray]]


def add_layout_keys(writer, p: LayoutParams, arch: str) -> None:
    """The hyperparameter keys of the published layout (diffusion) or of a stock gemma4 file (AR twin)."""
    writer.add_block_count(p.n_layer)
    writer.add_context_length(p.context_length)
    writer.add_embedding_length(p.n_embd)
    writer.add_feed_forward_length(p.n_ff)
    writer.add_expert_feed_forward_length(p.n_ff_exp)
    writer.add_expert_count(p.n_expert)
    writer.add_expert_used_count(p.n_expert_used)
    writer.add_head_count(p.n_head)
    writer.add_head_count_kv([int(x) for x in p.head_count_kv])
    writer.add_key_length(p.head_dim_full)
    writer.add_value_length(p.head_dim_full)
    writer.add_key_length_swa(p.head_dim_swa)
    writer.add_value_length_swa(p.head_dim_swa)
    writer.add_sliding_window(p.sliding_window)
    writer.add_sliding_window_pattern([bool(x) for x in p.is_swa])
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_layer_norm_rms_eps(p.rms_eps)
    writer.add_rope_freq_base(p.rope_base_full)
    writer.add_rope_freq_base_swa(p.rope_base_swa)
    writer.add_rope_dimension_count(p.head_dim_full)
    writer.add_rope_dimension_count_swa(p.head_dim_swa)
    writer.add_final_logit_softcapping(p.softcap)
    key_of = {"softcap": f"{arch}.final_logit_softcapping"}
    if arch == DIFFUSION_ARCH:
        writer.add_causal_attention(False)
        d = p.diffusion
        writer.add_uint32("diffusion.canvas_length", p.canvas_length)
        for key, name in DIFFUSION_PARAM_KEYS.items():
            # step counts are integers in the published files, temperatures and thresholds floats
            value = getattr(d, name)
            if isinstance(getattr(DiffusionParams(), name), int):
                writer.add_uint32(key, int(value))
            else:
                writer.add_float32(key, float(value))
            key_of[name] = key
    # keys the published converter would leave out: say which so `dg info` can tell
    defaulted = [key_of[name] for name in p.reference_defaults if name in key_of]
    if defaulted:
        writer.add_array(REFERENCE_DEFAULTS_KEY, defaulted)


def write_layout_gguf(out_path: str | Path | OutputFile, p: LayoutParams, arch: str,
                      add_vocab: Callable[[Any], None], source: TensorSource | None = None, outtype: str = "f32",
                      raw_source: RawTensorSource | None = None,
                      storage: Callable[[TensorSpec], Any] | None = None, file_type: int | None = None) -> Path:
    """Write a GGUF in the published layout; tensors are pulled from `source` one at a time.
    `storage(spec)` chooses each tensor's type instead of `outtype` (synthetic quant mixes).
    `file_type` (a gguf.LlamaFileType) is declared as `general.file_type`, as llama.cpp's quantizer
    does in the published quants; None writes no such key, as the published converter does.

    A path is replaced if it exists (pass an OutputFile to refuse that or to protect inputs); the file
    appears only once complete."""
    gguf = _gguf()
    if outtype not in OUTTYPES:
        raise DgError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    p.validate()
    plan = tensor_plan(p, arch)
    out = out_path if isinstance(out_path, OutputFile) else gguf_output(out_path, force=True)
    with writing(out):
        writer = gguf.GGUFWriter(str(out.write_path), arch)
        try:
            add_layout_keys(writer, p, arch)
            if file_type is not None:
                writer.add_file_type(int(file_type))
            add_vocab(writer)
            types = [storage(spec) if storage else storage_type(spec, outtype) for spec in plan]
            for spec, qtype in zip(plan, types):
                writer.add_tensor_info(spec.name, _byte_shape(spec.shape, qtype), np.dtype(np.uint8),
                                       _nbytes(spec.shape, qtype), raw_dtype=qtype)
            writer.write_header_to_file(out.write_path)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for spec, qtype in zip(plan, types):
                if raw_source is not None:
                    chunks = raw_source(spec, qtype)
                else:
                    chunks = (encode_as(c, qtype) for c in _checked_chunks(spec, source(spec)))
                _write_streamed(writer, _nbytes(spec.shape, qtype), chunks)
            writer.close()  # flushes: a full disk may only show here
        except OSError as err:
            raise DgError(f"cannot write {out.path}: {err.strerror or err}") from None
        finally:
            try:
                writer.close()
            except OSError:
                pass  # after an error already raised above
    return out.path


def gguf_output(path: str | Path, *, force: bool, inputs: Sequence[Path] = (), what: str = "output") -> OutputFile:
    """A GGUF output: a regular file only (the writer seeks), checked before any work starts."""
    return OutputFile(path, force=force, inputs=inputs, what=what, binary=True, streams=False)


def _checked_chunks(spec: TensorSpec, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    rows = 0
    for chunk in chunks:
        chunk = np.asarray(chunk, dtype=np.float32)
        if chunk.shape[1:] != spec.shape[1:] and not (len(spec.shape) == 1 and chunk.ndim == 1):
            raise DgError(f"tensor {spec.name}: got shape {chunk.shape}, expected rows of {spec.shape[1:]}")
        rows += chunk.shape[0]
        yield chunk
    if rows != spec.shape[0]:
        raise DgError(f"tensor {spec.name}: got {rows} rows, expected {spec.shape[0]}")


# ---------------------------------------------------------------------------------------------
# Reading a checkpoint (safetensors without torch)
# ---------------------------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
# every dtype of the safetensors format, by its size in bytes (the ones above are the ones we convert)
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entry(path: Path, name: str, info: Any, base: int, size: int) -> tuple[Path, str, tuple[int, ...], int, int]:
    """(file, dtype, shape, byte offset, byte count) of one header entry, after checking that its
    data_offsets hold exactly its shape's bytes inside the file (reversed, negative or shifted
    offsets would give a GGUF of garbage weights)."""
    def bad(why: str) -> DgError:
        return DgError(f"{path.name}: tensor {name} {why}")

    if not isinstance(info, dict):
        raise bad("is not described by a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ST_ITEMSIZE:
        raise bad(f"has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"has an invalid shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad(f"has invalid data_offsets {offsets!r}")
    start, end = offsets
    nbytes = math.prod(shape) * _ST_ITEMSIZE[dtype]
    if end - start != nbytes:
        raise bad(f"has data_offsets {offsets} that do not hold its {dtype} {shape} data ({nbytes} bytes)")
    if base + end > size:
        raise DgError(f"{path.name} is truncated (tensor {name} ends past the file)")
    return path, dtype, tuple(shape), base + start, nbytes


class SafetensorsIndex:
    """Tensors of one or more .safetensors files, read lazily through numpy memmaps."""

    def __init__(self, files: Sequence[Path]):
        self.entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for path in files:
            self._read_header(path)

    def _read_header(self, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise DgError(f"{path.name} is not a safetensors file (too short)")
                n = int.from_bytes(head, "little")
                if n <= 0 or n > 100_000_000:
                    raise DgError(f"{path.name} is not a safetensors file (bad header size)")
                header = json.loads(f.read(n))
            size = path.stat().st_size
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise DgError(f"cannot read {path}: {exc}") from None
        if not isinstance(header, dict):
            raise DgError(f"{path.name} is not a safetensors file (its header is not a JSON object)")
        entries = {name: _tensor_entry(path, name, info, 8 + n, size)
                   for name, info in header.items() if name != "__metadata__"}
        # the format's rule: the tensors' bytes follow each other, no gap, no overlap (a shifted
        # offset would otherwise read its neighbour's bytes as weights)
        end = 0
        for name, (_, _, _, offset, nbytes) in sorted(entries.items(), key=lambda e: (e[1][3], e[1][4])):
            if offset - (8 + n) != end:
                raise DgError(f"{path.name}: tensor {name}'s data_offsets overlap or leave a gap before it")
            end += nbytes
        self.entries.update(entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def load(self, name: str, rows: slice | None = None) -> np.ndarray:
        """float32 copy of a tensor (or of a slice of its leading dimension)."""
        path, dtype, shape, offset, nbytes = self.entries[name]
        if dtype not in _ST_DTYPES:
            raise DgError(f"tensor {name} has unsupported dtype {dtype}")
        np_dtype = _ST_DTYPES[dtype]
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, np.float32)
        mm = np.memmap(path, dtype=np_dtype, mode="r", offset=offset, shape=shape)
        view = mm[rows] if rows is not None else mm
        if dtype == "BF16":
            return (np.asarray(view, dtype=np.uint32) << 16).view(np.float32)
        return np.array(view, dtype=np.float32)


def _checkpoint_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DgError(f"cannot read {index}: {exc}") from None
        shards = weight_map.values() if isinstance(weight_map, dict) else None
        if shards is None or not all(isinstance(f, str) and f and not Path(f).is_absolute()
                                     and ".." not in Path(f).parts for f in shards):
            raise DgError(f"{index.name}: weight_map must map tensor names to shard files of the checkpoint")
        files = sorted({hf_dir / f for f in shards})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DgError(f"checkpoint shard(s) missing: {', '.join(missing)}")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise DgError(f"no .safetensors files in {hf_dir}")
    return files


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise DgError(f"{path.name} is missing from {path.parent}")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DgError(f"cannot read {path.name}: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise DgError(f"{path.name} must hold a JSON object")
    return data


class CheckpointReader:
    """Resolves layout roles to checkpoint tensors, whichever copy of a tied weight was saved."""

    _ENC = ("model.encoder.language_model.", "encoder.language_model.", "model.language_model.")
    _DEC = ("model.decoder.", "decoder.")

    def __init__(self, hf_dir: Path, params: LayoutParams):
        self.params = params
        self.st = SafetensorsIndex(_checkpoint_files(hf_dir))

    def _first(self, candidates: Sequence[str], what: str) -> str:
        for name in candidates:
            if name in self.st:
                return name
        raise DgError(f"checkpoint lacks {what} (looked for {candidates[0]})")

    def _tied(self, suffix: str, what: str) -> str:
        """A weight shared by encoder and decoder: the decoder's copy when saved, else the encoder's."""
        names = [pre + suffix for pre in self._DEC + self._ENC]
        found = [n for n in names if n in self.st]
        if not found:
            raise DgError(f"checkpoint lacks {what} (looked for {names[0]})")
        return found[0]

    def hf_name(self, spec: TensorSpec) -> str:
        i = spec.layer
        if spec.role == "token_embd":
            return self._tied("embed_tokens.weight", "the token embedding") if any(
                pre + "embed_tokens.weight" in self.st for pre in self._DEC + self._ENC) else self._first(
                ["lm_head.weight"], "the token embedding")
        if spec.role == "output_norm":
            return self._tied("norm.weight", "the final norm")
        if spec.role in HF_SELF_COND:
            return self._first([pre + HF_SELF_COND[spec.role] for pre in self._DEC], f"{spec.role} (self-conditioning)")
        if spec.role == "layer_scalar_decoder":
            return self._first([f"{pre}layers.{i}.layer_scalar" for pre in self._DEC], f"decoder layer {i} layer_scalar")
        if spec.role == "layer_scalar_encoder":
            return self._first([f"{pre}layers.{i}.layer_scalar" for pre in self._ENC], f"encoder layer {i} layer_scalar")
        if spec.role in HF_LAYER_SUFFIX:
            return self._tied(f"layers.{i}.{HF_LAYER_SUFFIX[spec.role]}", f"layer {i} {HF_LAYER_SUFFIX[spec.role]}")
        raise DgError(f"internal: no checkpoint mapping for {spec.name}")

    def check_tied_lm_head(self, rows: int = 4096) -> None:
        """An lm_head.weight beside the embedding must be the embedding (the layout has no separate
        LM head: token_embd is it); one that differs would be dropped in silence."""
        if "lm_head.weight" not in self.st:
            return
        embd = self.hf_name(TensorSpec("token_embd.weight", (), "token_embd"))
        if embd == "lm_head.weight":
            return
        if self.st.shape("lm_head.weight") != self.st.shape(embd):
            raise DgError(f"checkpoint has an lm_head.weight of shape {list(self.st.shape('lm_head.weight'))} beside "
                          f"{embd} {list(self.st.shape(embd))}: a separate LM head is not supported (the GGUF "
                          "layout ties it to token_embd)")
        for start in range(0, self.st.shape(embd)[0], rows):
            part = slice(start, start + rows)
            if not np.array_equal(self.st.load("lm_head.weight", part), self.st.load(embd, part), equal_nan=True):
                raise DgError(f"checkpoint has an lm_head.weight that differs from {embd} (from row {start}): "
                              "a separate LM head is not supported (the GGUF layout ties it to token_embd)")

    def chunks(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        if spec.role == "rope_freqs":
            yield self.params.rope_freq_factors()
            return
        name = self.hf_name(spec)
        shape = self.st.shape(name)
        expected = spec.shape
        if spec.role.startswith("layer_scalar") and int(np.prod(shape)) == 1:
            shape = expected
            yield self.st.load(name).reshape(expected)
            return
        if tuple(shape) != tuple(expected):
            raise DgError(f"checkpoint tensor {name} has shape {list(shape)}, expected {list(expected)} from config.json")
        if len(expected) == 3:
            for e in range(expected[0]):  # one expert at a time keeps memory flat
                yield self.st.load(name, slice(e, e + 1))
        else:
            yield self.st.load(name)


# ---------------------------------------------------------------------------------------------
# Tokenizer from tokenizer.json, typed and scored as the published converter does
# ---------------------------------------------------------------------------------------------

# GGUF token types (gguf.TokenType): what llama.cpp turns into token attributes.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
# Every token's score in the published files (llama.cpp's BPE never reads scores, but loads them).
PUBLISHED_TOKEN_SCORE = -1000.0
# Gemma 4 markers that llama.cpp's chat parser reads back from the text, so the published converter
# types them USER_DEFINED: detokenizing always renders them.
GEMMA4_VISIBLE_TOKENS = frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>",
                                   "<|tool_response>", "<tool_response|>", '<|"|>'})
# Transformers' GemmaTokenizer names these special tokens when tokenizer_config.json does not.
GEMMA_NAMED_SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                              "pad_token": "<pad>", "mask_token": "<mask>"}
_EXTRA_SPECIAL_KEYS = ("extra_special_tokens", "additional_special_tokens")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _token_text(entry: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) and entry else None


def special_token_texts(*configs: dict[str, Any]) -> set[str]:
    """The tokens Transformers counts as special (`all_special_tokens`) given tokenizer_config.json and
    special_tokens_map.json: every named `*_token` entry (bos, eos, ..., and model-specific ones such as
    Gemma 4's `sot_token`) and the extra_special_tokens. tokenizer.json's per-token "special" flags
    play no part (Gemma's marks the 256 byte tokens special)."""
    texts: set[str] = set()
    for config in configs:
        for key, value in config.items():
            if key in _EXTRA_SPECIAL_KEYS:
                entries = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
                texts.update(text for text in map(_token_text, entries) if text)
            elif key.endswith("_token") and (text := _token_text(value)):
                texts.add(text)
    for key, text in GEMMA_NAMED_SPECIAL_TOKENS.items():
        if not any(key in config for config in configs):
            texts.add(text)
    return texts


def published_token_types(tokens: Sequence[str | None], special_texts: set[str] | frozenset[str],
                          added_ids: Iterable[int] = ()) -> list[int]:
    """Each token's GGUF type by the published converter's rules (llama.cpp's Gemma4Model.set_vocab over
    gguf.LlamaHfVocab): `<0xXX>` byte-fallback tokens BYTE, so that detokenizing turns them back into
    bytes; Gemma 4's visible markers USER_DEFINED; special tokens CONTROL; tokens added outside the BPE
    vocabulary (`added_ids`) USER_DEFINED; the rest NORMAL. None is an id the tokenizer never produces
    (embedding rows padded to a round size): UNUSED."""
    added = set(added_ids)
    types = []
    for i, text in enumerate(tokens):
        if text is None:
            types.append(TOKEN_UNUSED)
        elif _BYTE_TOKEN.fullmatch(text):
            types.append(TOKEN_BYTE)
        elif text in GEMMA4_VISIBLE_TOKENS:
            types.append(TOKEN_USER_DEFINED)
        elif text in special_texts:
            types.append(TOKEN_CONTROL)
        else:
            types.append(TOKEN_USER_DEFINED if i in added else TOKEN_NORMAL)
    return types


@dataclass
class GgufVocab:
    """The tokenizer.ggml.* keys of a gemma4 vocabulary."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int = 2
    eos_id: int = 1
    unk_id: int = 3
    pad_id: int = 0
    mask_id: int | None = 4
    chat_template: str | None = None

    def add_to_gguf(self, writer) -> None:
        writer.add_tokenizer_model("gemma4")
        writer.add_token_list(self.tokens)
        writer.add_token_scores([PUBLISHED_TOKEN_SCORE] * len(self.tokens))
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        writer.add_unk_token_id(self.unk_id)
        writer.add_pad_token_id(self.pad_id)
        if self.mask_id is not None:
            writer.add_mask_token_id(self.mask_id)
        writer.add_add_space_prefix(False)
        writer.add_add_bos_token(True)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


def _token_id(value: Any, text: str, vocab_size: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DgError(f"tokenizer.json gives token {text!r} the id {value!r} (expected an integer >= 0)")
    if value >= vocab_size:
        raise DgError(f"tokenizer.json has token {text!r} at id {value} but the model's vocab_size is {vocab_size}")
    return value


def _merges_of(model: dict[str, Any]) -> list[str]:
    merges = model.get("merges") or []
    if not isinstance(merges, list):
        raise DgError("tokenizer.json's merges must be a list")
    out = []
    for merge in merges:
        if isinstance(merge, str):
            out.append(merge)
        elif isinstance(merge, list) and len(merge) == 2 and all(isinstance(part, str) for part in merge):
            # llama.cpp splits a merge at its first space: a space inside a part is written as U+0120,
            # as the published converter does
            out.append(" ".join(part.replace(" ", "\u0120") for part in merge))
        else:
            raise DgError(f"tokenizer.json has a malformed merge {merge!r}")
    return out


def vocab_from_hf_dir(hf_dir: Path, vocab_size: int) -> GgufVocab:
    """tokenizer.json (+ tokenizer_config.json, special_tokens_map.json, chat_template.jinja) as gemma4
    GGUF tokenizer keys, each token typed and scored as the published converter does."""
    data = _read_json(hf_dir / "tokenizer.json", required=True)
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise DgError("tokenizer.json must hold a BPE model with a vocab (the gemma4 tokenizer)")
    by_id: dict[int, str] = {}
    for text, idx in model["vocab"].items():
        token = _token_id(idx, text, vocab_size)
        if token in by_id:  # one of the two texts would vanish from the vocabulary
            raise DgError(f"tokenizer.json gives id {token} to both {by_id[token]!r} and {text!r}")
        by_id[token] = text
    bpe_ids = set(by_id)
    added_tokens = data.get("added_tokens") or []
    if not isinstance(added_tokens, list):
        raise DgError("tokenizer.json's added_tokens must be a list")
    for added in added_tokens:
        text = _token_text(added) if isinstance(added, dict) else None
        if text is None:
            raise DgError(f"tokenizer.json has a malformed added token {added!r}")
        by_id[_token_id(added.get("id"), text, vocab_size)] = text
    if not by_id:
        raise DgError("tokenizer.json has an empty vocabulary")
    token_to_id: dict[str, int] = {}
    tokens = []
    for i in range(vocab_size):
        # ids the tokenizer never produces (embedding rows padded to a round size) get llama.cpp's pad names
        text = by_id.get(i, f"[PAD{i}]")
        if text in token_to_id:  # llama.cpp aborts on a vocabulary with a repeated text
            raise DgError(f"tokenizer.json has token {text!r} twice (ids {token_to_id[text]} and {i})")
        token_to_id[text] = i
        tokens.append(text)

    config = _read_json(hf_dir / "tokenizer_config.json", required=False) or {}
    special_map = _read_json(hf_dir / "special_tokens_map.json", required=False) or {}
    types = published_token_types([by_id.get(i) for i in range(vocab_size)],
                                  special_token_texts(config, special_map), set(by_id) - bpe_ids)

    def special_id(key: str, default: int | None) -> int | None:
        text = _token_text(config.get(key))
        if text is None:
            return default
        if text not in token_to_id:  # the default id would be some other token's
            raise DgError(f"tokenizer_config.json names {key} {text!r}, which tokenizer.json does not have")
        return token_to_id[text]

    template = config.get("chat_template")
    jinja_file = hf_dir / "chat_template.jinja"
    if not template and jinja_file.is_file():
        try:
            template = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DgError(f"cannot read {jinja_file.name}: {exc}") from None
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise DgError(f"tokenizer_config.json: chat_template must be text, not {type(template).__name__}")
    return GgufVocab(tokens=tokens, token_types=types, merges=_merges_of(model),
                     bos_id=special_id("bos_token", 2), eos_id=special_id("eos_token", 1),
                     unk_id=special_id("unk_token", 3), pad_id=special_id("pad_token", 0),
                     mask_id=special_id("mask_token", 4 if vocab_size > 4 else None),
                     chat_template=template)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def read_checkpoint_params(hf_dir: str | Path) -> LayoutParams:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise DgError(f"checkpoint directory {hf_dir} does not exist")
    config = _read_json(hf_dir / "config.json", required=True)
    generation = _read_json(hf_dir / "generation_config.json", required=False)
    return params_from_hf_config(config, generation)


# what a conversion reads besides the safetensors shards: never an output
CHECKPOINT_TEXT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                         "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json")


def checkpoint_inputs(hf_dir: str | Path) -> list[Path]:
    """Every file a conversion of `hf_dir` reads (those that exist)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        return []
    try:
        shards = _checkpoint_files(hf_dir)
    except DgError:
        shards = sorted(hf_dir.glob("*.safetensors"))
    return shards + [hf_dir / name for name in CHECKPOINT_TEXT_FILES if (hf_dir / name).is_file()]


def convert_checkpoint(hf_dir: str | Path, out_path: str | Path | OutputFile, outtype: str = "f32",
                       arch: str = DIFFUSION_ARCH) -> Path:
    """Convert an HF DiffusionGemma checkpoint dir to a GGUF (arch "diffusion-gemma" or the AR twin "gemma4").

    A path is replaced if it exists, but never when it is one of the checkpoint's own files."""
    if outtype not in OUTTYPES:
        raise DgError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    if arch not in (DIFFUSION_ARCH, AR_ARCH):
        raise DgError(f"unknown architecture {arch!r} (expected {DIFFUSION_ARCH!r} or {AR_ARCH!r})")
    hf_dir = Path(hf_dir)
    out = out_path if isinstance(out_path, OutputFile) else gguf_output(out_path, force=True,
                                                                        inputs=checkpoint_inputs(hf_dir))
    params = read_checkpoint_params(hf_dir)
    vocab = vocab_from_hf_dir(hf_dir, params.vocab_size)
    reader = CheckpointReader(hf_dir, params)
    plan = tensor_plan(params, arch)
    for spec in plan:  # fail before writing anything if a tensor is missing
        if spec.role != "rope_freqs":
            reader.hf_name(spec)
    reader.check_tied_lm_head()
    return write_layout_gguf(out, params, arch, vocab.add_to_gguf, reader.chunks, outtype)


def _check_not_a_checkpoint_name(hf_dir: str | Path, path: Path, what: str) -> None:
    """A GGUF written into the checkpoint under a name a conversion reads (x.safetensors, and a text
    file it does not have yet, chat_template.jinja) would make the checkpoint fail to convert next time."""
    if not (path.suffix == ".safetensors" or path.name in CHECKPOINT_TEXT_FILES):
        return
    try:
        inside = path.absolute().parent.resolve() == Path(hf_dir).resolve()
    except OSError:
        return
    if inside:
        raise DgError(f"cannot write {what} {path}: a conversion of {hf_dir} reads that name as part of the "
                      "checkpoint (give the GGUF a .gguf name, or write it elsewhere)")


def convert_main(hf_dir: str | Path, out_path: str | Path, outtype: str = "bf16",
                 ar_twin: str | Path | None = None, echo: Callable[[str], None] | None = None,
                 force: bool = False) -> list[Path]:
    """`dg convert HF_DIR OUT.gguf [--outtype f32|f16|bf16|q8_0] [--ar-twin OUT2.gguf] [--force]`.

    Both outputs are checked before converting: never one of the checkpoint's files, never each
    other, an existing file only with `force`."""
    say = echo or (lambda _msg: None)
    inputs = checkpoint_inputs(hf_dir)
    outs = [gguf_output(out_path, force=force, inputs=inputs, what="OUT")]
    if ar_twin is not None:
        outs.append(gguf_output(ar_twin, force=force, inputs=inputs, what="--ar-twin"))
    check_distinct(outs)
    for path, what in ((out_path, "OUT"), (ar_twin, "--ar-twin")):  # after the checks of existing inputs
        if path is not None:
            _check_not_a_checkpoint_name(hf_dir, Path(path), what)
    written = [convert_checkpoint(hf_dir, outs[0], outtype, DIFFUSION_ARCH)]
    say(f"wrote {written[-1]} ({DIFFUSION_ARCH}, {outtype}, {format_bytes(written[-1].stat().st_size)})")
    if ar_twin is not None:
        written.append(convert_checkpoint(hf_dir, outs[1], outtype, AR_ARCH))
        say(f"wrote {written[-1]} ({AR_ARCH} AR twin, {outtype}, {format_bytes(written[-1].stat().st_size)})")
    return written
