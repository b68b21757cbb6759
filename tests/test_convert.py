"""The converter: HF DiffusionGemma checkpoint -> GGUF in the published layout, and the AR gemma4 twin
(its tokenizer: test_convert_tokenizer.py)."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from dgcli.convert import convert_checkpoint, convert_main, params_from_hf_config
from dgcli.errors import DgError
from dgcli.params import DiffusionParams

# needs torch and transformers: skipped without them (conftest.py)
needs_torch = pytest.mark.reference

# The reference doc's key list for the published layout ("A tiny checkpoint converted by the
# published converter has exactly these keys"), plus the chat template the tokenizer carries.
ARCH_KEYS = [
    "block_count", "context_length", "embedding_length", "feed_forward_length", "expert_feed_forward_length",
    "expert_count", "expert_used_count", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.key_length_swa", "attention.value_length_swa",
    "attention.sliding_window", "attention.sliding_window_pattern", "attention.shared_kv_layers",
    "embedding_length_per_layer_input", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "rope.freq_base_swa", "rope.dimension_count", "rope.dimension_count_swa", "final_logit_softcapping",
]
DIFFUSION_KEYS = ["diffusion.canvas_length", "diffusion.eb_max_steps", "diffusion.eb_t_min", "diffusion.eb_t_max",
                  "diffusion.eb_entropy_bound", "diffusion.eb_stability_threshold",
                  "diffusion.eb_confidence_threshold"]
TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.ggml.mask_token_id",
                  "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
PER_LAYER = ["attn_norm", "attn_q", "attn_k", "attn_q_norm", "attn_k_norm", "attn_output", "post_attention_norm",
             "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm_1", "pre_ffw_norm_2", "ffn_gate_inp",
             "ffn_gate_up_exps", "ffn_down_exps", "post_ffw_norm_2", "post_ffw_norm", "layer_output_scale",
             "enc_layer_output_scale"]


def _reader(path):
    from gguf import GGUFReader

    return GGUFReader(path)


def _fields(path) -> dict:
    r = _reader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensors(path) -> dict[str, np.ndarray]:
    """name -> float32 numpy array in the HF orientation (ggml ne reversed), dequantized."""
    from gguf.quants import dequantize

    out = {}
    for t in _reader(path).tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = dequantize(np.array(t.data), t.tensor_type).astype(np.float32).reshape(shape)
    return out


def _expected_tensors(model) -> dict[str, np.ndarray]:
    """Each GGUF tensor as read straight off the Transformers modules (independent of the converter)."""
    text = model.config.get_text_config()
    dec = model.model.decoder
    enc = model.model.encoder.language_model
    t = lambda x: x.detach().float().numpy()  # noqa: E731
    inv_freq = model.model.decoder.rotary_emb.full_attention_inv_freq
    out = {
        "token_embd.weight": t(dec.embed_tokens.weight),
        "output_norm.weight": t(dec.norm.weight),
        "rope_freqs.weight": np.where(t(inv_freq) > 0, 1.0, 1e30).astype(np.float32),
        "self_cond_pre_norm.weight": t(dec.self_conditioning.pre_norm.weight),
        "self_cond_gate.weight": t(dec.self_conditioning.gate_proj.weight),
        "self_cond_up.weight": t(dec.self_conditioning.up_proj.weight),
        "self_cond_down.weight": t(dec.self_conditioning.down_proj.weight),
    }
    for i, layer in enumerate(dec.layers):
        a = layer.self_attn
        p = f"blk.{i}."
        out.update({
            p + "attn_norm.weight": t(layer.input_layernorm.weight),
            p + "attn_q.weight": t(a.q_proj.weight),
            p + "attn_k.weight": t(a.k_proj.weight),
            p + "attn_q_norm.weight": t(a.q_norm.weight),
            p + "attn_k_norm.weight": t(a.k_norm.weight),
            p + "attn_output.weight": t(a.o_proj.weight),
            p + "post_attention_norm.weight": t(layer.post_attention_layernorm.weight),
            p + "ffn_norm.weight": t(layer.pre_feedforward_layernorm.weight),
            p + "ffn_gate.weight": t(layer.mlp.gate_proj.weight),
            p + "ffn_up.weight": t(layer.mlp.up_proj.weight),
            p + "ffn_down.weight": t(layer.mlp.down_proj.weight),
            p + "post_ffw_norm_1.weight": t(layer.post_feedforward_layernorm_1.weight),
            p + "pre_ffw_norm_2.weight": t(layer.pre_feedforward_layernorm_2.weight),
            p + "ffn_gate_inp.weight": t(layer.router.proj.weight),
            p + "ffn_gate_inp.scale": t(layer.router.scale),
            p + "ffn_gate_up_exps.weight": t(layer.experts.gate_up_proj),
            p + "ffn_down_exps.weight": t(layer.experts.down_proj),
            p + "ffn_down_exps.scale": t(layer.router.per_expert_scale),
            p + "post_ffw_norm_2.weight": t(layer.post_feedforward_layernorm_2.weight),
            p + "post_ffw_norm.weight": t(layer.post_feedforward_layernorm.weight),
            p + "layer_output_scale.weight": t(layer.layer_scalar),
            p + "enc_layer_output_scale.weight": t(enc.layers[i].layer_scalar),
        })
        if text.layer_types[i] == "sliding_attention":
            out[p + "attn_v.weight"] = t(a.v_proj.weight)
    return out


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the published layout ---------------------------------------------------------------------


@needs_torch
def test_every_tensor_equals_the_checkpoint(reference_model, reference_gguf):
    got = _tensors(reference_gguf)
    expected = _expected_tensors(reference_model)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@needs_torch
def test_layer_scalars_are_split_and_ties_hold(reference_model, reference_gguf):
    from dgcli.testing.reference import check_ties

    check_ties(reference_model)
    got = _tensors(reference_gguf)
    for i in range(6):
        assert got[f"blk.{i}.layer_output_scale.weight"] != got[f"blk.{i}.enc_layer_output_scale.weight"]


@needs_torch
def test_tensor_set_per_layer(reference_gguf):
    names = set(_tensors(reference_gguf))
    for i, sliding in enumerate([True, True, False, True, True, False]):
        for role in PER_LAYER:
            assert any(n.startswith(f"blk.{i}.{role}.") for n in names), (i, role)
        assert (f"blk.{i}.attn_v.weight" in names) == sliding  # full layers are k_eq_v
        assert f"blk.{i}.ffn_gate_inp.scale" in names and f"blk.{i}.ffn_down_exps.scale" in names
    assert "output.weight" not in names  # the LM head is tied to token_embd
    assert not any("vision" in n for n in names)


@needs_torch
def test_ggml_shapes_follow_the_gemma4_loader(reference_gguf):
    # ggml ne order, as src/models/gemma4.cpp creates them (n_embd 64, vocab 500, 2 heads, ...)
    shapes = {t.name: [int(x) for x in t.shape] for t in _reader(reference_gguf).tensors}
    assert shapes["token_embd.weight"] == [64, 500]
    assert shapes["rope_freqs.weight"] == [16]
    assert shapes["blk.0.attn_q.weight"] == [64, 2 * 16]
    assert shapes["blk.2.attn_q.weight"] == [64, 2 * 32]
    assert shapes["blk.2.attn_k.weight"] == [64, 1 * 32]
    assert shapes["blk.2.attn_output.weight"] == [2 * 32, 64]
    assert shapes["blk.0.ffn_gate_inp.weight"] == [64, 4]
    assert shapes["blk.0.ffn_gate_up_exps.weight"] == [64, 2 * 32, 4]
    assert shapes["blk.0.ffn_down_exps.weight"] == [32, 64, 4]
    assert shapes["blk.0.ffn_down_exps.scale"] == [4]
    assert shapes["blk.0.layer_output_scale.weight"] == [1]


@needs_torch
def test_key_set_and_values(reference_model, reference_gguf, tiny_vocab_obj):
    fields = _fields(reference_gguf)
    arch = "diffusion-gemma"
    expected_keys = {"general.architecture", f"{arch}.attention.causal"} | {f"{arch}.{k}" for k in ARCH_KEYS}
    expected_keys |= set(DIFFUSION_KEYS) | set(TOKENIZER_KEYS) | {"dg.reference_defaults"}
    assert set(fields) == expected_keys
    # config.json never carries the softcap (a class constant of the reference's config): dg writes
    # the reference's value, which the published converter leaves out, and says so
    assert fields["dg.reference_defaults"] == [f"{arch}.final_logit_softcapping"]
    assert fields[f"{arch}.final_logit_softcapping"] == 30.0

    text = reference_model.config.get_text_config()
    assert fields["general.architecture"] == arch
    v = lambda k: fields[f"{arch}.{k}"]  # noqa: E731
    assert v("block_count") == text.num_hidden_layers
    assert v("context_length") == text.max_position_embeddings
    assert v("embedding_length") == text.hidden_size
    assert v("feed_forward_length") == text.intermediate_size
    assert v("expert_feed_forward_length") == text.moe_intermediate_size
    assert v("expert_count") == text.num_experts
    assert v("expert_used_count") == text.top_k_experts
    assert v("attention.head_count") == text.num_attention_heads
    assert v("attention.head_count_kv") == [text.per_layer_config[i].num_key_value_heads for i in range(6)]
    assert v("attention.key_length") == v("attention.value_length") == 32
    assert v("attention.key_length_swa") == v("attention.value_length_swa") == 16
    assert v("attention.sliding_window") == 8
    assert v("attention.sliding_window_pattern") == [t == "sliding_attention" for t in text.layer_types]
    assert v("attention.shared_kv_layers") == 0
    assert v("embedding_length_per_layer_input") == 0
    assert v("attention.layer_norm_rms_epsilon") == pytest.approx(text.rms_norm_eps)
    assert v("rope.freq_base") == text.rope_parameters["full_attention"]["rope_theta"]
    assert v("rope.freq_base_swa") == text.rope_parameters["sliding_attention"]["rope_theta"]
    assert v("rope.dimension_count") == 32 and v("rope.dimension_count_swa") == 16
    assert v("final_logit_softcapping") == text.final_logit_softcapping
    assert v("attention.causal") is False
    assert fields["diffusion.canvas_length"] == reference_model.config.canvas_length
    assert fields["tokenizer.ggml.model"] == "gemma4"
    assert fields["tokenizer.ggml.tokens"] == tiny_vocab_obj.tokens


@needs_torch
def test_rope_freqs_rotate_a_quarter_of_the_full_head(reference_gguf):
    freqs = _tensors(reference_gguf)["rope_freqs.weight"]
    # partial_rotary_factor 0.25 of head dim 32: 4 rotated pairs out of 16
    assert list(freqs[:4]) == [1.0] * 4 and np.all(freqs[4:] == np.float32(1e30))


@needs_torch
def test_tokenizer_round_trips_through_the_checkpoint(reference_gguf, tiny_gguf):
    # tokenizer.json written into the checkpoint -> the same tokenizer keys the tiny vocab writes itself
    converted, direct = _fields(reference_gguf), _fields(tiny_gguf)
    for key in TOKENIZER_KEYS:
        assert converted[key] == direct[key], key


# -- config forms and generation config -----------------------------------------------------------


@needs_torch
def test_both_config_forms_give_identical_ggufs(reference_model, reference_checkpoint, tmp_path):
    from dgcli.testing.reference import save_checkpoint

    saved = save_checkpoint(reference_model, tmp_path / "saved", config_form="saved")
    text_config = json.loads((saved / "config.json").read_text())["text_config"]
    assert "per_layer_config" in text_config and "global_head_dim" not in text_config
    google_text = json.loads((reference_checkpoint / "config.json").read_text())["text_config"]
    assert "global_head_dim" in google_text and "per_layer_config" not in google_text
    a = convert_checkpoint(saved, tmp_path / "saved.gguf")
    b = convert_checkpoint(reference_checkpoint, tmp_path / "google.gguf")
    assert _sha(a) == _sha(b)


@needs_torch
def test_per_layer_kv_heads_in_both_forms(tmp_path):
    import torch

    from dgcli.testing.reference import random_model, save_checkpoint, tiny_config

    torch.set_num_threads(1)
    model = random_model(tiny_config(num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1),
                         seed=3)
    outputs = []
    for form in ("google", "saved"):
        ckpt = save_checkpoint(model, tmp_path / form, config_form=form)
        outputs.append(convert_checkpoint(ckpt, tmp_path / f"{form}.gguf"))
        assert _fields(outputs[-1])["diffusion-gemma.attention.head_count_kv"] == [2, 2, 1, 2, 2, 1]
    assert _sha(outputs[0]) == _sha(outputs[1])
    np.testing.assert_array_equal(_tensors(outputs[0])["blk.2.attn_k.weight"],
                                  model.model.decoder.layers[2].self_attn.k_proj.weight.detach().numpy())


@needs_torch
def test_generation_config_nulls_fall_back_to_defaults(reference_model, tmp_path):
    from dgcli.testing.reference import save_checkpoint

    ckpt = save_checkpoint(reference_model, tmp_path / "nulls", generation_nulls=True)
    fields = _fields(convert_checkpoint(ckpt, tmp_path / "nulls.gguf"))
    d = DiffusionParams()
    assert fields["diffusion.eb_max_steps"] == d.max_denoising_steps
    assert fields["diffusion.eb_t_min"] == pytest.approx(d.t_min)
    assert fields["diffusion.eb_t_max"] == pytest.approx(d.t_max)
    assert fields["diffusion.eb_entropy_bound"] == pytest.approx(d.entropy_bound)
    assert fields["diffusion.eb_stability_threshold"] == d.stability_threshold
    assert fields["diffusion.eb_confidence_threshold"] == pytest.approx(d.confidence_threshold)
    assert fields["dg.reference_defaults"] == ["diffusion-gemma.final_logit_softcapping"] + DIFFUSION_KEYS[1:]


@needs_torch
def test_generation_config_values_are_carried(reference_checkpoint, tmp_path):
    ckpt = tmp_path / "custom"
    shutil.copytree(reference_checkpoint, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({
        "max_denoising_steps": 12, "t_min": 0.25, "t_max": 0.9, "stability_threshold": 3,
        "confidence_threshold": 0.01, "sampler_config": {"entropy_bound": 0.3}}))
    fields = _fields(convert_checkpoint(ckpt, tmp_path / "custom.gguf"))
    assert fields["diffusion.eb_max_steps"] == 12
    assert fields["diffusion.eb_t_min"] == pytest.approx(0.25)
    assert fields["diffusion.eb_t_max"] == pytest.approx(0.9)
    assert fields["diffusion.eb_entropy_bound"] == pytest.approx(0.3)
    assert fields["diffusion.eb_stability_threshold"] == 3
    assert fields["diffusion.eb_confidence_threshold"] == pytest.approx(0.01)
    assert fields["dg.reference_defaults"] == ["diffusion-gemma.final_logit_softcapping"]
    (ckpt / "generation_config.json").unlink()
    fields = _fields(convert_checkpoint(ckpt, tmp_path / "nogen.gguf"))
    assert fields["diffusion.eb_max_steps"] == 48
    assert fields["dg.reference_defaults"] == ["diffusion-gemma.final_logit_softcapping"] + DIFFUSION_KEYS[1:]


def test_reference_defaults_name_only_what_the_checkpoint_left_out(tmp_path):
    from dgcli.testing.tiny import tiny_hf_config_dict, write_tiny_random_gguf

    generation = {"max_denoising_steps": 12, "t_min": None, "sampler_config": {"entropy_bound": 0.3}}
    params = params_from_hf_config(tiny_hf_config_dict(final_logit_softcapping=25.0), generation)
    assert params.softcap == 25.0 and params.diffusion.max_denoising_steps == 12
    assert params.reference_defaults == ("t_min", "t_max", "stability_threshold", "confidence_threshold")
    fields = _fields(write_tiny_random_gguf(tmp_path / "capped.gguf", final_logit_softcapping=25.0))
    assert fields["dg.reference_defaults"] == DIFFUSION_KEYS[1:]  # the tiny writer has no generation config
    fields = _fields(write_tiny_random_gguf(tmp_path / "capped-ar.gguf", arch="gemma4", final_logit_softcapping=25.0))
    assert "dg.reference_defaults" not in fields  # nothing the AR twin writes came from a default


# -- output types -----------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_outtypes_within_rounding(reference_checkpoint, reference_gguf, tmp_path, outtype):
    from gguf import GGMLQuantizationType as T

    path = convert_checkpoint(reference_checkpoint, tmp_path / f"{outtype}.gguf", outtype)
    exact = _tensors(reference_gguf)
    got = _tensors(path)
    types = {t.name: t.tensor_type for t in _reader(path).tensors}
    wanted = {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[outtype]
    assert types["blk.0.attn_q.weight"] == wanted and types["token_embd.weight"] == wanted
    assert types["blk.0.attn_norm.weight"] == T.F32 and types["blk.0.ffn_gate_inp.weight"] == T.F32
    assert path.stat().st_size < reference_gguf.stat().st_size
    for name, ref in exact.items():
        err = np.abs(got[name] - ref)
        if types[name] == T.F32:
            np.testing.assert_array_equal(got[name], ref, err_msg=name)
        elif types[name] == T.F16:
            assert np.all(err <= np.abs(ref) * 2 ** -11 + 6e-8), name
        elif types[name] == T.BF16:
            assert np.all(err <= np.abs(ref) * 2 ** -8), name
        else:  # Q8_0: blocks of 32 in steps of d = max|block| / 127, with d itself stored as f16
            blocks_ref = ref.reshape(-1, 32)
            bound = np.abs(blocks_ref).max(axis=1, keepdims=True) / 127 * (0.5 + 127 * 2 ** -11) + 1e-6
            assert np.all(err.reshape(-1, 32) <= bound), name
        if types[name] != T.F32:
            assert np.any(err > 0), f"{name} was not rounded at all"


def test_unknown_outtype_is_refused(tmp_path):
    with pytest.raises(DgError, match="outtype"):
        convert_checkpoint(tmp_path, tmp_path / "x.gguf", outtype="q4_k")


# -- the AR twin ------------------------------------------------------------------------------


@needs_torch
def test_ar_twin_layout(reference_model, reference_gguf, reference_ar_gguf):
    fields = _fields(reference_ar_gguf)
    assert fields["general.architecture"] == "gemma4"
    assert not any(k.startswith("diffusion") for k in fields)
    assert set(fields) == ({"general.architecture", "dg.reference_defaults"} | {f"gemma4.{k}" for k in ARCH_KEYS}
                           | set(TOKENIZER_KEYS))
    assert fields["dg.reference_defaults"] == ["gemma4.final_logit_softcapping"]
    twin = _tensors(reference_ar_gguf)
    diff = _tensors(reference_gguf)
    assert not any(n.startswith("self_cond") or "enc_layer_output_scale" in n for n in twin)
    enc = reference_model.model.encoder.language_model
    for i in range(6):
        np.testing.assert_array_equal(twin[f"blk.{i}.layer_output_scale.weight"],
                                      enc.layers[i].layer_scalar.detach().numpy())
    for name, value in twin.items():
        if "layer_output_scale" not in name:
            np.testing.assert_array_equal(value, diff[name], err_msg=name)


@needs_torch
def test_convert_main_writes_both(reference_checkpoint, tmp_path):
    messages = []
    written = convert_main(reference_checkpoint, tmp_path / "m.gguf", outtype="f32", ar_twin=tmp_path / "ar.gguf",
                           echo=messages.append)
    assert [p.name for p in written] == ["m.gguf", "ar.gguf"]
    assert len(messages) == 2 and "gemma4" in messages[1]


# -- bad inputs -------------------------------------------------------------------------------------


def _minimal_dir(tmp_path, config) -> object:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def test_missing_directory(tmp_path):
    with pytest.raises(DgError, match="does not exist"):
        convert_checkpoint(tmp_path / "nope", tmp_path / "x.gguf")


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DgError, match="config.json is missing"):
        convert_checkpoint(tmp_path / "empty", tmp_path / "x.gguf")


def test_unreadable_config(tmp_path):
    d = _minimal_dir(tmp_path, "{not json")
    with pytest.raises(DgError, match="cannot read config.json"):
        convert_checkpoint(d, tmp_path / "x.gguf")


def test_unknown_model_type(tmp_path):
    d = _minimal_dir(tmp_path, {"model_type": "llama", "text_config": {}})
    with pytest.raises(DgError, match="unsupported model_type 'llama'"):
        convert_checkpoint(d, tmp_path / "x.gguf")


def test_config_without_experts(tmp_path):
    from dgcli.testing.tiny import tiny_hf_config_dict

    config = tiny_hf_config_dict()
    del config["text_config"]["num_experts"]
    with pytest.raises(DgError, match="num_experts"):
        params_from_hf_config(config)


def test_missing_weights(tmp_path):
    from dgcli.testing.tiny import tiny_hf_config_dict, tiny_vocab

    d = _minimal_dir(tmp_path, tiny_hf_config_dict())
    tiny_vocab().save_hf(d)
    with pytest.raises(DgError, match="no .safetensors"):
        convert_checkpoint(d, tmp_path / "x.gguf")


@needs_torch
def test_config_that_does_not_match_the_weights(reference_checkpoint, tmp_path):
    ckpt = tmp_path / "mismatch"
    shutil.copytree(reference_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 128
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(DgError, match="has shape"):
        convert_checkpoint(ckpt, tmp_path / "x.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["mismatch"]  # no output, no temporary


def test_untied_word_embeddings_are_refused():
    # the layout's LM head is token_embd: an untied checkpoint was converted with the wrong head
    from dgcli.testing.tiny import tiny_hf_config_dict

    with pytest.raises(DgError, match="tie_word_embeddings = false: a separate LM head"):
        params_from_hf_config({**tiny_hf_config_dict(), "tie_word_embeddings": False})
    params_from_hf_config({**tiny_hf_config_dict(), "tie_word_embeddings": True})


@needs_torch
@pytest.mark.parametrize("same", [True, False])
def test_an_lm_head_other_than_the_embedding_is_refused(reference_checkpoint, tmp_path, same):
    from safetensors.numpy import save_file

    from dgcli.convert import SafetensorsIndex

    ckpt = tmp_path / "head"
    shutil.copytree(reference_checkpoint, ckpt)
    embd = SafetensorsIndex([ckpt / "model.safetensors"]).load("model.decoder.embed_tokens.weight")
    head = embd.copy()
    if not same:
        head[-1, 0] += 1.0  # one weight of the last row
    save_file({"lm_head.weight": head}, str(ckpt / "lm_head.safetensors"))
    if same:  # a saved copy of the tied head is fine
        assert convert_checkpoint(ckpt, tmp_path / "x.gguf").is_file()
        return
    with pytest.raises(DgError, match=r"lm_head.weight that differs from model.decoder.embed_tokens.weight"):
        convert_checkpoint(ckpt, tmp_path / "x.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["head"]


@needs_torch
def test_truncated_weights(reference_checkpoint, tmp_path):
    ckpt = tmp_path / "trunc"
    shutil.copytree(reference_checkpoint, ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(DgError, match="truncated"):
        convert_checkpoint(ckpt, tmp_path / "x.gguf")


@needs_torch
def test_missing_tokenizer(reference_checkpoint, tmp_path):
    ckpt = tmp_path / "notok"
    shutil.copytree(reference_checkpoint, ckpt)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(DgError, match="tokenizer.json is missing"):
        convert_checkpoint(ckpt, tmp_path / "x.gguf")


def _set_vocab_id(text, value):
    return lambda tokenizer: tokenizer["model"]["vocab"].__setitem__(text, value)


@pytest.mark.parametrize("edit, message", [
    (_set_vocab_id("a", "7"), r"gives token 'a' the id '7'"),
    (_set_vocab_id("a", -1), r"gives token 'a' the id -1"),
    (_set_vocab_id("a", True), r"gives token 'a' the id True"),
    (_set_vocab_id("a", 500), r"token 'a' at id 500 but the model's vocab_size is 500"),
    (lambda t: t["added_tokens"].append({"id": 499, "content": "a"}), r"has token 'a' twice \(ids \d+ and 499\)"),
    (lambda t: t["added_tokens"].append("<extra>"), r"malformed added token '<extra>'"),
    (lambda t: t["added_tokens"].append({"id": 499, "content": ""}), r"malformed added token"),
    (lambda t: t.__setitem__("added_tokens", {"id": 1}), r"added_tokens must be a list"),
    (lambda t: t["model"]["merges"].append(["a"]), r"malformed merge \['a'\]"),
])
def test_malformed_tokenizer_is_refused(tmp_path, edit, message):
    from dgcli.convert import vocab_from_hf_dir
    from dgcli.testing.tiny import tiny_vocab

    tiny_vocab().save_hf(tmp_path)
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    edit(tokenizer)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    with pytest.raises(DgError, match=message):
        vocab_from_hf_dir(tmp_path, 500)


# -- the AR twin in stock llama.cpp ---------------------------------------------------------------


@needs_torch
def test_ar_twin_runs_in_llama_cpp_with_reference_logits(reference_model, reference_ar_gguf, tiny_vocab_obj):
    try:
        from llama_cpp import Llama
    except Exception:
        pytest.skip("native build not installed (llama_cpp is not importable)")
    from dgcli.testing.reference import reference_causal_logits

    # longer than the sliding window (8), so the sliding layers' window matters
    ids = tiny_vocab_obj.chat_prompt_ids("The quick brown fox jumps over the lazy dog")
    # F32 K/V and no flash attention: with llama.cpp's default F16 cache, the rounding flips an MoE
    # routing near-tie of this random model at position 38 (logits jump by ~9 there; a discrete
    # choice, not a layout error: every position before it agrees to 0.1). What remains is stock
    # gemma4's F16-table GELU, measured 0.045 max here.
    f32 = 0  # GGML_TYPE_F32
    llm = Llama(model_path=str(reference_ar_gguf), n_ctx=128, n_batch=128, n_threads=1, logits_all=True,
                verbose=False, flash_attn=False, type_k=f32, type_v=f32)
    try:
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    expected = reference_causal_logits(reference_model, ids)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=0.1)
    assert np.array_equal(got.argmax(-1), expected.argmax(-1))


# -- checkpoint storage variants ------------------------------------------------------------------


@needs_torch
def test_bf16_checkpoint_is_read_exactly(tmp_path):
    import torch

    from dgcli.testing.reference import random_model, save_checkpoint, tiny_config

    torch.set_num_threads(1)
    model = random_model(tiny_config(), seed=5).to(torch.bfloat16)
    ckpt = save_checkpoint(model, tmp_path / "bf16")
    header_len = int.from_bytes((ckpt / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((ckpt / "model.safetensors").read_bytes()[8:8 + header_len])
    assert header["model.decoder.layers.0.self_attn.q_proj.weight"]["dtype"] == "BF16"
    got = _tensors(convert_checkpoint(ckpt, tmp_path / "bf16.gguf", "f32"))
    expected = _expected_tensors(model)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@needs_torch
def test_sharded_checkpoint(reference_model, reference_gguf, tmp_path):
    ckpt = tmp_path / "sharded"
    reference_model.save_pretrained(ckpt, max_shard_size="100KB")
    assert (ckpt / "model.safetensors.index.json").is_file()
    assert len(list(ckpt.glob("*.safetensors"))) > 1
    from dgcli.testing.reference import to_google_config
    from dgcli.testing.tiny import tiny_vocab

    (ckpt / "config.json").write_text(json.dumps(to_google_config(json.loads((ckpt / "config.json").read_text()))))
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    tiny_vocab().save_hf(ckpt)
    converted = convert_checkpoint(ckpt, tmp_path / "sharded.gguf")
    got, expected = _tensors(converted), _tensors(reference_gguf)
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


# -- the layout carries everything the forward pass needs -----------------------------------------


def _rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _rope_neox(x, positions, base, freq_factors=None):
    """llama.cpp's NEOX rope over the whole head: pair (i, i + d/2), theta = pos * base^(-2i/d) / factor."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if freq_factors is not None:
        inv = inv / freq_factors
    ang = positions[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _gemma4_causal_logits_from_gguf(path, ids):
    """A numpy reading of a gemma4 GGUF, following llama.cpp's gemma4 graph (src/models/gemma4.cpp)."""
    f = _fields(path)
    W = {k: v.astype(np.float64) for k, v in _tensors(path).items()}
    a = lambda k: f[f"gemma4.{k}"]  # noqa: E731
    n_embd, n_head, eps = a("embedding_length"), a("attention.head_count"), a("attention.layer_norm_rms_epsilon")
    is_swa, kv_heads, n_swa = a("attention.sliding_window_pattern"), a("attention.head_count_kv"), a("attention.sliding_window")
    n_used, cap = a("expert_used_count"), a("final_logit_softcapping")
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd.weight"][ids] * np.sqrt(n_embd)
    for il in range(a("block_count")):
        L = lambda k: W[f"blk.{il}.{k}"]  # noqa: E731
        hd = a("attention.key_length_swa") if is_swa[il] else a("attention.key_length")
        base = a("rope.freq_base_swa") if is_swa[il] else a("rope.freq_base")
        ff = None if is_swa[il] else W["rope_freqs.weight"]
        h = _rms(x, L("attn_norm.weight"), eps)
        q = _rms((h @ L("attn_q.weight").T).reshape(T, n_head, hd), L("attn_q_norm.weight"), eps)
        k_raw = (h @ L("attn_k.weight").T).reshape(T, kv_heads[il], hd)
        v_raw = (h @ L("attn_v.weight").T).reshape(T, kv_heads[il], hd) if is_swa[il] else k_raw
        k = _rope_neox(_rms(k_raw, L("attn_k_norm.weight"), eps), pos, base, ff)
        q = _rope_neox(q, pos, base, ff)
        v = _rms(v_raw, None, eps)
        group = n_head // kv_heads[il]
        allowed = pos[None, :] <= pos[:, None]
        if is_swa[il]:
            allowed &= pos[:, None] - pos[None, :] < n_swa
        out = np.zeros((T, n_head, hd))
        for hh in range(n_head):
            s = q[:, hh] @ k[:, hh // group].T  # attention scale 1.0
            s = np.where(allowed, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (p / p.sum(-1, keepdims=True)) @ v[:, hh // group]
        attn = _rms(out.reshape(T, -1) @ L("attn_output.weight").T, L("post_attention_norm.weight"), eps)
        x_attn = x + attn
        m = _rms(x_attn, L("ffn_norm.weight"), eps)
        mlp = (_gelu_tanh(m @ L("ffn_gate.weight").T) * (m @ L("ffn_up.weight").T)) @ L("ffn_down.weight").T
        mlp = _rms(mlp, L("post_ffw_norm_1.weight"), eps)
        router_in = _rms(x_attn, None, eps) / np.sqrt(n_embd) * L("ffn_gate_inp.scale")
        logits = router_in @ L("ffn_gate_inp.weight").T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        e_in = _rms(x_attn, L("pre_ffw_norm_2.weight"), eps)
        moe = np.zeros_like(x)
        for t in range(T):
            top = np.argsort(-probs[t])[:n_used]
            weights = probs[t, top] / probs[t, top].sum()
            for e, w in zip(top, weights):
                gu = L("ffn_gate_up_exps.weight")[e] @ e_in[t]
                half = gu.shape[0] // 2
                y = L("ffn_down_exps.weight")[e] @ (_gelu_tanh(gu[:half]) * gu[half:])
                moe[t] += w * L("ffn_down_exps.scale")[e] * y
        moe = _rms(moe, L("post_ffw_norm_2.weight"), eps)
        x = (x_attn + _rms(mlp + moe, L("post_ffw_norm.weight"), eps)) * L("layer_output_scale.weight")
    out = _rms(x, W["output_norm.weight"], eps) @ W["token_embd.weight"].T
    return cap * np.tanh(out / cap)


@needs_torch
def test_ar_twin_reproduces_the_reference_encoder(reference_model, reference_ar_gguf, tiny_vocab_obj):
    from dgcli.testing.reference import reference_causal_logits

    # 19 tokens: longer than the sliding window (8), so the window matters
    ids = tiny_vocab_obj.chat_prompt_ids("The quick brown fox jumps")
    assert len(ids) > 8
    got = _gemma4_causal_logits_from_gguf(reference_ar_gguf, ids)
    expected = reference_causal_logits(reference_model, ids)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@needs_torch
def test_saved_generation_config_loads_back_in_transformers(reference_checkpoint):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    config = DiffusionGemmaGenerationConfig.from_pretrained(str(reference_checkpoint))
    assert isinstance(config.sampler_config, EntropyBoundSamplerConfig)
    assert config.sampler_config.entropy_bound == 0.1 and config.max_denoising_steps == 48
