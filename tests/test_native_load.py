"""Loading GGUFs through the native library: the published layout loads, bad files are refused with a
clear one-line ModelLoadError, the tokenizer / chat template / metadata come through. Torch-free."""

from __future__ import annotations

import numpy as np
import pytest

from dgcli.errors import DgError, InvalidParameter, ModelLoadError
from dgcli.params import DiffusionParams
from native_helpers import requires_native, rewrite_gguf

pytestmark = requires_native


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf):
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(tiny_gguf, n_threads=2, n_ctx=128) as m:
        yield m


def _load(path, cls_name="DiffusionModel"):
    from dgcli.runtime import model

    return getattr(model, cls_name)(path, n_threads=1, n_ctx=64)


def _refused(path, cls_name="DiffusionModel") -> str:
    with pytest.raises(ModelLoadError) as info:
        _load(path, cls_name)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_published_layout_loads(tiny_model, tiny_vocab_obj):
    m = tiny_model
    assert m.vocab_size == tiny_vocab_obj.vocab_size
    assert m.canvas_length == 16
    assert m.end_token_ids == [1, 106]
    assert isinstance(m.default_params, DiffusionParams)
    assert m.default_params == m.default_params.validate()


def test_metadata_defaults_come_from_eb_keys(tiny_gguf, tmp_path):
    import gguf

    path = rewrite_gguf(tiny_gguf, tmp_path / "eb.gguf", set_keys={
        "diffusion.eb_max_steps": (12, gguf.GGUFValueType.UINT32),
        "diffusion.eb_t_min": (0.25, gguf.GGUFValueType.FLOAT32),
        "diffusion.eb_entropy_bound": (0.5, gguf.GGUFValueType.FLOAT32),
    })
    with _load(path) as m:
        assert m.default_params.max_denoising_steps == 12
        assert m.default_params.t_min == pytest.approx(0.25)
        assert m.default_params.entropy_bound == pytest.approx(0.5)
    # optional: without any eb_* key the reference defaults apply
    drop = ("diffusion.eb_max_steps", "diffusion.eb_t_min", "diffusion.eb_t_max", "diffusion.eb_entropy_bound",
            "diffusion.eb_stability_threshold", "diffusion.eb_confidence_threshold")
    with _load(rewrite_gguf(tiny_gguf, tmp_path / "no-eb.gguf", drop_keys=drop)) as m:
        assert m.default_params == DiffusionParams()


def test_tokenizer_and_chat_template(tiny_model, tiny_vocab_obj):
    text = "Hello, world!\n  tabs\tand spaces"
    assert tiny_model.tokenize(text, add_bos=False) == tiny_vocab_obj.encode(text)
    assert tiny_model.tokenize(text, add_bos=True)[0] == 2
    assert tiny_model.detokenize(tiny_vocab_obj.encode(text)) == text
    assert tiny_model.chat_prompt("What is 3+5?") == tiny_vocab_obj.chat_prompt_ids("What is 3+5?")


def test_prefill_decode_shapes_and_errors(tiny_model):
    m = tiny_model
    m.reset()
    m.prefill([2, 40, 41, 42])
    assert m.n_past == 4
    logits = m.decode_canvas(list(range(50, 66)))
    assert logits.shape == (16, m.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all() and np.abs(logits).max() <= 30.0  # softcapped
    assert m.n_past == 4
    with pytest.raises(InvalidParameter):
        m.decode_canvas([m.vocab_size] + [0] * 15)
    with pytest.raises(InvalidParameter):
        m.decode_canvas(list(range(16)), sc_logits=np.zeros((3, m.vocab_size), np.float32))
    with pytest.raises(InvalidParameter):
        m.prefill([])
    with pytest.raises(DgError):
        m.prefill([40] * m.n_ctx)  # beyond n_ctx


def test_stock_gemma4_still_loads(tiny_ar_gguf):
    from dgcli.runtime.model import ArModel

    with ArModel(tiny_ar_gguf, n_threads=1, n_ctx=64) as ar:
        logits = ar.prefill([2, 40, 41])
        assert logits.shape == (ar.vocab_size,) and np.isfinite(logits).all()
        assert ar.decode_token(int(np.argmax(logits))).shape == (ar.vocab_size,)


def test_wrong_architecture_refused(tiny_gguf, tiny_ar_gguf):
    assert "gemma4" in _refused(tiny_ar_gguf, "DiffusionModel")
    assert "diffusion-gemma" in _refused(tiny_gguf, "ArModel")


def test_not_found_not_gguf_truncated(tiny_gguf, tmp_path):
    assert "not found" in _refused(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 not a gguf at all")
    assert "not a GGUF" in _refused(junk)
    data = tiny_gguf.read_bytes()
    for cut, words in ((100, "truncated or malformed"), (len(data) - 1000, "truncated")):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        assert words in _refused(short)


def test_missing_canvas_length_refused(tiny_gguf, tmp_path):
    path = rewrite_gguf(tiny_gguf, tmp_path / "nocanvas.gguf", drop_keys=("diffusion.canvas_length",))
    assert "diffusion.canvas_length" in _refused(path)


def test_wrong_key_type_refused(tiny_gguf, tmp_path):
    import gguf

    path = rewrite_gguf(tiny_gguf, tmp_path / "badtype.gguf",
                        set_keys={"diffusion.canvas_length": ("sixteen", gguf.GGUFValueType.STRING)})
    message = _refused(path)
    assert "diffusion.canvas_length" in message and "type" in message


@pytest.mark.parametrize("tensor", ["blk.0.enc_layer_output_scale.weight", "blk.2.layer_output_scale.weight",
                                    "self_cond_up.weight", "blk.1.attn_v.weight", "blk.3.ffn_gate_up_exps.weight"])
def test_missing_tensor_refused(tiny_gguf, tmp_path, tensor):
    path = rewrite_gguf(tiny_gguf, tmp_path / "missing-tensor.gguf", drop_tensors=(tensor,))
    assert tensor in _refused(path)


def test_misshaped_tensor_refused(tiny_gguf, tmp_path):
    def cut_row(name, data):
        return data[:-1] if name == "self_cond_down.weight" else data

    path = rewrite_gguf(tiny_gguf, tmp_path / "misshaped.gguf", tensor_edit=cut_row)
    message = _refused(path)
    assert "self_cond_down.weight" in message and "shape" in message


def test_model_without_sliding_layers_refused(tmp_path):
    from dgcli.testing.tiny import write_tiny_random_gguf

    path = write_tiny_random_gguf(tmp_path / "all-full.gguf", layer_types=["full_attention"] * 6)
    assert "sliding" in _refused(path)


def test_default_threads_is_one_for_tiny_files_and_all_cores_for_big_ones(tmp_path):
    import os

    from dgcli.runtime.cpu import SINGLE_THREAD_BELOW_BYTES, default_threads

    small = tmp_path / "small.gguf"
    small.write_bytes(b"\0" * 1024)
    big = tmp_path / "big.gguf"
    with open(big, "wb") as f:  # sparse: the size is what counts
        f.truncate(SINGLE_THREAD_BELOW_BYTES + 1)
    assert default_threads(small) == 1
    assert default_threads(big) == max(1, os.cpu_count() or 1)


def test_thinking_channel_markers_survive_detokenizing(tiny_gguf, tmp_path):
    """Gemma 4's <|channel> / <channel|> are control tokens; the text keeps them (for --thinking),
    while other control tokens are still dropped."""
    import gguf

    from dgcli.runtime.model import DiffusionModel
    from native_helpers import rewrite_gguf

    fields = gguf.GGUFReader(str(tiny_gguf)).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    tokens[100], tokens[101] = "<|channel>", "<channel|>"  # two unused slots, typed control
    types[100] = types[101] = gguf.TokenType.CONTROL
    marked = rewrite_gguf(tiny_gguf, tmp_path / "marked.gguf", set_keys={
        "tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY),
        "tokenizer.ggml.token_type": ([int(t) for t in types], gguf.GGUFValueType.ARRAY)})
    eos = 1
    with DiffusionModel(marked, n_threads=1) as model:
        hello = model.tokenize("hi", add_bos=False)
        text = model.detokenize([100] + model.tokenize("thought", add_bos=False) + [101] + hello + [eos])
    assert text == "<|channel>thought<channel|>hi"


@pytest.mark.subprocess
def test_gemma4_without_a_sliding_layer_is_refused_not_aborted(tmp_path):
    """Stock gemma4 asserts (a process abort) on a file whose layers are all full-attention; the AR
    model refuses it first. Run in a subprocess: on the old code the abort would take pytest down."""
    import subprocess
    import sys

    from dgcli.testing.tiny import write_tiny_random_gguf

    path = write_tiny_random_gguf(tmp_path / "full.gguf", arch="gemma4", num_hidden_layers=2,
                                  layer_types=["full_attention", "full_attention"])
    code = ("from dgcli.runtime.model import ArModel\n"
            "from dgcli.errors import ModelLoadError\n"
            f"try:\n    ArModel({str(path)!r}, n_threads=1, n_ctx=64)\n"
            "except ModelLoadError as err:\n    print('refused:', err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    assert "has no sliding layer" in out.stdout
