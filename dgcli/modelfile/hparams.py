"""Every hyperparameter the Gemma 4 family's loaders read, checked before llama.cpp sees the file.

llama.cpp trusts its files: a block_count of 0, a rope dimension of 63, an epsilon of NaN, two
identical vocabulary entries or a head count that does not divide abort the process (GGML_ASSERT
and a native backtrace) or, for rope.dimension_count = 0, loop forever. `check_model_header`
refuses such a file with one line naming the key, its value and what it must be. It covers both
architectures dg loads: `diffusion-gemma` (our loader, native/patch/src/models/diffusion-gemma.cpp,
which repeats the checks for C++ callers) and the stock `gemma4` (the AR side, where Python is the
only guard). Values are checked as llama.cpp will use them, defaults included (a missing
rope.dimension_count_swa inherits rope.dimension_count, for instance).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dgcli.errors import InvalidParameter, ModelLoadError
from dgcli.modelfile.header import FLOAT_TYPE_NAMES, INTEGER_TYPE_NAMES, GgufHeader
from dgcli.params import DIFFUSION_PARAM_KEYS, MAX_CANVAS_LENGTH, DiffusionParams

DIFFUSION_ARCH = "diffusion-gemma"
AR_ARCH = "gemma4"

LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
# generous bounds on sizes no Gemma is near (26B: hidden 2816, heads 16, head dim 512, window 1024)
MAX_EMBEDDING = 1 << 16
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_FFN = 1 << 20
MAX_SLIDING_WINDOW = 1 << 24
MAX_EPSILON = 1.0
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
SPECIAL_TOKEN_KEYS = ("bos", "eos", "unknown", "padding", "mask", "eot", "eom", "seperator")


class BadHyperparameter(ModelLoadError):
    pass


class _Checker:
    def __init__(self, header: GgufHeader):
        self.h = header
        self.arch = header.architecture or ""

    def fail(self, key: str, value: Any, allowed: str) -> BadHyperparameter:
        shown = value if not isinstance(value, float) else f"{value:g}"
        return BadHyperparameter(f"{self.h.path}: bad hyperparameter {key} = {shown}: must be {allowed}")

    def missing(self, key: str) -> BadHyperparameter:
        return BadHyperparameter(f"{self.h.path}: required key {key} is missing")

    # -- typed reads

    def integer(self, key: str, lo: int, hi: int, *, default: int | None = None, what: str = "") -> int:
        if key not in self.h.metadata:
            if default is None:
                raise self.missing(key)
            return default
        vtype, value = self.h.metadata[key]
        if vtype not in INTEGER_TYPE_NAMES:
            raise self.fail(key, f"({vtype})", f"an integer {what or f'in [{lo}, {hi}]'}")
        if not lo <= value <= hi:
            raise self.fail(key, value, what or f"in [{lo}, {hi}]")
        return value

    def real(self, key: str, ok, allowed: str, *, default: float | None = None) -> float:
        if key not in self.h.metadata:
            if default is None:
                raise self.missing(key)
            return default
        vtype, value = self.h.metadata[key]
        if vtype not in FLOAT_TYPE_NAMES and vtype not in INTEGER_TYPE_NAMES:
            raise self.fail(key, f"({vtype})", "a number " + allowed)
        if not math.isfinite(value) or not ok(value):
            raise self.fail(key, value, allowed)
        return float(value)

    def per_layer(self, key: str, n_layer: int, lo: int, hi: int, *, default: list[int] | None = None,
                  what: str = "") -> list[int]:
        """A scalar or one value per layer (llama.cpp's get_key_or_arr)."""
        if key in self.h.arrays:
            etype, length = self.h.arrays[key]
            if length != n_layer:
                raise self.fail(key, f"an array of {length}", f"one value per layer ({n_layer})")
            if etype not in INTEGER_TYPE_NAMES:
                raise self.fail(key, f"an array of {etype}", "integers")
            values = self.h.get(key)
            for il, v in enumerate(values):
                if not lo <= v <= hi:
                    raise self.fail(f"{key}[{il}]", v, what or f"in [{lo}, {hi}]")
            return list(values)
        if key not in self.h.metadata and default is not None:
            return default
        return [self.integer(key, lo, hi, what=what)] * n_layer

    # -- the checks

    def run(self) -> None:
        if self.arch not in (DIFFUSION_ARCH, AR_ARCH):
            return  # not a file dg loads; the caller names the architecture it wanted
        n_layer, n_embd = self.check_sizes()
        self.check_experts(n_layer)
        self.check_attention(n_layer, n_embd)
        self.check_norms_and_rope_bases()
        self.check_tokenizer()
        self.check_vector_types()
        if self.arch == DIFFUSION_ARCH:
            self.check_diffusion()

    def check_sizes(self) -> tuple[int, int]:
        k = self.h.arch_key
        n_layer = self.integer(k("block_count"), 1, LLAMA_MAX_LAYERS)
        self.integer(k("context_length"), 1, 2**31 - 1)  # llama.cpp hands it out as an int32
        n_embd = self.integer(k("embedding_length"), 1, MAX_EMBEDDING)
        embd = self.h.tensor("token_embd.weight")
        if embd is not None and (len(embd.shape) != 2 or embd.shape[0] != n_embd):
            raise self.fail(k("embedding_length"), n_embd,
                            f"the row length of token_embd.weight (shape {list(embd.shape)})")
        self.per_layer(k("feed_forward_length"), n_layer, 1, MAX_FFN)
        self.integer(k("nextn_predict_layers"), 0, n_layer, default=0, what=f"at most block_count ({n_layer})")
        per_layer_input = self.integer(k("embedding_length_per_layer_input"), 0, MAX_EMBEDDING,
                                       default=0 if self.arch == DIFFUSION_ARCH else None)
        if self.arch == DIFFUSION_ARCH and per_layer_input:
            raise self.fail(k("embedding_length_per_layer_input"), per_layer_input, "0 (DiffusionGemma has none)")
        return n_layer, n_embd

    def check_experts(self, n_layer: int) -> None:
        k = self.h.arch_key
        n_expert = self.integer(k("expert_count"), 1 if self.arch == DIFFUSION_ARCH else 0, LLAMA_MAX_EXPERTS,
                                default=0 if self.arch == AR_ARCH else None)
        # expert groups (DeepSeek's routing; no Gemma has them): what llama.cpp's loader asserts
        groups = self.integer(k("expert_group_count"), 0, max(n_expert - 1, 0), default=0,
                              what=f"less than expert_count ({n_expert})" if n_expert else "0 (expert_count is 0)")
        if groups > 1:
            self.integer(k("expert_group_used_count"), 1, groups - 1, what=f"in [1, expert_group_count = {groups})")
            if n_expert % groups:
                raise self.fail(k("expert_group_count"), groups, f"a divisor of expert_count ({n_expert})")
        if n_expert:
            self.per_layer(k("expert_used_count"), n_layer, 1, n_expert, what=f"in [1, expert_count = {n_expert}]")
            self.integer(k("expert_feed_forward_length"), 1, MAX_FFN)
        else:
            self.per_layer(k("expert_used_count"), n_layer, 0, 0, default=[0] * n_layer,
                           what="0 (expert_count is 0)")

    def check_attention(self, n_layer: int, n_embd: int) -> None:
        k = self.h.arch_key
        n_head = self.per_layer(k("attention.head_count"), n_layer, 1, MAX_HEADS)
        n_head_kv = self.per_layer(k("attention.head_count_kv"), n_layer, 1, MAX_HEADS, default=n_head)
        for il, (q, kv) in enumerate(zip(n_head, n_head_kv)):
            if q % kv:
                raise self.fail(k("attention.head_count_kv") + f"[{il}]", kv,
                                f"a divisor of attention.head_count ({q}) for grouped-query attention")

        # head sizes: full layers (key_length / value_length), sliding layers (the _swa keys)
        head_default = n_embd // n_head[0]
        head = self.integer(k("attention.key_length"), 2, MAX_HEAD_DIM, default=head_default)
        head_v = self.integer(k("attention.value_length"), 1, MAX_HEAD_DIM, default=head_default)
        head_swa = self.integer(k("attention.key_length_swa"), 2, MAX_HEAD_DIM)
        head_v_swa = self.integer(k("attention.value_length_swa"), 1, MAX_HEAD_DIM)
        if head_v != head:
            raise self.fail(k("attention.value_length"), head_v, f"equal to attention.key_length ({head})")
        if head_v_swa != head_swa:
            raise self.fail(k("attention.value_length_swa"), head_v_swa,
                            f"equal to attention.key_length_swa ({head_swa})")
        for key, size in (("attention.key_length", head), ("attention.key_length_swa", head_swa)):
            if size % 2:
                raise self.fail(k(key), size, "even (rope rotates pairs)")

        # rope: an even number of dimensions, at most the head size (0 loops forever in ggml)
        n_rot = self.integer(k("rope.dimension_count"), 0, 2**32 - 1, default=head)
        if not (2 <= n_rot <= head and n_rot % 2 == 0):
            raise self.fail(k("rope.dimension_count"), n_rot, f"even, between 2 and the head size ({head})")
        n_rot_swa = self.integer(k("rope.dimension_count_swa"), 0, 2**32 - 1, default=n_rot)
        if not (2 <= n_rot_swa <= head_swa and n_rot_swa % 2 == 0):
            raise self.fail(k("rope.dimension_count_swa"), n_rot_swa,
                            f"even, between 2 and the sliding layers' head size ({head_swa})")

        self.integer(k("attention.sliding_window"), 1, MAX_SLIDING_WINDOW)
        pattern = self.sliding_pattern(n_layer)
        self.check_shared_kv(n_layer, pattern)

    def check_norms_and_rope_bases(self) -> None:
        k = self.h.arch_key
        scaling = self.h.get(k("rope.scaling.type"), "linear")
        if k("rope.scaling.type") in self.h.metadata and scaling not in ROPE_SCALING_TYPES:
            raise self.fail(k("rope.scaling.type"), repr(scaling), "one of " + ", ".join(ROPE_SCALING_TYPES))
        for key in ("rope.scaling.factor", "rope.scale_linear"):
            self.real(k(key), lambda v: v >= 0, "finite and >= 0 (0 = no scaling)", default=0.0)
        positive = "finite and > 0"
        self.real(k("rope.freq_base"), lambda v: v > 0, positive, default=10000.0)
        self.real(k("rope.freq_base_swa"), lambda v: v > 0, positive, default=10000.0)
        self.real(k("attention.layer_norm_rms_epsilon"), lambda v: 0 < v < MAX_EPSILON,
                  f"finite, > 0 and < {MAX_EPSILON:g}")
        self.real(k("final_logit_softcapping"), lambda v: v >= 0, "finite and >= 0 (0 = no softcap)", default=0.0)

    def sliding_pattern(self, n_layer: int) -> list[bool]:
        key = self.h.arch_key("attention.sliding_window_pattern")
        if key not in self.h.arrays:
            raise self.missing(key) if key not in self.h.metadata else self.fail(
                key, f"({self.h.type_of(key)})", "an array of one bool per layer")
        etype, length = self.h.arrays[key]
        if etype not in ("bool", "int32", "uint32") or length != n_layer:
            raise self.fail(key, f"an array of {length} {etype}", f"an array of one bool per layer ({n_layer})")
        pattern = [bool(v) for v in self.h.get(key)]
        # both architectures build a sliding + full (iSWA) cache; stock gemma4 aborts without a sliding layer
        if not any(pattern):
            raise BadHyperparameter(f"{self.h.path}: bad hyperparameter {key}: the pattern has no sliding layer; "
                                    "at least one is needed (the KV cache is iSWA)")
        return pattern

    def check_shared_kv(self, n_layer: int, pattern: list[bool]) -> None:
        key = self.h.arch_key("attention.shared_kv_layers")
        if self.arch == DIFFUSION_ARCH:
            self.integer(key, 0, 0, default=0, what="0 (DiffusionGemma shares no KV layers)")
            return
        shared = self.integer(key, 0, n_layer - 1, default=0, what=f"less than block_count ({n_layer})")
        # a layer past the first n_layer - shared reuses the cache of an earlier layer of its kind
        own = pattern[:n_layer - shared]
        for il in range(n_layer - shared, n_layer):
            if pattern[il] not in own:
                kind = "sliding" if pattern[il] else "full"
                raise self.fail(key, shared, f"such that layer {il} ({kind}) has an earlier {kind} layer "
                                             "whose KV cache it can share")

    def check_tokenizer(self) -> None:
        h = self.h
        model = h.get("tokenizer.ggml.model")
        if model is None:
            raise self.missing("tokenizer.ggml.model")
        if model != "gemma4":
            raise self.fail("tokenizer.ggml.model", repr(model), "'gemma4' (the Gemma 4 vocabulary dg runs)")
        n_vocab = h.n_vocab
        if n_vocab is None:
            raise self.missing("tokenizer.ggml.tokens") if "tokenizer.ggml.tokens" not in h.metadata else self.fail(
                "tokenizer.ggml.tokens", f"({h.type_of('tokenizer.ggml.tokens')})", "an array of strings")
        if n_vocab < 1 or n_vocab >= 2**31:
            raise self.fail("tokenizer.ggml.tokens", f"{n_vocab} tokens", "between 1 and 2^31 - 1 tokens")
        embd = h.tensor("token_embd.weight")
        if embd is not None and len(embd.shape) == 2 and embd.shape[1] != n_vocab:
            raise self.fail("tokenizer.ggml.tokens", f"{n_vocab} tokens",
                            f"as many as token_embd.weight has rows ({embd.shape[1]})")
        if h.duplicate_token is not None:
            text, first, second = h.duplicate_token
            raise self.fail("tokenizer.ggml.tokens", f"a vocabulary where ids {first} and {second} are both {text[:40]!r}",
                            "a vocabulary of distinct texts")
        for key, etypes in (("tokenizer.ggml.scores", ("float32", "int32")), ("tokenizer.ggml.token_type", ("int32",)),
                            ("tokenizer.ggml.merges", ("string",))):
            if key not in h.metadata:
                if key == "tokenizer.ggml.merges":
                    raise self.missing(key)
                continue
            etype, length = h.arrays.get(key, (h.type_of(key), -1))
            if etype not in etypes or (key != "tokenizer.ggml.merges" and length < n_vocab):
                raise self.fail(key, f"an array of {length} {etype}" if length >= 0 else f"({etype})",
                                f"an array of {' or '.join(etypes)}"
                                + ("" if key == "tokenizer.ggml.merges" else f" with one entry per token ({n_vocab})"))
        for name in SPECIAL_TOKEN_KEYS:
            key = f"tokenizer.ggml.{name}_token_id"
            # llama.cpp forces add_bos for Gemma 4: without a valid <bos> every tokenization aborts
            required = name == "bos"
            self.integer(key, 0, n_vocab - 1, default=None if required else -1,
                         what=f"in [0, {n_vocab}): a token id (the vocabulary has {n_vocab} tokens)")
        template = "tokenizer.chat_template"
        if template in h.metadata and h.type_of(template) != "string":
            raise self.fail(template, f"({h.type_of(template)})", "a string (a Jinja template)")

    def check_vector_types(self) -> None:
        # norms, scales and rope_freqs are multiplied in as they are: ggml's CPU kernels (and rope's
        # frequency factors) take them only as F32 and abort on anything else. Every converter keeps
        # one-dimensional tensors F32, and llama.cpp's quantizer never touches them.
        for t in self.h.tensors:
            dims = list(t.shape)
            while len(dims) > 1 and dims[-1] == 1:
                dims.pop()
            if len(dims) == 1 and t.type_name != "F32":
                raise BadHyperparameter(f"{self.h.path}: tensor {t.name} is stored as {t.type_name}; a one-dimensional "
                                        "tensor (a norm, a scale, rope_freqs) must be F32")

    def check_diffusion(self) -> None:
        n_ctx_train = self.h.arch("context_length")
        canvas = self.integer("diffusion.canvas_length", 1, MAX_CANVAS_LENGTH)
        if canvas >= n_ctx_train:
            raise self.fail("diffusion.canvas_length", canvas,
                            f"less than the context length ({self.h.arch_key('context_length')} = {n_ctx_train})")
        try:
            sampler_defaults(self.h).validate(canvas_length=canvas)
        except InvalidParameter as err:
            key = next(k for k, name in DIFFUSION_PARAM_KEYS.items() if name == err.name)
            raise self.fail(key, err.value, err.allowed) from None


def sampler_defaults(header: GgufHeader) -> DiffusionParams:
    """The sampler's defaults from a diffusion GGUF's `diffusion.eb_*` keys (unvalidated), the
    reference's for keys the file does not have. ModelLoadError for a key of a non-numeric type."""
    values: dict[str, Any] = {}
    for key, name in DIFFUSION_PARAM_KEYS.items():
        if key not in header.metadata:
            continue
        vtype, value = header.metadata[key]
        integral = name in ("max_denoising_steps", "stability_threshold")
        if vtype not in INTEGER_TYPE_NAMES and vtype not in FLOAT_TYPE_NAMES:
            raise BadHyperparameter(f"{header.path}: bad hyperparameter {key} = ({vtype}): must be a number")
        if integral and vtype in FLOAT_TYPE_NAMES:
            if not (math.isfinite(value) and value == int(value)):
                raise BadHyperparameter(f"{header.path}: bad hyperparameter {key} = {value:g}: must be an integer")
            value = int(value)
        elif not integral and vtype == "float32":
            # the float32's shortest decimal (0.4, not 0.4000000059604645): what the writer meant
            value = float(str(np.float32(value)))
        values[name] = value
    return DiffusionParams(**values)


def check_model_header(header: GgufHeader) -> GgufHeader:
    """Raise BadHyperparameter (a ModelLoadError) naming the first value llama.cpp cannot take."""
    _Checker(header).run()
    return header
