"""The dg-tiny tokenizer (against Hugging Face `tokenizers` and llama.cpp) and the torch-free tiny GGUFs."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from dgcli.convert import PUBLISHED_TOKEN_SCORE, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL
from dgcli.errors import DgError
from dgcli.modelfile import info
from dgcli.testing.tiny import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    MASK_ID,
    PAD_ID,
    SPACE_MARK,
    TURN_END_ID,
    TURN_START_ID,
    UNK_ID,
    TinyVocab,
    write_synthetic_gguf,
    write_tiny_random_gguf,
)

TEXTS = [
    "Hello world",
    "the cat and the dog\n\n  is    here!",
    "<bos><|turn>user\nhi<turn|>\n<|turn>model\n",
    "héllo ✓ 日本語 — ok",
    "  leading spaces and trailing  ",
    "\n\n\nx\ty\r\nz",
    "<0x41> is not a byte token in text",
    "a<eos>b<mask>c<unused7>d<unk>",
    "theother thing ingesting interesting",
    "",
    " ",
    "~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./",
]

PLAIN_TEXTS = [t for t in TEXTS if "<" not in t]


def _gguf_field(reader, key):
    return reader.fields[key].contents()


# -- the vocabulary --------------------------------------------------------------------------


def test_special_ids_are_gemmas(tiny_vocab_obj):
    v = tiny_vocab_obj
    assert [v.tokens[i] for i in (PAD_ID, EOS_ID, BOS_ID, UNK_ID, MASK_ID)] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    assert (v.tokens[TURN_START_ID], v.tokens[TURN_END_ID]) == ("<|turn>", "<turn|>")
    # typed as the published converter types Gemma's: the tokens tokenizer_config.json names are
    # CONTROL (<unk> too), the unused block is plain vocabulary, every score -1000
    named = (PAD_ID, EOS_ID, BOS_ID, UNK_ID, MASK_ID, TURN_START_ID, TURN_END_ID)
    assert all(v.token_types[i] == TOKEN_CONTROL for i in named)
    assert all(v.token_types[i] == TOKEN_NORMAL for i in range(5, 105))
    assert v.scores == [PUBLISHED_TOKEN_SCORE] * v.vocab_size
    assert v.end_token_ids == (EOS_ID, TURN_END_ID)


def test_every_byte_and_printable_ascii_has_a_token(tiny_vocab_obj):
    v = tiny_vocab_obj
    byte_tokens = [t for t, ty in zip(v.tokens, v.token_types) if ty == TOKEN_BYTE]
    assert sorted(int(t[3:5], 16) for t in byte_tokens) == list(range(256))
    normal = {t for t, ty in zip(v.tokens, v.token_types) if ty == TOKEN_NORMAL}
    for c in range(0x21, 0x7F):
        assert chr(c) in normal
    assert {SPACE_MARK, "\n", "\t"} <= normal
    assert len(set(v.tokens)) == v.vocab_size


def test_merges_produce_tokens_in_the_vocab(tiny_vocab_obj):
    v = tiny_vocab_obj
    for merge in v.merges:
        left, right = merge.split(" ")
        assert left in v.tokens and right in v.tokens and left + right in v.tokens


def test_bpe_merges_by_rank(tiny_vocab_obj):
    v = tiny_vocab_obj
    # "▁t" and "he" merge first, then "▁t he": one token
    assert v.encode(" the") == [v.token_id(SPACE_MARK + "the")]
    # without the space no rule joins "t" and "he"
    assert v.encode("the") == [v.token_id("t"), v.token_id("he")]


def test_encode_decode_round_trip(tiny_vocab_obj):
    for text in PLAIN_TEXTS:
        assert tiny_vocab_obj.decode(tiny_vocab_obj.encode(text)) == text


def test_non_ascii_falls_back_to_bytes(tiny_vocab_obj):
    v = tiny_vocab_obj
    ids = v.encode("é")
    assert ids == [v.token_id("<0xC3>"), v.token_id("<0xA9>")]
    assert v.decode(ids) == "é"


def test_special_texts_parse_only_when_asked(tiny_vocab_obj):
    v = tiny_vocab_obj
    assert v.encode("a<eos>b") == [v.token_id("a"), EOS_ID, v.token_id("b")]
    plain = v.encode("a<eos>b", special=False)
    assert EOS_ID not in plain and v.decode(plain) == "a<eos>b"
    assert v.decode([EOS_ID]) == "" and v.decode([EOS_ID], special=True) == "<eos>"


def test_add_bos(tiny_vocab_obj):
    assert tiny_vocab_obj.encode("hi", add_bos=True) == [BOS_ID] + tiny_vocab_obj.encode("hi")


def test_chat_prompt(tiny_vocab_obj):
    v = tiny_vocab_obj
    assert v.render_chat("2+2?") == "<bos><|turn>user\n2+2?<turn|>\n<|turn>model\n"
    ids = v.chat_prompt_ids("2+2?")
    assert ids[:2] == [BOS_ID, TURN_START_ID]
    assert ids.count(BOS_ID) == 1 and ids.count(TURN_END_ID) == 1
    assert ids[-len(v.encode("model\n")):] == v.encode("model\n")
    assert v.decode(ids, special=True) == v.render_chat("2+2?")


def test_bad_input_is_a_dg_error(tiny_vocab_obj):
    with pytest.raises(DgError):
        tiny_vocab_obj.decode([tiny_vocab_obj.vocab_size])
    with pytest.raises(DgError):
        tiny_vocab_obj.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(DgError):
        TinyVocab(extra_tokens=-1)


def test_extra_tokens_keep_the_ids():
    base, padded = TinyVocab(), TinyVocab(extra_tokens=10)
    assert padded.vocab_size == base.vocab_size + 10
    assert padded.tokens[: base.vocab_size] == base.tokens
    assert padded.encode(TEXTS[1]) == base.encode(TEXTS[1])


# -- Hugging Face tokenizers twin ----------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_json_encodes_the_same(tiny_vocab_obj, text):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(tiny_vocab_obj.hf_tokenizer_json())
    assert hf.encode(text, add_special_tokens=False).ids == tiny_vocab_obj.encode(text)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_hf_tokenizer_json_decodes_the_same(tiny_vocab_obj):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(tiny_vocab_obj.hf_tokenizer_json())
    for text in PLAIN_TEXTS:
        assert hf.decode(tiny_vocab_obj.encode(text), skip_special_tokens=True) == text


# -- llama.cpp twin --------------------------------------------------------------------------


def _llama_cpp_or_skip():
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # ImportError, or the shared library failing to load
        pytest.skip("native build not installed (llama_cpp is not importable)")
    return llama_cpp


@pytest.fixture(scope="module")
def llama_vocab(tiny_ar_gguf):
    """llama.cpp's vocabulary of the tiny AR twin (stock gemma4 arch), loaded vocab-only."""
    llama_cpp = _llama_cpp_or_skip()
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(tiny_ar_gguf).encode(), params)
    assert model, "llama.cpp could not load the tiny gemma4 GGUF"
    yield llama_cpp, llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


def _llama_tokenize(llama_cpp, vocab, text: str, special: bool) -> list[int]:
    data = text.encode("utf-8")
    buf = (llama_cpp.llama_token * (len(data) + 8))()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), False, special)
    assert n >= 0
    return list(buf[:n])


def _llama_piece(llama_cpp, vocab, token: int, special: bool) -> bytes:
    import ctypes

    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    assert n >= 0
    return buf.raw[:n]


@pytest.mark.parametrize("text", TEXTS)
def test_llama_cpp_tokenizes_the_same(llama_vocab, tiny_vocab_obj, text):
    llama_cpp, vocab = llama_vocab
    assert _llama_tokenize(llama_cpp, vocab, text, True) == tiny_vocab_obj.encode(text, special=True)
    assert _llama_tokenize(llama_cpp, vocab, text, False) == tiny_vocab_obj.encode(text, special=False)


def test_llama_cpp_pieces_are_the_same(llama_vocab, tiny_vocab_obj):
    llama_cpp, vocab = llama_vocab
    for token in range(tiny_vocab_obj.vocab_size):
        for special in (False, True):
            assert _llama_piece(llama_cpp, vocab, token, special) == tiny_vocab_obj.piece_bytes(token, special), token


def test_llama_cpp_end_tokens(llama_vocab):
    llama_cpp, vocab = llama_vocab
    assert llama_cpp.llama_vocab_is_eog(vocab, EOS_ID) and llama_cpp.llama_vocab_is_eog(vocab, TURN_END_ID)
    assert llama_cpp.llama_vocab_bos(vocab) == BOS_ID


# -- torch-free tiny GGUFs -------------------------------------------------------------------------


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_gguf_is_deterministic(tiny_gguf, tmp_path):
    again = write_tiny_random_gguf(tmp_path / "again.gguf", seed=0)
    other = write_tiny_random_gguf(tmp_path / "other.gguf", seed=1)
    assert _sha(again) == _sha(tiny_gguf)
    assert _sha(other) != _sha(tiny_gguf)


def test_tiny_gguf_carries_the_tokenizer(tiny_gguf, tiny_vocab_obj):
    from gguf import GGUFReader

    r = GGUFReader(tiny_gguf)
    assert _gguf_field(r, "tokenizer.ggml.model") == "gemma4"
    assert _gguf_field(r, "tokenizer.ggml.tokens") == tiny_vocab_obj.tokens
    assert _gguf_field(r, "tokenizer.ggml.token_type") == tiny_vocab_obj.token_types
    assert _gguf_field(r, "tokenizer.ggml.merges") == tiny_vocab_obj.merges
    assert _gguf_field(r, "tokenizer.chat_template") == CHAT_TEMPLATE
    ids = {k: _gguf_field(r, f"tokenizer.ggml.{k}") for k in
           ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "mask_token_id")}
    assert ids == {"bos_token_id": 2, "eos_token_id": 1, "unknown_token_id": 3, "padding_token_id": 0,
                   "mask_token_id": 4}
    assert _gguf_field(r, "tokenizer.ggml.add_bos_token") is True
    assert _gguf_field(r, "tokenizer.ggml.add_space_prefix") is False


def test_tiny_ar_twin_shares_weights_and_takes_encoder_scalars(tiny_gguf, tiny_ar_gguf):
    from gguf import GGUFReader

    diff = {t.name: np.array(t.data) for t in GGUFReader(tiny_gguf).tensors}
    ar = {t.name: np.array(t.data) for t in GGUFReader(tiny_ar_gguf).tensors}
    assert GGUFReader(tiny_ar_gguf).fields["general.architecture"].contents() == "gemma4"
    assert not any(n.startswith("self_cond") or "enc_layer_output_scale" in n for n in ar)
    for name, value in ar.items():
        if "layer_output_scale" in name:
            assert np.array_equal(value, diff[name.replace("layer_output_scale", "enc_layer_output_scale")])
            assert not np.array_equal(value, diff[name])
        else:
            assert np.array_equal(value, diff[name]), name


def test_tiny_overrides_change_the_layout(tmp_path):
    from gguf import GGUFReader

    path = write_tiny_random_gguf(tmp_path / "t.gguf", num_hidden_layers=3, hidden_size=32, num_experts=8,
                                  canvas_length=8)
    r = GGUFReader(path)
    assert r.fields["diffusion-gemma.block_count"].contents() == 3
    assert r.fields["diffusion.canvas_length"].contents() == 8
    assert r.fields["diffusion-gemma.attention.sliding_window_pattern"].contents() == [True, True, False]
    exps = next(t for t in r.tensors if t.name == "blk.0.ffn_gate_up_exps.weight")
    assert list(exps.shape) == [32, 64, 8]
    with pytest.raises(DgError):
        write_tiny_random_gguf(tmp_path / "bad.gguf", top_k_experts=9)
    assert not (tmp_path / "bad.gguf").exists()


@pytest.mark.subprocess
def test_tiny_gguf_needs_no_torch(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from dgcli.testing.tiny import write_tiny_random_gguf\n"
        f"write_tiny_random_gguf({str(tmp_path / 'x.gguf')!r})\n"
        f"write_tiny_random_gguf({str(tmp_path / 'y.gguf')!r}, arch='gemma4', outtype='q8_0')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert (tmp_path / "x.gguf").stat().st_size > 0 and (tmp_path / "y.gguf").stat().st_size > 0


def test_synthetic_gguf_shapes_and_values(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    path = write_synthetic_gguf(tmp_path / "s.gguf", n_layer=2, vocab_size=4096, hidden=256, num_experts=4,
                                top_k_experts=2, intermediate_size=128, moe_intermediate_size=64,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                                num_global_key_value_heads=1)
    r = GGUFReader(path)
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 4096
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert list(embd.shape) == [256, 4096] and embd.tensor_type == GGMLQuantizationType.Q8_0
    values = dequantize(np.array(embd.data), GGMLQuantizationType.Q8_0)
    assert 0.3 < float(values.std()) < 0.7  # random, with the requested spread
    assert r.fields["diffusion-gemma.attention.head_count_kv"].contents() == [2, 1]
    with pytest.raises(DgError):
        write_synthetic_gguf(tmp_path / "small.gguf", vocab_size=10)


def test_synthetic_q4_k_m_types_and_spread(tmp_path):
    """outtype "q4_k_m": llama.cpp's Q4_K_M type choices (Q6_K embedding and more-bits ffn_down,
    Q4_K elsewhere, Q5_0/Q8_0 where rows do not fill 256-wide super-blocks), random blocks whose
    dequantized values have about the requested spread (finite, no overflowing scales)."""
    from gguf import GGMLQuantizationType as T, GGUFReader
    from gguf.quants import dequantize

    path = write_synthetic_gguf(tmp_path / "k.gguf", n_layer=8, vocab_size=4096, hidden=256, num_experts=4,
                                top_k_experts=2, intermediate_size=512, moe_intermediate_size=96,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                                num_global_key_value_heads=1, outtype="q4_k_m")
    types = {t.name: T(t.tensor_type) for t in GGUFReader(path).tensors}
    assert types["token_embd.weight"] == T.Q6_K
    assert types["blk.3.attn_q.weight"] == T.Q4_K
    # use_more_bits(i, 8): i < 1, i >= 7, (i - 1) % 3 == 2
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(8)] == \
        [T.Q6_K, T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q6_K, T.Q6_K]
    assert types["blk.0.ffn_down_exps.weight"] == T.Q8_0  # 96-wide rows: Q6_K falls back
    assert types["blk.1.ffn_down_exps.weight"] == T.Q5_0  # Q4_K falls back
    assert types["blk.0.ffn_gate_inp.weight"] == T.F32 and types["blk.0.attn_norm.weight"] == T.F32
    # declared as llama.cpp's quantizer declares it, so `dg info` says Q4_K_M, not the dominant Q6_K
    assert GGUFReader(path).fields["general.file_type"].contents() == 15
    assert info.read_info(path).file_type == "Q4_K_M"
    for t in GGUFReader(path).tensors:
        if T(t.tensor_type) in (T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0):
            values = dequantize(np.array(t.data), T(t.tensor_type))
            row = values.shape[-1]
            std = 0.5 if t.name == "token_embd.weight" else 1 / np.sqrt(row)
            assert np.isfinite(values).all()
            assert 0.3 * std < float(values.std()) < 3 * std, t.name


def test_synthetic_q4_k_m_runs_in_llama_cpp(tmp_path):
    from native_helpers import NATIVE_OK, NATIVE_REASON

    if not NATIVE_OK:
        pytest.skip(f"native library unavailable: {NATIVE_REASON}")
    from dgcli.runtime.model import DiffusionModel

    path = write_synthetic_gguf(tmp_path / "k.gguf", n_layer=2, vocab_size=4096, hidden=256, num_experts=4,
                                top_k_experts=2, intermediate_size=512, moe_intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                                num_global_key_value_heads=1, outtype="q4_k_m")
    with DiffusionModel(path, n_threads=1, n_ctx=512) as m:
        m.prefill([2, 105, 300, 301, 106])
        logits = m.decode_canvas(list(range(10, 10 + m.canvas_length)))
    assert np.isfinite(logits).all() and float(logits.std()) > 0.1
