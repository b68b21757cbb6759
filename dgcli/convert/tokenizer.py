"""The tokenizer from tokenizer.json, typed and scored as the published converter does (llama.cpp's
Gemma4Model.set_vocab over gguf.LlamaHfVocab).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from dgcli.convert.checkpoint import read_json
from dgcli.errors import DgError

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
    data = read_json(hf_dir / "tokenizer.json", required=True)
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

    config = read_json(hf_dir / "tokenizer_config.json", required=False) or {}
    special_map = read_json(hf_dir / "special_tokens_map.json", required=False) or {}
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
