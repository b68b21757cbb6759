"""Tiny models in the published GGUF layout, and the tiny tokenizer "dg-tiny" they all share.

The tokenizer is a llama.cpp `gemma4` vocabulary (SPM-style BPE on raw UTF-8) small enough to
read: the real Gemma special ids (0 <pad>, 1 <eos>, 2 <bos>, 3 <unk>, 4 <mask>, 105 <|turn>,
106 <turn|>, 5..104 unused), 256 byte-fallback tokens, one token per printable ASCII character
plus newline and tab, and a few merges. Its token types and scores are what the published
converter writes for its Hugging Face form (`save_hf`). Its pure-Python `encode` follows
llama.cpp's algorithm step by step (src/llama-vocab.cpp), so a prompt tokenized here and one
tokenized by the native library are the same ids.

Nothing here needs torch: `write_tiny_random_gguf` and `write_synthetic_gguf` use numpy + gguf.
"""

from __future__ import annotations

import functools
import heapq
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from dgcli.convert import (
    PUBLISHED_TOKEN_SCORE,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    GgufVocab,
    published_token_types,
    special_token_texts,
)
from dgcli.errors import DgError

TOKENIZER_NAME = "dg-tiny"

PAD_ID, EOS_ID, BOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
TURN_START_ID, TURN_END_ID = 105, 106
N_UNUSED = 100  # ids 5..104, as in the real vocabulary's reserved block

# SPM-style BPE: the normalizer writes every space as U+2581 before merging.
SPACE_MARK = "\u2581"

# The special tokens tokenizer_config.json names, as Gemma 4's does (its turn markers are sot/eot).
HF_SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
                     "mask_token": "<mask>", "sot_token": "<|turn>", "eot_token": "<turn|>"}
# Types llama.cpp matches as whole special tokens in text (when parsing specials) and drops or keeps
# as they are when detokenizing.
_PARSED_AS_SPECIAL = (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)

# Renders `<bos><|turn>user\n{content}<turn|>\n<|turn>model\n` for one user message with
# add_generation_prompt; the model's role is called "model" as in Gemma's own template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n{{ message['content'] }}<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)

# Frequent English pairs, in rank order. Each merge's result is itself a token, so a Hugging Face
# BPE with the same merges produces the same ids as llama.cpp.
_MERGES: tuple[tuple[str, str], ...] = (
    ("e", "r"), ("i", "n"), ("\u2581", "t"), ("h", "e"), ("a", "n"), ("o", "n"), ("r", "e"),
    ("\u2581", "a"), ("e", "n"), ("a", "t"), ("o", "u"), ("\u2581", "s"), ("\u2581t", "he"),
    ("i", "s"), ("e", "s"), ("\u2581", "w"), ("o", "r"), ("e", "d"), ("i", "t"), ("\u2581", "o"),
    ("in", "g"), ("\u2581", "i"), ("a", "r"), ("\u2581", "c"), ("a", "l"), ("l", "e"),
    ("\u2581", "b"), ("\u2581", "f"), ("\u2581", "m"), ("\u2581", "d"), ("\u2581", "p"),
    ("s", "t"), ("\u2581a", "n"), ("\u2581an", "d"), ("\u2581", "h"), ("\u2581o", "f"),
    ("\u2581t", "o"), ("\u2581i", "s"), ("\u2581", "\u2581"), ("\u2581\u2581", "\u2581\u2581"),
)


def _build_base_tokens() -> list[str]:
    tokens: list[str] = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    tokens += [f"<unused{i}>" for i in range(N_UNUSED)]
    tokens += ["<|turn>", "<turn|>"]
    assert len(tokens) == TURN_END_ID + 1
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    tokens += [SPACE_MARK if ch == " " else ch for ch in ["\n", "\t"] + [chr(c) for c in range(0x20, 0x7F)]]
    known = set(tokens)
    for left, right in _MERGES:
        assert left in known and right in known, (left, right)
        merged = left + right
        if merged not in known:
            tokens.append(merged)
            known.add(merged)
    return tokens


class TinyVocab:
    """The dg-tiny tokenizer: a llama.cpp `gemma4` BPE vocabulary and a Python twin of its tokenizer.

    `extra_tokens` pads the vocabulary with normal tokens no text ever produces (for benchmark
    models with a real-size vocabulary); ids of everything else do not change.
    """

    name = TOKENIZER_NAME
    pad_id, eos_id, bos_id, unk_id, mask_id = PAD_ID, EOS_ID, BOS_ID, UNK_ID, MASK_ID
    turn_start_id, turn_end_id = TURN_START_ID, TURN_END_ID
    end_token_ids = (EOS_ID, TURN_END_ID)
    chat_template = CHAT_TEMPLATE

    def __init__(self, extra_tokens: int = 0):
        if extra_tokens < 0:
            raise DgError(f"extra_tokens must be >= 0, got {extra_tokens}")
        tokens = _build_base_tokens() + [f"<filler{i}>" for i in range(extra_tokens)]
        self.tokens: list[str] = tokens
        self.token_types: list[int] = published_token_types(tokens, special_token_texts(HF_SPECIAL_TOKENS))
        self.merges: list[str] = [f"{a} {b}" for a, b in _MERGES]
        self._merge_rank = {pair: rank for rank, pair in enumerate(_MERGES)}
        self._token_to_id = {t: i for i, t in enumerate(tokens)}
        # llama.cpp tries longer special texts first; ours never overlap, so this order is exact.
        self._special_texts = sorted(
            (t for t, ty in zip(tokens, self.token_types) if ty in _PARSED_AS_SPECIAL), key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in self._special_texts))

    # -- sizes and ids -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_id(self, text: str) -> int:
        try:
            return self._token_to_id[text]
        except KeyError:
            raise DgError(f"token {text!r} is not in the {self.name} vocabulary") from None

    @property
    def scores(self) -> list[float]:
        # BPE ignores scores; llama.cpp still requires the array.
        return [PUBLISHED_TOKEN_SCORE] * self.vocab_size

    # -- encoding (llama.cpp's gemma4 path, step by step) -----------------------------------------

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of `text`; `special` parses control-token texts like `<|turn>` as those tokens."""
        if not isinstance(text, str):
            raise DgError(f"text to encode must be a str, got {type(text).__name__}")
        ids: list[int] = [BOS_ID] if add_bos else []
        for fragment, special_id in self._split_special(text, special):
            if special_id is not None:
                ids.append(special_id)
            else:
                ids.extend(self._encode_plain(fragment))
        return ids

    def _split_special(self, text: str, special: bool) -> Iterable[tuple[str, int | None]]:
        if not special or not text:
            if text:
                yield text, None
            return
        pos = 0
        for match in self._special_re.finditer(text):
            if match.start() > pos:
                yield text[pos:match.start()], None
            yield match.group(), self._token_to_id[match.group()]
            pos = match.end()
        if pos < len(text):
            yield text[pos:], None

    def _encode_plain(self, text: str) -> list[int]:
        text = text.replace(" ", SPACE_MARK)
        ids: list[int] = []
        # gemma4 pre-tokenization only splits runs of newlines from everything else.
        for word in re.findall(r"[^\n]+|\n+", text):
            if word[0] == "\n" and word in self._token_to_id:
                ids.append(self._token_to_id[word])
                continue
            for piece in self._bpe(word):
                token = self._token_to_id.get(piece)
                if token is not None:
                    ids.append(token)
                else:
                    ids.extend(self._token_to_id[f"<0x{b:02X}>"] for b in piece.encode("utf-8"))
        return ids

    def _bpe(self, word: str) -> list[str]:
        """Merge by rank, lowest rank first and leftmost first among equals (llama.cpp's queue)."""
        symbols: list[str] = list(word)
        prev = list(range(-1, len(symbols) - 1))
        nxt = list(range(1, len(symbols) + 1))
        nxt[-1] = -1
        queue: list[tuple[int, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            rank = self._merge_rank.get((symbols[left], symbols[right]))
            if rank is not None:
                heapq.heappush(queue, (rank, left, right, symbols[left] + symbols[right]))

        for i in range(1, len(symbols)):
            push(i - 1, i)
        while queue:
            _, left, right, merged = heapq.heappop(queue)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
                continue  # outdated bigram
            if nxt[left] != right:
                continue
            symbols[left] = merged
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return [s for s in symbols if s]

    # -- decoding (llama_token_to_piece, concatenated) ---------------------------------------------

    def piece_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes llama_token_to_piece gives for one token (control tokens only when `special`)."""
        if not 0 <= int(token_id) < self.vocab_size:
            raise DgError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        text, kind = self.tokens[token_id], self.token_types[token_id]
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return text.encode("utf-8") if special else b""
        if kind == TOKEN_BYTE:
            return bytes([int(text[3:5], 16)])
        return text.replace(SPACE_MARK, " ").encode("utf-8")

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """Text of `ids`: byte tokens are joined before UTF-8 decoding; control tokens dropped unless `special`."""
        data = b"".join(self.piece_bytes(int(i), special) for i in ids)
        return data.decode("utf-8", errors="replace")

    # -- chat ---------------------------------------------------------------------------------

    def render_chat(self, user_text: str, add_generation_prompt: bool = True) -> str:
        return _render_template(CHAT_TEMPLATE, [{"role": "user", "content": user_text}],
                                add_generation_prompt, bos_token=self.tokens[BOS_ID], eos_token=self.tokens[EOS_ID])

    def chat_prompt_ids(self, user_text: str) -> list[int]:
        """`<bos><|turn>user\\n{text}<turn|>\\n<|turn>model\\n` as ids (the bos comes from the template)."""
        return self.encode(self.render_chat(user_text), add_bos=False, special=True)

    # -- serialisation --------------------------------------------------------------------------

    def add_to_gguf(self, writer: Any, chat_template: str | None = CHAT_TEMPLATE) -> None:
        """Write the tokenizer.ggml.* keys (and the chat template, unless None) to a gguf.GGUFWriter, as the
        converter does."""
        GgufVocab(tokens=self.tokens, token_types=self.token_types, merges=self.merges, bos_id=BOS_ID, eos_id=EOS_ID,
                  unk_id=UNK_ID, pad_id=PAD_ID, mask_id=MASK_ID, chat_template=chat_template).add_to_gguf(writer)

    def hf_tokenizer_json(self) -> str:
        """A Hugging Face `tokenizers` tokenizer.json encoding exactly like `encode(special=True)`."""
        added = [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, (t, ty) in enumerate(zip(self.tokens, self.token_types))
            if ty in _PARSED_AS_SPECIAL
        ]
        data = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK},
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated",
                              "invert": False},
            "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ]},
            "model": {
                "type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
                "vocab": {t: i for i, t in enumerate(self.tokens)},
                "merges": [[a, b] for a, b in _MERGES],
            },
        }
        return json.dumps(data, ensure_ascii=False)

    def hf_tokenizer_config(self) -> dict[str, Any]:
        return {
            "tokenizer_class": "PreTrainedTokenizerFast", **HF_SPECIAL_TOKENS,
            "add_bos_token": True, "add_eos_token": False,
            "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20,
        }

    def save_hf(self, directory: str | Path) -> None:
        """tokenizer.json + tokenizer_config.json + special_tokens_map.json into a checkpoint dir."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(self.hf_tokenizer_json(), encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(json.dumps(self.hf_tokenizer_config(), indent=2),
                                                         encoding="utf-8")
        (directory / "special_tokens_map.json").write_text(json.dumps(HF_SPECIAL_TOKENS, indent=2), encoding="utf-8")


def _render_template(template: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                     **variables: Any) -> str:
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **variables)


@functools.lru_cache(maxsize=1)
def tiny_vocab() -> TinyVocab:
    """The shared dg-tiny tokenizer (immutable; one instance per process)."""
    return TinyVocab()


# ---------------------------------------------------------------------------------------------
# Tiny random GGUFs (no torch)
# ---------------------------------------------------------------------------------------------

# The tiny model's text config, shared with dgcli.testing.reference (which builds the same shapes in torch).
TINY_LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention",
                    "sliding_attention", "sliding_attention", "full_attention")
TINY_TEXT_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=len(TINY_LAYER_TYPES),
    layer_types=list(TINY_LAYER_TYPES),
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    sliding_window=8,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
TINY_CANVAS_LENGTH = 16


def tiny_hf_config_dict(**overrides: Any) -> dict[str, Any]:
    """A Google-form config.json dict for the tiny model (what `dgcli.testing.reference.tiny_config` builds)."""
    text = dict(TINY_TEXT_CONFIG, vocab_size=tiny_vocab().vocab_size)
    top: dict[str, Any] = {"model_type": "diffusion_gemma", "canvas_length": TINY_CANVAS_LENGTH}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        text.pop("layer_types")
    for key, value in overrides.items():
        (top if key == "canvas_length" else text)[key] = value
    top["text_config"] = text
    return top


def tiny_layout_params(**overrides: Any):
    """LayoutParams of the tiny model (same hyperparameters as the reference's tiny_config)."""
    from dgcli.convert import params_from_hf_config

    return params_from_hf_config(tiny_hf_config_dict(**overrides))


def _rng_for(seed: int, key: str) -> np.random.Generator:
    import zlib

    # keyed by role and layer, so the AR twin gets the same weights as the diffusion file
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def _random_tensor(spec, params, seed: int) -> np.ndarray:
    rng = _rng_for(seed, f"{spec.role}:{spec.layer}")
    if spec.role == "rope_freqs":
        return params.rope_freq_factors()
    if spec.role == "layer_scalar_encoder":
        return rng.uniform(0.5, 0.9, spec.shape).astype(np.float32)
    if spec.role == "layer_scalar_decoder":
        return rng.uniform(1.1, 1.5, spec.shape).astype(np.float32)
    if len(spec.shape) == 1:  # norms and scales: positive, away from 1
        return rng.uniform(0.5, 1.5, spec.shape).astype(np.float32)
    if spec.role == "token_embd":
        return (rng.standard_normal(spec.shape) * 0.5).astype(np.float32)
    return (rng.standard_normal(spec.shape) / np.sqrt(spec.shape[-1])).astype(np.float32)


def _untrained_tensor(spec, params, seed: int) -> np.ndarray:
    """Transformers' fresh initialisation: matrices N(0, 0.02), norms, scales and layer scalars one."""
    if spec.role == "rope_freqs":
        return params.rope_freq_factors()
    if len(spec.shape) == 1:
        return np.ones(spec.shape, dtype=np.float32)
    rng = _rng_for(seed, f"{spec.role}:{spec.layer}")
    return (rng.standard_normal(spec.shape) * 0.02).astype(np.float32)


def write_tiny_random_gguf(path: str | Path, seed: int = 0, arch: str = "diffusion-gemma", outtype: str = "f32",
                           init: str = "random", chat_template: str | None = CHAT_TEMPLATE,
                           storage: Callable[[Any], Any] | None = None, **config_overrides: Any) -> Path:
    """A tiny random model in the published layout (or its AR gemma4 twin), dg-tiny tokenizer, no torch.

    `init="random"` randomizes every tensor at a scale that gives peaked logits (norms and scalars
    away from one, so a swapped tensor shows); `init="untrained"` is a freshly initialised model
    (near-uniform logits: the seed's EXP A). `config_overrides` take text-config names as in
    config.json (hidden_size, num_hidden_layers, layer_types, num_experts, global_head_dim,
    sliding_window, ...) or canvas_length. chat_template: the tokenizer.chat_template (None: none).
    `storage(spec)` chooses each tensor's ggml type instead of `outtype` (e.g. `q5_0_type`).
    """
    from dgcli.convert import write_layout_gguf

    tensor_for = {"random": _random_tensor, "untrained": _untrained_tensor}.get(init)
    if tensor_for is None:
        raise DgError(f"unknown init {init!r}: use 'random' or 'untrained'")
    params = tiny_layout_params(**config_overrides)
    return write_layout_gguf(path, params, arch, lambda writer: tiny_vocab().add_to_gguf(writer, chat_template),
                             lambda spec: [tensor_for(spec, params, seed)], outtype, storage=storage)


def q5_0_type(spec):
    """Q5_0 for every matrix whose rows are whole 32-wide blocks, as Q4_K_M files store their down
    projections; the token embedding (so the LM head) Q8_0, as a Q4_K_M file keeps it wider than the
    rest; vectors and the router F32."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(spec.shape) == 1 or spec.role in ("ffn_gate_inp", "rope_freqs") or spec.shape[-1] % 32:
        return T.F32
    return T.Q8_0 if spec.role == "token_embd" else T.Q5_0


# ---------------------------------------------------------------------------------------------
# Real-size synthetic GGUFs for benchmarks
# ---------------------------------------------------------------------------------------------

_CHUNK_BYTES = 64 << 20


def _random_blocks(rng: np.random.Generator, qtype, n_blocks: int, std: float) -> np.ndarray:
    """`n_blocks` random blocks of a quantized type whose values have roughly standard deviation `std`:
    random quants, and scales set so that the dequantized weights are of the wanted size (timing
    needs finite, realistic magnitudes, not a trained model)."""
    import gguf

    T = gguf.GGMLQuantizationType
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    # raw 64-bit draws: several times faster than rng.bytes / rng.integers (a 16 GB file is mostly these)
    raw = rng.bit_generator.random_raw(-(-n_blocks * size // 8)).view(np.uint8)
    blocks = raw[:n_blocks * size].reshape(n_blocks, size)

    def put_f16(offset: int, value: float) -> None:
        blocks[:, offset:offset + 2] = np.full(n_blocks, value, dtype=np.float16).view(np.uint8).reshape(-1, 2)

    if qtype == T.Q8_0:        # d, then 32 int8 (|q| <= 127 uniform: std ~73)
        put_f16(0, std / 73.0)
    elif qtype == T.Q5_0:      # d, 4 bytes of high bits, 16 bytes of nibbles: q - 16 in [-16, 15], std ~9.2
        put_f16(0, std / 9.2)
    elif qtype == T.Q4_K:      # d, dmin, 12 bytes of 6-bit scales/mins (~32), 128 bytes of nibbles (std ~4.6)
        put_f16(0, std / (32 * 4.6))
        put_f16(2, std * 7.5 / (32 * 4.6))  # centres d*sc*q - dmin*m around zero
    elif qtype == T.Q6_K:      # 128 + 64 bytes of 6-bit quants (q - 32: std ~18.5), 16 int8 scales (~73), d
        put_f16(size - 2, std / (73 * 18.5))
    else:
        raise DgError(f"no random-block generator for {qtype.name}")
    return blocks


def q4_k_m_type(spec, n_layer: int):
    """The type llama.cpp's Q4_K_M gives a tensor, in short: Q4_K, Q6_K for the embedding and for
    attn_v / ffn_down(_exps) in its `use_more_bits` layers; rows that do not fill 256-wide super-blocks
    fall back as llama.cpp's quantizer does (Q4_K -> Q5_0, Q6_K -> Q8_0); vectors and the router stay F32."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(spec.shape) == 1 or spec.role in ("ffn_gate_inp", "rope_freqs"):
        return T.F32
    layer = spec.layer if spec.layer is not None else -1
    more_bits = layer >= 0 and (layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2)
    wanted = T.Q6_K if spec.role == "token_embd" or (more_bits and spec.role in ("attn_v", "ffn_down", "ffn_down_exps")) \
        else T.Q4_K
    if spec.shape[-1] % gguf.GGML_QUANT_SIZES[wanted][0]:
        wanted = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}[wanted]
    return wanted


def _synthetic_chunks(spec, qtype, params, seed: int) -> Iterable[np.ndarray]:
    """Random data already encoded as `qtype`, generated in bounded chunks (never a whole big tensor)."""
    import gguf

    from dgcli.convert import encode_as

    T = gguf.GGMLQuantizationType
    quantized = qtype not in (T.F32, T.F16, T.BF16)
    if not quantized and (len(spec.shape) == 1 or spec.role == "rope_freqs"
                          or int(np.prod(spec.shape)) * 4 <= _CHUNK_BYTES):
        yield encode_as(_random_tensor(spec, params, seed), qtype)
        return
    rng = _rng_for(seed, f"{spec.role}:{spec.layer}")
    row_len = spec.shape[-1]
    n_rows = int(np.prod(spec.shape[:-1]))
    std = 0.5 if spec.role == "token_embd" else 1.0 / np.sqrt(row_len)
    rows_per_chunk = max(1, _CHUNK_BYTES // (4 * row_len))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for start in range(0, n_rows, rows_per_chunk):
        rows = min(rows_per_chunk, n_rows - start)
        if quantized:
            yield _random_blocks(rng, qtype, rows * row_len // block, std)
        else:
            data = rng.standard_normal((rows, row_len), dtype=np.float32) * np.float32(std)
            yield encode_as(data, qtype)


def write_synthetic_gguf(path: str | Path, n_layer: int = 1, vocab_size: int = 262144, hidden: int = 2816,
                         outtype: str = "q8_0", seed: int = 0, arch: str = "diffusion-gemma",
                         **config_overrides: Any) -> Path:
    """A random model with the real vocabulary and hidden sizes (26B-A4B shapes) for benchmarks.

    Writing streams chunk by chunk. Sizes: the 262144 x 2816 embedding alone is ~0.8 GB in Q8_0
    (1.5 GB F16), and each real-size MoE layer adds ~0.8 GB in Q8_0; pass num_experts=... to shrink.
    outtype "q4_k_m" stores the types of a Q4_K_M quant (`q4_k_m_type`; 30 layers: ~15 GB), filled
    with random blocks. The tokenizer is dg-tiny padded with never-produced filler tokens up to `vocab_size`.
    """
    from dgcli.convert import params_from_hf_config, write_layout_gguf

    base = TinyVocab().vocab_size
    if vocab_size < base:
        raise DgError(f"vocab_size must be at least {base} (the dg-tiny tokens), got {vocab_size}")
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2112, num_hidden_layers=n_layer,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=2, sliding_window=1024, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704, max_position_embeddings=262144, rms_norm_eps=1e-6,
    )
    canvas_length = config_overrides.pop("canvas_length", 256)
    text.update(config_overrides)
    params = params_from_hf_config({"model_type": "diffusion_gemma", "canvas_length": canvas_length,
                                    "text_config": text})
    vocab = TinyVocab(extra_tokens=vocab_size - base)
    storage, file_type = None, None
    if outtype == "q4_k_m":
        # declared as llama.cpp's quantizer declares it in the published Q4_K_M files: MOSTLY_Q4_K_M
        outtype, storage, file_type = "f32", lambda spec: q4_k_m_type(spec, n_layer), 15
    return write_layout_gguf(path, params, arch, vocab.add_to_gguf, outtype=outtype, storage=storage,
                             raw_source=lambda spec, qtype: _synthetic_chunks(spec, qtype, params, seed),
                             file_type=file_type)
