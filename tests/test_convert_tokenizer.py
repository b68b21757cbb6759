"""The converter's tokenizer: the GGUF vocabulary written as the published converter writes it (token
types and scores, from either tokenizer.json form), and text round-tripping through llama.cpp."""

from __future__ import annotations

import json
import shutil

import pytest

from dgcli.convert import convert_checkpoint
from native_helpers import requires_native

# needs torch and transformers: skipped without them (conftest.py)
needs_torch = pytest.mark.reference


def _fields(path) -> dict:
    from gguf import GGUFReader

    return {k: f.contents() for k, f in GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


# -- the tokenizer as the published converter writes it --------------------------------------------

# llama.cpp's convert_hf_to_gguf.py (Gemma4Model.set_vocab) retypes these USER_DEFINED after gguf.LlamaHfVocab
PUBLISHED_VISIBLE_TOKENS = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                            "<tool_response|>", '<|"|>'}
GEMMA4_MARKERS = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                  '<|"|>', "<|think|>", "<|video|>"]
TOKENIZER_FORMS = ["dg-tiny", "byte-tokens-special", "gemma4", "legacy-config", "extra-tokens-dict"]
# accents, emoji (4-byte UTF-8, a flag of two), digits, tabs, newlines, CJK: all but ASCII go through byte fallback
ROUND_TRIP_TEXTS = [
    "héllo wörld 😀",
    "2 + 2 = 4",
    "naïve café\tÅngström — 日本語 🚀🇫🇷\n\n  x\r\n\ty ",
    "\t\tindented\n0123456789 ½ ∑ ≠ ü\n",
]


def _add_special_tokens(tokenizer: dict, texts: list[str]) -> None:
    ids = tokenizer["model"]["vocab"]
    listed = {t["content"] for t in tokenizer["added_tokens"]}
    tokenizer["added_tokens"] += [{"id": ids[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": True} for t in texts if t not in listed]
    tokenizer["added_tokens"].sort(key=lambda t: t["id"])


def _tokenizer_files(directory, form: str) -> None:
    """dg-tiny's Hugging Face tokenizer files, rewritten into the forms real checkpoints take."""
    from dgcli.testing.tiny import tiny_vocab

    vocab = tiny_vocab()
    vocab.save_hf(directory)
    tokenizer = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    if form in ("byte-tokens-special", "gemma4"):
        # as Gemma's own tokenizer.json: the unused and byte-fallback tokens are special added tokens
        _add_special_tokens(tokenizer, [t for t in vocab.tokens if t.startswith(("<0x", "<unused"))])
    if form == "gemma4":
        # Gemma 4's markers in the unused block, named as its tokenizer_config.json names them
        renamed = dict(zip([f"<unused{i}>" for i in range(len(GEMMA4_MARKERS))], GEMMA4_MARKERS))
        tokenizer["model"]["vocab"] = {renamed.get(t, t): i for t, i in tokenizer["model"]["vocab"].items()}
        for added in tokenizer["added_tokens"]:
            added["content"] = renamed.get(added["content"], added["content"])
        config.update(soc_token="<|channel>", eoc_token="<channel|>", stc_token="<|tool_call>",
                      etc_token="<tool_call|>", str_token="<|tool_response>", etr_token="<tool_response|>",
                      escape_token='<|"|>', think_token="<|think|>", extra_special_tokens=["<|video|>", "<extra_b>"])
        config["pad_token"] = {"__type": "AddedToken", "content": "<pad>", "lstrip": False, "normalized": False,
                               "rstrip": False, "single_word": False, "special": True}
        # added outside the BPE vocabulary: a plain one and a special one
        tokenizer["added_tokens"] += [
            {"id": 500, "content": "<extra_a>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": False},
            {"id": 501, "content": "<extra_b>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}]
    if form == "legacy-config":
        # no named tokens (Gemma's tokenizer class supplies them) and the pre-v5 name for the extra ones
        config = {"tokenizer_class": "GemmaTokenizer", "additional_special_tokens": ["<unused0>", "<unused1>"]}
        (directory / "special_tokens_map.json").unlink()
    if form == "extra-tokens-dict":
        config["extra_special_tokens"] = {"image_token": "<unused2>", "audio_token": "<unused3>"}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def _published_tokenizer(directory) -> dict:
    """The tokenizer.ggml.* values llama.cpp's converter writes for these files, by its own code:
    gguf.LlamaHfVocab for tokens / scores / types, gguf.SpecialVocab for merges and special ids."""
    import gguf

    rows = list(gguf.LlamaHfVocab(directory).all_tokens())
    tokens = [text.decode("utf-8") for text, _, _ in rows]
    special = gguf.SpecialVocab(directory, load_merges=True)
    out = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [score for _, score, _ in rows],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.USER_DEFINED) if t in PUBLISHED_VISIBLE_TOKENS else int(kind)
                                      for t, (_, _, kind) in zip(tokens, rows)],
        "tokenizer.ggml.merges": special.merges,
    }
    names = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id",
             "mask": "mask_token_id"}
    out.update({f"tokenizer.ggml.{names[kind]}": i for kind, i in special.special_token_ids.items()})
    return out


def _dg_tokenizer(directory, vocab_size: int, tmp_path) -> dict:
    """The tokenizer.ggml.* keys dg's converter writes for these files, read back from a GGUF."""
    from gguf import GGUFWriter

    from dgcli.convert import vocab_from_hf_dir

    path = tmp_path / "vocab.gguf"
    writer = GGUFWriter(str(path), "gemma4")
    vocab_from_hf_dir(directory, vocab_size).add_to_gguf(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return {k: v for k, v in _fields(path).items() if k.startswith("tokenizer.ggml.")}


@needs_torch
@pytest.mark.parametrize("form", TOKENIZER_FORMS)
def test_tokenizer_arrays_are_the_published_converters(tmp_path, form):
    from gguf import TokenType

    directory = tmp_path / form
    _tokenizer_files(directory, form)
    published = _published_tokenizer(directory)
    n_published = len(published["tokenizer.ggml.tokens"])
    n_model = n_published + 2  # embedding rows past the tokenizer, as real checkpoints round up
    written = _dg_tokenizer(directory, n_model, tmp_path)
    per_token = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    for key, value in published.items():
        got = written[key][:n_published] if key in per_token else written[key]
        assert got == value, key
    # the rows past the tokenizer, as llama.cpp's converters pad a vocabulary
    assert written["tokenizer.ggml.tokens"][n_published:] == [f"[PAD{i}]" for i in range(n_published, n_model)]
    assert written["tokenizer.ggml.scores"][n_published:] == [-1000.0] * 2
    assert written["tokenizer.ggml.token_type"][n_published:] == [TokenType.UNUSED] * 2
    types = dict(zip(written["tokenizer.ggml.tokens"], written["tokenizer.ggml.token_type"]))
    assert all(types[f"<0x{b:02X}>"] == TokenType.BYTE for b in range(256))  # whatever the special flags say
    assert types["<unk>"] == TokenType.CONTROL and TokenType.UNKNOWN not in types.values()
    if form == "gemma4":
        assert types["<|channel>"] == types['<|"|>'] == TokenType.USER_DEFINED
        assert types["<|turn>"] == types["<|think|>"] == types["<|video|>"] == TokenType.CONTROL
        assert types["<extra_a>"] == TokenType.USER_DEFINED and types["<extra_b>"] == TokenType.CONTROL


@needs_torch
@requires_native
def test_converted_tokenizer_round_trips_text_through_llama_cpp(reference_checkpoint, tmp_path):
    from dgcli.runtime.model import DiffusionModel
    from dgcli.testing.tiny import tiny_vocab

    ckpt = tmp_path / "bytes-special"
    shutil.copytree(reference_checkpoint, ckpt)
    _tokenizer_files(ckpt, "byte-tokens-special")
    path = convert_checkpoint(ckpt, tmp_path / "bytes-special.gguf")
    byte_ids = {tiny_vocab().token_id(f"<0x{b:02X}>") for b in range(256)}
    with DiffusionModel(path, n_threads=1, n_ctx=64) as model:
        for text in ROUND_TRIP_TEXTS:
            ids = model.tokenize(text, add_bos=False)
            assert model.detokenize(ids) == text
        assert any(i in byte_ids for i in model.tokenize(ROUND_TRIP_TEXTS[0], add_bos=False))
        # with a chat prompt around it, the special tokens still parse and drop
        ids = model.chat_prompt(ROUND_TRIP_TEXTS[2])
        assert model.detokenize(ids) == f"user\n{ROUND_TRIP_TEXTS[2]}\nmodel\n"
