"""Malformed GGUFs made from the shipped demo pair, reproducible from (seed, index).

Categories:
  truncate     the file cut short: inside the header (mostly) or inside the tensor data
  byteflip     1-8 random bytes XOR-ed: in the header (mostly) or in the weights
  huge-count   one length/count/dimension/offset field of the header set to an impossible value
  wrong-type   a key's type id rewritten in place (the value then misparses), or the key
               re-encoded properly with another type (block_count as a string, tokens as ints, ...)
  hparam       well-formed files whose values are wrong: every hyperparameter the architecture
               reads set to 0, odd, huge, NaN, negative or inconsistent; vocabularies of identical
               tokens; special token ids outside the vocabulary; hostile chat templates; sampler
               keys (diffusion.eb_*) that run away; tensors of the wrong type or shape
"""

from __future__ import annotations

import copy
import math
import random
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from gguf_codec import (ARRAY, BOOL, F32, F64, I32, I64, INTEGER_TYPES, STRING, U8, U16, U32, U64,
                        Gguf, Kv, parse, serialize)

CATEGORIES = ("truncate", "byteflip", "huge-count", "wrong-type", "hparam")
# how often each category is drawn (the named hyperparameter edits come first, whatever the count)
CATEGORY_WEIGHTS = {"truncate": 0.15, "byteflip": 0.2, "huge-count": 0.2, "wrong-type": 0.15, "hparam": 0.3}

HUGE_U64 = (2**64 - 1, 2**63, 2**62 + 7, 2**40, 2**32 + 1, 2**32 - 1, 2**31, 10**12, 10**9, 1 << 24)
HUGE_U32 = (2**32 - 1, 2**31, 2**31 - 1, 10**9, 1 << 24, 1 << 20, 65537)


@dataclass
class Mutant:
    index: int
    category: str
    base: str  # "diffusion" | "ar"
    description: str
    data: bytes


# -- well-formed edits ----------------------------------------------------------------------------

# hyperparameters (prefixed by the architecture) and the values worth trying on each
ARCH_INT_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
                 "expert_feed_forward_length", "expert_count", "expert_used_count", "attention.head_count",
                 "attention.key_length", "attention.value_length", "attention.key_length_swa",
                 "attention.value_length_swa", "attention.sliding_window", "attention.shared_kv_layers",
                 "embedding_length_per_layer_input", "rope.dimension_count", "rope.dimension_count_swa")
ARCH_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa",
                   "final_logit_softcapping")
DIFFUSION_INT_KEYS = ("diffusion.canvas_length", "diffusion.eb_max_steps", "diffusion.eb_stability_threshold")
DIFFUSION_FLOAT_KEYS = ("diffusion.eb_t_min", "diffusion.eb_t_max", "diffusion.eb_entropy_bound",
                        "diffusion.eb_confidence_threshold")
TOKEN_ID_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                 "tokenizer.ggml.padding_token_id", "tokenizer.ggml.mask_token_id")
FLOAT_VALUES = (math.nan, math.inf, -math.inf, -1.0, 0.0, 1e30, 1e-45, -1e-6, 3.4e38)

HOSTILE_TEMPLATES = {
    "output of 10 GB": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "10^10 empty iterations": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string doubled 40 times": "{% set ns = namespace(s='xy') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                               "{% endfor %}{{ ns.s|length }}",
    "center(10^10)": "{{ 'x'|center(10000000000) }}",
    "syntax error": "{% for m in messages %}{{ m['content'] }",
    "raise_exception": "{{ raise_exception('this template refuses') }}",
    "undefined attribute chain": "{{ foo.bar.baz() }}",
    "sandbox escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "empty": "",
    "only whitespace": "   \n  ",
    "10^6 control tokens": "{% for i in range(1000000) %}<|turn>{% endfor %}",
    "number power": "{{ 10 ** 10 ** 8 }}",
    "list repetition": "{{ ([1] * 100000) * 100000 }}",
    "format width": "{{ '%10000000000d'|format(1) }}",
}


def _prefix(g: Gguf) -> str:
    return g.architecture or "diffusion-gemma"


def _int_value(kv: Kv | None, default: int) -> int:
    return kv.value if kv is not None and kv.vtype in INTEGER_TYPES else default


def named_edits(base: str) -> list[tuple[str, Callable[[Gguf], None]]]:
    """The hyperparameter edits every fuzz run includes (each issue-9 reproducer among them)."""
    edits: list[tuple[str, Callable[[Gguf], None]]] = []

    def add(name: str):
        def register(fn: Callable[[Gguf], None]) -> Callable[[Gguf], None]:
            edits.append((name, fn))
            return fn
        return register

    def set_arch(key: str, vtype: int, value: Any) -> Callable[[Gguf], None]:
        return lambda g: g.set(f"{_prefix(g)}.{key}", vtype, value)

    for key, values in {
        "block_count": (0, 1, 5, 7, 513, 2**32 - 1),
        "expert_count": (0, 1, 513, 2**31),
        "expert_used_count": (0, 3, 5, 600),
        "attention.head_count": (0, 3, 1 << 20),
        "attention.key_length": (0, 63, 32, 1 << 20),
        "attention.value_length": (0, 32, 63, 128, 1 << 20),
        "attention.key_length_swa": (0, 64, 31),
        "attention.value_length_swa": (0, 64, 31, 16),
        "rope.dimension_count": (0, 1, 63, 62, 66, 128, 2**31),
        "rope.dimension_count_swa": (0, 31, 34, 2**31),
        "attention.sliding_window": (0, 1, 2**31, 2**32 - 1),
        "attention.shared_kv_layers": (1, 5, 6, 7, 2**32 - 1),
        "embedding_length": (0, 63, 65, 2**32 - 1),
        "feed_forward_length": (0, 1, 2**32 - 1),
        "expert_feed_forward_length": (0, 31, 2**32 - 1),
        "context_length": (0, 1, 2**32 - 1),
        "embedding_length_per_layer_input": (8,),
    }.items():
        for value in values:
            add(f"{key} = {value}")(set_arch(key, U32, value))
    for key in ARCH_FLOAT_KEYS:
        for value in (math.nan, -1.0, 0.0, math.inf, 1e30):
            add(f"{key} = {value}")(set_arch(key, F32, value))
    for key in ("block_count", "embedding_length", "attention.head_count", "attention.key_length",
                "attention.sliding_window", "attention.sliding_window_pattern", "attention.head_count_kv",
                "attention.layer_norm_rms_epsilon", "expert_count", "feed_forward_length", "context_length"):
        add(f"{key} removed")(lambda g, key=key: g.remove(f"{_prefix(g)}.{key}"))

    add("head_count_kv = [0]*6")(set_arch("attention.head_count_kv", ARRAY, (I32, [0] * 6)))
    add("head_count_kv = [3]*6 (does not divide head_count 4)")(set_arch("attention.head_count_kv", ARRAY, (I32, [3] * 6)))
    add("head_count_kv = [-1]*6")(set_arch("attention.head_count_kv", ARRAY, (I32, [-1] * 6)))
    add("head_count_kv has 5 entries")(set_arch("attention.head_count_kv", ARRAY, (I32, [2] * 5)))
    add("head_count_kv has 513 entries")(set_arch("attention.head_count_kv", ARRAY, (I32, [2] * 513)))
    add("head_count_kv = [8]*6 (more than head_count)")(set_arch("attention.head_count_kv", ARRAY, (I32, [8] * 6)))
    add("head_count_kv = scalar 2^31")(set_arch("attention.head_count_kv", U32, 2**31))
    add("sliding_window_pattern all full")(set_arch("attention.sliding_window_pattern", ARRAY, (BOOL, [False] * 6)))
    add("sliding_window_pattern all sliding")(set_arch("attention.sliding_window_pattern", ARRAY, (BOOL, [True] * 6)))
    add("sliding_window_pattern has 5 entries")(set_arch("attention.sliding_window_pattern", ARRAY, (BOOL, [True] * 5)))
    add("sliding_window_pattern has 600 entries")(set_arch("attention.sliding_window_pattern", ARRAY, (BOOL, [True] * 600)))
    add("sliding_window_pattern of ints 7")(set_arch("attention.sliding_window_pattern", ARRAY, (U8, [7] * 6)))
    # keys the Gemma files do not have, which llama.cpp's generic loader asserts on
    add("rope.scaling.type bogus")(set_arch("rope.scaling.type", STRING, b"bogus"))
    add("rope.scaling.factor NaN")(set_arch("rope.scaling.factor", F32, math.nan))
    add("rope.scaling.factor -1")(set_arch("rope.scaling.factor", F32, -1.0))
    add("expert_group_count = expert_count")(lambda g: g.set(f"{_prefix(g)}.expert_group_count", U32,
                                                             _int_value(g.get(f"{_prefix(g)}.expert_count"), 4)))
    add("expert_group_count 3 (does not divide)")(set_arch("expert_group_count", U32, 3))
    add("expert_group_count 2, used 0")(lambda g: (g.set(f"{_prefix(g)}.expert_group_count", U32, 2),
                                                   g.set(f"{_prefix(g)}.expert_group_used_count", U32, 0)))
    add("nextn_predict_layers > block_count")(set_arch("nextn_predict_layers", U32, 7))
    add("alignment as uint64")(lambda g: g.set("general.alignment", U64, 32))
    add("expert_used_count > expert_count")(lambda g: (g.set(f"{_prefix(g)}.expert_count", U32, 2),
                                                       g.set(f"{_prefix(g)}.expert_used_count", U32, 4)))
    add("feed_forward_length as per-layer array of 5")(set_arch("feed_forward_length", ARRAY, (U32, [128] * 5)))
    add("expert_used_count as per-layer array with a 0")(set_arch("expert_used_count", ARRAY, (U32, [2, 2, 0, 2, 2, 2])))
    add("head_count as per-layer array with a 0")(set_arch("attention.head_count", ARRAY, (U32, [4, 4, 0, 4, 4, 4])))

    # vocabulary
    def tokens(g: Gguf) -> list[bytes]:
        return g.get("tokenizer.ggml.tokens").value[1]

    def set_tokens(g: Gguf, toks: list[bytes]) -> None:
        g.set("tokenizer.ggml.tokens", ARRAY, (STRING, toks))

    add("500 identical tokens")(lambda g: set_tokens(g, [b"a"] * len(tokens(g))))
    add("two identical tokens")(lambda g: set_tokens(g, tokens(g)[:-1] + [tokens(g)[-2]]))
    add("empty tokens")(lambda g: set_tokens(g, [b""] * len(tokens(g))))
    add("one token fewer than the embedding")(lambda g: set_tokens(g, tokens(g)[:-1]))
    add("one token more than the embedding")(lambda g: set_tokens(g, tokens(g) + [b"<extra>"]))
    add("a single token")(lambda g: set_tokens(g, tokens(g)[:1]))
    add("no tokens")(lambda g: set_tokens(g, []))
    add("invalid UTF-8 tokens")(lambda g: set_tokens(g, [t + b"\xff\xfe" for t in tokens(g)]))
    add("tokens removed")(lambda g: g.remove("tokenizer.ggml.tokens"))
    add("scores shorter than tokens")(lambda g: g.set("tokenizer.ggml.scores", ARRAY, (F32, [0.0] * 10)))
    add("token_type shorter than tokens")(lambda g: g.set("tokenizer.ggml.token_type", ARRAY, (I32, [1] * 10)))
    add("token_type all 99")(lambda g: g.set("tokenizer.ggml.token_type", ARRAY, (I32, [99] * len(tokens(g)))))
    add("token_type all control")(lambda g: g.set("tokenizer.ggml.token_type", ARRAY, (I32, [3] * len(tokens(g)))))
    add("token_type all byte")(lambda g: g.set("tokenizer.ggml.token_type", ARRAY, (I32, [6] * len(tokens(g)))))
    add("merges removed")(lambda g: g.remove("tokenizer.ggml.merges"))
    add("merges without a space")(lambda g: g.set("tokenizer.ggml.merges", ARRAY, (STRING, [b"ab"] * 4)))
    add("merges of unknown tokens")(lambda g: g.set("tokenizer.ggml.merges", ARRAY, (STRING, [b"\xe4\xb8\xad \xe6\x96\x87"])))
    add("merges with three spaces")(lambda g: g.set("tokenizer.ggml.merges", ARRAY, (STRING, [b"a b c d"])))
    add("tokenizer model llama")(lambda g: g.set("tokenizer.ggml.model", STRING, b"llama"))
    add("tokenizer model bogus")(lambda g: g.set("tokenizer.ggml.model", STRING, b"bogus"))
    add("tokenizer model none")(lambda g: g.set("tokenizer.ggml.model", STRING, b"none"))
    add("add_bos_token false")(lambda g: g.set("tokenizer.ggml.add_bos_token", BOOL, False))
    for key in TOKEN_ID_KEYS:
        for value in ("n_vocab", "n_vocab+5", 2**31 - 1, 2**32 - 1):
            def edit(g: Gguf, key=key, value=value) -> None:
                n = len(tokens(g))
                v = n if value == "n_vocab" else n + 5 if value == "n_vocab+5" else value
                g.set(key, U32, v)
            add(f"{key.split('.')[-1]} = {value}")(edit)
    add("bos and eos removed")(lambda g: (g.remove("tokenizer.ggml.bos_token_id"), g.remove("tokenizer.ggml.eos_token_id")))
    add("<eos> and <turn|> renamed")(lambda g: set_tokens(g, [b"<eosx>" if t == b"<eos>" else b"<turnx|>" if t == b"<turn|>" else t
                                                              for t in tokens(g)]))

    # chat templates
    for name, template in HOSTILE_TEMPLATES.items():
        add(f"chat template: {name}")(lambda g, template=template: g.set("tokenizer.chat_template", STRING, template.encode()))
    add("chat template removed")(lambda g: g.remove("tokenizer.chat_template"))
    add("chat template is an int")(lambda g: g.set("tokenizer.chat_template", U32, 7))
    add("chat template of 1 MB")(lambda g: g.set("tokenizer.chat_template", STRING, b"{{ bos_token }}" + b"x" * (1 << 20)))

    # file-level
    add("architecture llama")(lambda g: g.set("general.architecture", STRING, b"llama"))
    add("architecture empty")(lambda g: g.set("general.architecture", STRING, b""))
    add("architecture removed")(lambda g: g.remove("general.architecture"))
    add("architecture swapped (diffusion <-> gemma4)")(_swap_architecture)
    add("alignment 0")(lambda g: g.set("general.alignment", U32, 0))
    add("alignment 3")(lambda g: g.set("general.alignment", U32, 3))
    add("alignment 2^30")(lambda g: g.set("general.alignment", U32, 1 << 30))
    add("version 1")(lambda g: setattr(g, "version", 1))
    add("version 4")(lambda g: setattr(g, "version", 4))
    add("a key appears twice")(lambda g: g.kvs.append(copy.deepcopy(g.kvs[1])))
    add("10,000 extra keys")(lambda g: g.kvs.extend(Kv(f"junk.{i}", U32, i) for i in range(10000)))
    add("key of 1 MB")(lambda g: g.kvs.append(Kv("k" * (1 << 20), U32, 1)))

    # tensors
    add("token_embd dims swapped")(lambda g: _tensor(g, b"token_embd.weight").dims.reverse())
    add("token_embd as Q4_K (rows not a multiple of 256)")(lambda g: setattr(_tensor(g, b"token_embd.weight"), "ttype", 12))
    add("token_embd type 200")(lambda g: setattr(_tensor(g, b"token_embd.weight"), "ttype", 200))
    add("token_embd offset misaligned")(lambda g: setattr(_tensor(g, b"token_embd.weight"), "offset",
                                                          _tensor(g, b"token_embd.weight").offset + 1))
    add("token_embd offset past the end")(lambda g: setattr(_tensor(g, b"token_embd.weight"), "offset", len(g.data)))
    add("token_embd with 5 dimensions")(lambda g: _tensor(g, b"token_embd.weight").dims.extend([1, 1, 1]))
    add("token_embd with a 0 dimension")(lambda g: _tensor(g, b"token_embd.weight").dims.__setitem__(0, 0))
    add("two tensors with one name")(lambda g: g.tensors.append(copy.deepcopy(g.tensors[-1])))
    add("token_embd removed")(lambda g: g.tensors.remove(_tensor(g, b"token_embd.weight")))
    add("last layer's attn_q removed")(lambda g: g.tensors.remove(_tensor(g, b"blk.5.attn_q.weight")))
    add("rope_freqs removed")(lambda g: g.tensors.remove(_tensor(g, b"rope_freqs.weight")))
    add("tensor overlaps the next")(lambda g: setattr(g.tensors[3], "offset", g.tensors[2].offset))

    if base == "diffusion":
        for key, values in {
            "diffusion.canvas_length": (0, 1, 4097, 1 << 20, 2**32 - 1),
            "diffusion.eb_max_steps": (0, 10**9, 2**32 - 1),
            "diffusion.eb_stability_threshold": (0, 10**7, 2**32 - 1),
        }.items():
            for value in values:
                add(f"{key} = {value}")(lambda g, key=key, value=value: g.set(key, U32, value))
        for key in DIFFUSION_FLOAT_KEYS:
            for value in (math.nan, -1.0, 0.0, math.inf, 1e30):
                add(f"{key} = {value}")(lambda g, key=key, value=value: g.set(key, F32, value))
        add("canvas_length removed")(lambda g: g.remove("diffusion.canvas_length"))
        add("canvas_length as i64 -1")(lambda g: g.set("diffusion.canvas_length", I64, -1))
        add("eb_max_steps as f64 1e300")(lambda g: g.set("diffusion.eb_max_steps", F64, 1e300))
        add("eb_max_steps as string")(lambda g: g.set("diffusion.eb_max_steps", STRING, b"48"))
        add("canvas_length larger than context")(lambda g: (g.set("diffusion.canvas_length", U32, 2048)))
        add("self_cond_gate removed")(lambda g: g.tensors.remove(_tensor(g, b"self_cond_gate.weight")))
        add("enc_layer_output_scale removed")(lambda g: g.tensors.remove(_tensor(g, b"blk.0.enc_layer_output_scale.weight")))
    return edits


def _tensor(g: Gguf, name: bytes):
    for t in g.tensors:
        if t.name == name:
            return t
    raise KeyError(name)


def _swap_architecture(g: Gguf) -> None:
    old = g.architecture
    new = "gemma4" if old == "diffusion-gemma" else "diffusion-gemma"
    g.set("general.architecture", STRING, new.encode())
    for kv in g.kvs:
        if kv.key.startswith(old + "."):
            kv.key = new + kv.key[len(old):]


def random_value_edit(g: Gguf, rng: random.Random) -> str:
    """Set a random numeric key to a random bad value (beyond the named edits)."""
    prefix = _prefix(g)
    keys = [f"{prefix}.{k}" for k in ARCH_INT_KEYS] + list(TOKEN_ID_KEYS)
    fkeys = [f"{prefix}.{k}" for k in ARCH_FLOAT_KEYS]
    if g.get("diffusion.canvas_length") is not None:
        keys += list(DIFFUSION_INT_KEYS)
        fkeys += list(DIFFUSION_FLOAT_KEYS)
    if rng.random() < 0.65:
        key = rng.choice(keys)
        old = _int_value(g.get(key), 16)
        value = rng.choice([0, 1, 2, old - 1, old + 1, old * 2, old * 3 + 1, old // 2, rng.randrange(2**32),
                            *HUGE_U32])
        value %= 2**32
        g.set(key, U32, value)
    else:
        key = rng.choice(fkeys)
        value = rng.choice(FLOAT_VALUES + (rng.uniform(-10, 10), 10 ** rng.uniform(-40, 38)))
        g.set(key, F32, value)
    return f"{key} = {value}"


# -- byte-level edits -------------------------------------------------------------------------------

def truncate(blob: bytes, g: Gguf, rng: random.Random) -> tuple[bytes, str]:
    if rng.random() < 0.7:
        cut = rng.randrange(0, g.header_end + 64)
        where = "header"
    else:
        cut = rng.randrange(g.header_end, len(blob))
        where = "data"
    return blob[:cut], f"cut at byte {cut} of {len(blob)} ({where})"


def byteflip(blob: bytes, g: Gguf, rng: random.Random) -> tuple[bytes, str]:
    data = bytearray(blob)
    in_header = rng.random() < 0.8
    lo, hi = (4, g.header_end) if in_header else (g.header_end, len(blob))
    n = rng.randint(1, 8)
    offsets = sorted(rng.randrange(lo, hi) for _ in range(n))
    for off in offsets:
        data[off] ^= rng.randrange(1, 256)
    return bytes(data), f"{n} bytes flipped in the {'header' if in_header else 'weights'} at {offsets}"


def huge_count(blob: bytes, g: Gguf, rng: random.Random) -> tuple[bytes, str]:
    fld = rng.choice(g.counts)
    if fld.width == 8:
        value = rng.choice(HUGE_U64 + (0, rng.randrange(2**64)))
        fmt = "<Q"
    else:
        value = rng.choice(HUGE_U32 + (0, 13, 255, rng.randrange(2**32)))
        fmt = "<I"
    data = bytearray(blob)
    struct.pack_into(fmt, data, fld.offset, value)
    return bytes(data), f"{fld.what} = {value}"


RETYPE_CHOICES: tuple[tuple[int, Any], ...] = (
    (STRING, b"48"), (F32, 6.5), (F64, -1.0), (BOOL, True), (U8, 255), (I32, -2), (I64, -(2**40)),
    (U64, 2**63), (U16, 6), (ARRAY, (U32, [6, 6])), (ARRAY, (STRING, [b"x"])), (ARRAY, (F32, [])),
    (ARRAY, (I32, [-1] * 6)))


def wrong_type(blob: bytes, g: Gguf, rng: random.Random) -> tuple[bytes, str]:
    if rng.random() < 0.4:
        # raw: the type id changes, the bytes after it are read as the new type
        fields = [f for f in g.counts if f.what.startswith(("type of", "element type of"))]
        fld = rng.choice(fields)
        value = rng.choice(list(range(13)) + [13, 255, 2**31])
        data = bytearray(blob)
        struct.pack_into("<I", data, fld.offset, value)
        return bytes(data), f"{fld.what} = {value} (raw)"
    # structured: a key re-encoded, well-formed, with another type
    kv = rng.choice(g.kvs)
    kv.vtype, kv.value = rng.choice([c for c in RETYPE_CHOICES if c[0] != kv.vtype])
    return serialize(g), f"{kv.key} re-encoded as type {kv.vtype}: {kv.value!r}"[:200]


# -- the mutant stream ----------------------------------------------------------------------------

def make_mutants(bases: dict[str, bytes], count: int, seed: int) -> Iterator[Mutant]:
    """`count` mutants, one at a time: first the named hyperparameter edits (both bases), then
    random ones drawn from `seed`. The same (bases, count, seed) always gives the same stream."""
    parsed = {name: parse(blob) for name, blob in bases.items()}
    index = 0
    for base in bases:
        for name, fn in named_edits(base):
            if index >= count:
                return
            g = copy.deepcopy(parsed[base])
            try:
                fn(g)
            except (KeyError, AttributeError, ValueError):
                continue  # an edit that does not apply to this base
            yield Mutant(index, "hparam", base, name, serialize(g))
            index += 1
    rng = random.Random(seed)
    cats = list(CATEGORY_WEIGHTS)
    weights = [CATEGORY_WEIGHTS[c] for c in cats]
    for index in range(index, count):
        mrng = random.Random(f"{seed}:{index}")
        category = rng.choices(cats, weights)[0]
        base = mrng.choice(sorted(bases))
        blob, g = bases[base], copy.deepcopy(parsed[base])
        if category == "truncate":
            data, desc = truncate(blob, g, mrng)
        elif category == "byteflip":
            data, desc = byteflip(blob, g, mrng)
        elif category == "huge-count":
            data, desc = huge_count(blob, g, mrng)
        elif category == "wrong-type":
            data, desc = wrong_type(blob, g, mrng)
        else:
            desc = random_value_edit(g, mrng)
            data = serialize(g)
        yield Mutant(index, category, base, desc, data)

