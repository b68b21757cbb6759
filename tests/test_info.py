"""dg info: GGUF inspection without llama.cpp, and the pre-flight checks on bad files."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from dgcli.errors import ModelLoadError
from dgcli.modelfile import info
from dgcli.testing.tiny import write_tiny_random_gguf


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return (write_tiny_random_gguf(d / "diff.gguf", seed=1),
            write_tiny_random_gguf(d / "ar.gguf", seed=1, arch="gemma4"),
            write_tiny_random_gguf(d / "q8.gguf", seed=1, outtype="q8_0"))


def test_reads_architecture_params_canvas_and_sampler_defaults(tiny_models):
    diff, ar, _ = tiny_models
    meta = info.read_info(diff)
    assert meta.architecture == "diffusion-gemma" and meta.is_diffusion
    assert meta.canvas_length == 16
    assert meta.vocab_size == 500 and meta.block_count == 6 and meta.context_length == 4096
    assert meta.file_size == Path(diff).stat().st_size
    assert meta.parameter_count == sum(t.parameters for t in meta.tensor_types) > 0
    assert set(meta.sampler_defaults) == {"max_denoising_steps", "t_min", "t_max", "entropy_bound",
                                          "stability_threshold", "confidence_threshold"}
    assert meta.sampler_defaults["t_min"] < meta.sampler_defaults["t_max"]
    assert meta.has_chat_template
    ar_meta = info.read_info(ar)
    assert ar_meta.architecture == "gemma4" and not ar_meta.is_diffusion
    assert ar_meta.sampler_defaults == {} and ar_meta.canvas_length is None


def test_sampler_defaults_from_file_round_to_what_was_written(tmp_path):
    import gguf
    import numpy as np

    p = tmp_path / "s.gguf"
    w = gguf.GGUFWriter(str(p), "diffusion-gemma")
    w.add_uint32("diffusion.canvas_length", 8)
    w.add_float32("diffusion.eb_t_min", 0.3)
    w.add_uint32("diffusion.eb_max_steps", 12)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    meta = info.read_info(p)
    assert meta.sampler_defaults["t_min"] == 0.3 and meta.sampler_defaults_source["t_min"] == "gguf"
    assert meta.sampler_defaults["max_denoising_steps"] == 12
    assert meta.sampler_defaults["t_max"] == 0.8 and meta.sampler_defaults_source["t_max"] == "default"
    assert meta.reference_default_keys == [] and meta.final_logit_softcapping is None


def test_keys_dg_filled_with_reference_defaults(tmp_path, tiny_models):
    import gguf
    import numpy as np

    # the tiny writer has no generation config and its config.json form no softcap: dg says all seven
    diff, ar, _ = tiny_models
    meta = info.read_info(diff)
    assert meta.reference_default_keys == ["diffusion-gemma.final_logit_softcapping", "diffusion.eb_max_steps",
                                           "diffusion.eb_t_min", "diffusion.eb_t_max", "diffusion.eb_entropy_bound",
                                           "diffusion.eb_stability_threshold", "diffusion.eb_confidence_threshold"]
    assert set(meta.sampler_defaults_source.values()) == {info.FROM_GGUF_REFERENCE_DEFAULT}
    assert meta.final_logit_softcapping == 30.0
    assert info.read_info(ar).reference_default_keys == ["gemma4.final_logit_softcapping"]
    # only keys dg adds and the file holds count; a key that is not there stays a run-time default
    p = tmp_path / "listed.gguf"
    w = gguf.GGUFWriter(str(p), "diffusion-gemma")
    w.add_uint32("diffusion.canvas_length", 8)
    w.add_float32("diffusion.eb_t_min", 0.4)
    w.add_float32("diffusion.eb_t_max", 0.9)
    w.add_array("dg.reference_defaults", ["diffusion.eb_t_min", "diffusion.eb_max_steps", "general.name", "x" * 300])
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    meta = info.read_info(p)
    assert meta.reference_default_keys == ["diffusion.eb_t_min"]
    assert meta.sampler_defaults_source["t_min"] == info.FROM_GGUF_REFERENCE_DEFAULT
    assert meta.sampler_defaults_source["t_max"] == info.FROM_GGUF
    assert meta.sampler_defaults_source["max_denoising_steps"] == info.FROM_DEFAULT


def test_quant_histogram_names_the_weight_type(tiny_models):
    _, _, q8 = tiny_models
    meta = info.read_info(q8)
    assert meta.file_type == "Q8_0"
    types = {t.type: t for t in meta.tensor_types}
    assert "Q8_0" in types and "F32" in types  # norms stay F32
    assert sum(t.tensors for t in meta.tensor_types) == meta.tensor_count


def test_quant_is_the_declared_file_type_when_the_file_has_a_valid_one(tmp_path, tiny_models):
    """general.file_type names the quant as llama.cpp's quantizer wrote it (a Q4_K_M file is mostly Q4_K
    with Q6_K and Q5_0 besides); absent (the converters write none), of another value type, or
    unknown: the dominant weight type."""
    import gguf

    from native_helpers import rewrite_gguf

    _, _, q8 = tiny_models
    V = gguf.GGUFValueType
    assert info.read_header(q8).get("general.file_type") is None
    for value, expected in [((15, V.UINT32), "Q4_K_M"), ((32, V.UINT32), "BF16"), ((0, V.UINT32), "F32"),
                            ((15, V.INT32), "Q8_0"), ((9999, V.UINT32), "Q8_0"), ((1024, V.UINT32), "Q8_0"),
                            (("Q4_K_M", V.STRING), "Q8_0")]:
        path = rewrite_gguf(q8, tmp_path / "declared.gguf", set_keys={"general.file_type": value})
        assert info.read_info(path).file_type == expected, value
    undeclared = rewrite_gguf(q8, tmp_path / "undeclared.gguf", drop_keys=("general.file_type",))
    assert info.read_info(undeclared).file_type == "Q8_0"


def test_missing_not_gguf_and_truncated_files(tmp_path, tiny_models):
    with pytest.raises(ModelLoadError, match="model file not found"):
        info.read_info(tmp_path / "nope.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        info.read_info(text)
    data = Path(tiny_models[0]).read_bytes()
    for cut in (100, len(data) // 2, len(data) - 10):
        trunc = tmp_path / f"trunc{cut}.gguf"
        trunc.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated"):
            info.read_info(trunc)


def test_architecture_check(tiny_models):
    diff, ar, _ = tiny_models
    assert info.check_architecture(diff, diffusion=True, command="generate") == "diffusion-gemma"
    with pytest.raises(ModelLoadError, match="'gemma4' model, not a DiffusionGemma"):
        info.check_architecture(ar, diffusion=True, command="generate")
    with pytest.raises(ModelLoadError, match="is a diffusion model"):
        info.check_architecture(diff, diffusion=False, command="compare")


def test_memory_fit(tiny_models, monkeypatch):
    diff = tiny_models[0]
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr("psutil.virtual_memory", lambda: VM(64 * 1024**3, 32 * 1024**3))
    info.check_fits_memory(diff)
    assert info.read_info(diff).fits_ram
    monkeypatch.setattr("psutil.virtual_memory", lambda: VM(1024**2, 1024**2))
    with pytest.raises(info.TooBigForMemory, match=r"needs about .* of RAM but this machine has 1.0 MB"):
        info.check_fits_memory(diff)
    assert not info.read_info(diff).fits_ram
    # offloaded, the embedding and the runtime still need RAM (tests/test_offload.py has the GPU side)
    gpu = [info.GpuMemory("test GPU", 64 * 1024**3, 64 * 1024**3)]
    with pytest.raises(info.TooBigForMemory, match="offload more to the GPU"):
        info.check_fits_memory(diff, n_gpu_layers=-1, gpus=gpu)


def test_memory_fit_counts_the_kv_cache_of_the_context_asked_for(tiny_models, monkeypatch):
    # `dg generate -c N` / `dg serve --ctx-size N --parallel P`: the KV cache is cleared at load, so an
    # oversized one is taken from RAM whole (the OOM killer ended `dg serve -c 10000000 -np 64`)
    diff = tiny_models[0]
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr("psutil.virtual_memory", lambda: VM(8 * 1000**3, 4 * 1000**3))
    info.check_fits_memory(diff)
    info.check_fits_memory(diff, n_ctx=0)  # the training context
    info.check_fits_memory(diff, n_ctx=100_000, n_seq=4)
    with pytest.raises(info.TooBigForMemory, match=r"with a context of 1000000000 tokens needs about .* of RAM "
                                                   r"\(most of it the KV cache and attention scores\).* use a smaller --ctx-size$"):
        info.check_fits_memory(diff, n_ctx=10**9)
    with pytest.raises(info.TooBigForMemory, match=r"with 64 sequences of 10000000 tokens .* or --parallel$"):
        info.check_fits_memory(diff, n_ctx=10**7, n_seq=64)


def test_cpu_only_ram_need_counts_the_attention_scores_past_the_logits(tiny_models):
    """Without a GPU dg runs without flash attention: a micro-batch's float scores against every cell of
    the context share the compute buffer with the logits, so past a context where they outgrow the logits
    they add to the need, and only then."""
    header = info.read_header(tiny_models[0])
    arch, heads = header.architecture, header.get(f"{header.architecture}.attention.head_count")
    vocab, canvas = header.n_vocab, header.get("diffusion.canvas_length")
    heads = max(heads) if isinstance(heads, list) else heads

    def ram(n_ctx):
        return info.header_plan(header, 0, 0, [], (n_ctx, 1))[1]

    def kv(n_ctx):
        return sum(info.kv_cache_bytes(header.get, arch, header.get(f"{arch}.block_count"), n_ctx))

    scores = lambda n_ctx: max(info.N_UBATCH, canvas) * n_ctx * heads * 4  # noqa: E731
    small = 64
    assert scores(small) < info.logits_bytes(vocab, canvas)  # hidden under the logits
    big = 4 * info.logits_bytes(vocab, canvas) // (info.N_UBATCH * heads * 4)
    assert ram(big) - kv(big) - (ram(small) - kv(small)) == scores(big) - info.logits_bytes(vocab, canvas)
    # with a GPU the scores are the GPU's business: the RAM need has the KV cache's share only
    gpu = [info.GpuMemory("test GPU", 64 * 1024**3, 64 * 1024**3)]
    plan, ram_gpu, _ = info.header_plan(header, -1, 0, gpu, (big, 1))
    assert ram_gpu < ram(big) - scores(big) + info.logits_bytes(vocab, canvas)


@pytest.mark.parametrize("weights", ["q8_0", "q5_0"])
def test_ram_need_counts_the_repacked_copies_of_cpu_q8_0_and_q5_0_weights(tmp_path, monkeypatch, weights):
    """The LM head (here tied to the token embedding) and the dense projections dg's int8 GEMMs copy
    when they run on the CPU: 36 bytes per 32 weights (Q8_0: 34, Q5_0: 22); the experts, repacked in
    place of the file's copy, only their layout's growth (AVX2: Q8_0 36 per 34 bytes, Q5_0 24 per 22;
    AVX-512 VNNI: the file's bytes, a group's scales padded to 64 bytes); nothing on other CPUs or for
    weights on a GPU."""
    import re

    import gguf

    from dgcli.modelfile.header import read_header
    from dgcli.modelfile.info import GpuMemory
    from dgcli.testing.tiny import q5_0_type

    storage = {"q8_0": {"outtype": "q8_0"}, "q5_0": {"storage": q5_0_type}}[weights]
    path = write_tiny_random_gguf(tmp_path / f"{weights}.gguf", seed=6, **storage)
    header = read_header(path)
    dense = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight|"
                       r"self_cond_(gate|up|down)\.weight|token_embd\.weight")  # no output.weight: tied
    tensors = gguf.GGUFReader(path).tensors
    assert not any(t.name == "output.weight" for t in tensors)
    T = gguf.GGMLQuantizationType
    assert {t.tensor_type for t in tensors if dense.fullmatch(t.name)} == {T.Q8_0 if weights == "q8_0" else T.Q5_0,
                                                                           T.Q8_0}
    expected = sum(int(t.n_elements) // 32 * 36 for t in tensors if dense.fullmatch(t.name))
    assert expected > 0

    # the experts, repacked while loading in place of the file's copy: their layout's growth only
    growth = {T.Q8_0: (36, 34), T.Q5_0: (24, 22)}
    experts = [t for t in tensors if re.fullmatch(r"blk\.\d+\.ffn_(gate_up|down)_exps\.weight", t.name)]
    expected_experts = sum(int(t.n_bytes) * (growth[t.tensor_type][0] - growth[t.tensor_type][1])
                           // growth[t.tensor_type][1] for t in experts)
    assert len(experts) == 2 * header.get("diffusion-gemma.block_count") and expected_experts > 0

    monkeypatch.setattr(info, "_cpu_runs_repacked_gemms", lambda: True)
    monkeypatch.setattr(info, "expert_layout_family", lambda: "avx2")
    plan, ram, _ = info.header_plan(header, 0, 0, [])
    assert info.repacked_bytes(header, plan) == expected
    assert info.repacked_expert_growth(header, plan) == expected_experts
    monkeypatch.setattr(info, "_cpu_runs_repacked_gemms", lambda: False)
    monkeypatch.setattr(info, "expert_layout_family", lambda: None)
    _, ram_without, _ = info.header_plan(header, 0, 0, [])
    assert ram - ram_without == expected + expected_experts

    # VNNI's layout: the file's bytes, plus the scales' padding to 64 bytes per group of 16 rows where a
    # row has an odd count of blocks (16 rows x 2 bytes x blocks: n_in bytes)
    monkeypatch.setattr(info, "expert_layout_family", lambda: "avx512-vnni")
    padding = sum(-(-int(t.shape[1]) // 16) * int(t.shape[2]) * (-int(t.shape[0]) % 64)
                  for t in experts)
    assert info.repacked_expert_growth(header, plan) == padding < expected_experts
    assert padding > 0  # the tiny model's down projection: one block a row
    monkeypatch.setattr(info, "_cpu_runs_repacked_gemms", lambda: True)
    monkeypatch.setattr(info, "expert_layout_family", lambda: "avx2")

    # a GPU in use, even for one layer: llama.cpp runs the canvas's host matmuls there, nothing is repacked
    monkeypatch.setattr(info, "_cpu_runs_repacked_gemms", lambda: True)
    for layers in (-1, 1):
        gpu_plan, _, _ = info.header_plan(header, layers, 0, [GpuMemory("GPU", 2**34, 2**34)])
        assert info.repacked_bytes(header, gpu_plan) == 0
        assert info.repacked_expert_growth(header, gpu_plan) == 0
    # an F32 model: nothing to repack
    f32 = read_header(write_tiny_random_gguf(tmp_path / "f32.gguf", seed=6))
    assert info.repacked_bytes(f32, info.header_plan(f32, 0, 0, [])[0]) == 0


def test_a_split_model_is_read_whole_from_its_first_part(tmp_path, tiny_models):
    """llama-gguf-split's parts: the first holds the keys, each its share of the tensors; llama.cpp loads
    the first and finds the others beside it. dg read only the first, found the other tensors missing
    and refused the model."""
    from native_helpers import split_gguf

    diff = tiny_models[0]
    parts = split_gguf(diff, tmp_path / "split", "m-BF16", n_parts=3)
    whole, split = info.read_info(diff), info.read_info(parts[0])
    assert split.problem is None and split.tensor_count == whole.tensor_count
    assert split.parameter_count == whole.parameter_count and split.tensor_types == whole.tensor_types
    assert split.file_size == sum(p.stat().st_size for p in parts)
    info.check_architecture(parts[0], diffusion=True, command="generate")
    with pytest.raises(ModelLoadError, match="pass the first part, named PREFIX-00001-of-00003.gguf"):
        info.read_info(parts[1])
    parts[2].unlink()
    with pytest.raises(ModelLoadError, match="a part of the split model is missing: .*m-BF16-00003-of-00003.gguf"):
        info.read_info(parts[0])


def test_a_header_is_read_from_the_first_bytes_of_a_file(tiny_models):
    """What dg info reads of a file on the Hub (dgcli.remote_gguf): the header from a prefix of the file,
    "more" while it goes on past the bytes given, the same header as the whole file's once they hold it."""
    from dgcli.modelfile.header import HeaderGoesOn, parse_header_prefix, read_header

    diff = Path(tiny_models[0])
    data, size = diff.read_bytes(), diff.stat().st_size
    whole = read_header(diff)
    for n in (0, 3, 100, whole.data_offset - 1):
        with pytest.raises(HeaderGoesOn):
            parse_header_prefix(data[:n], size, "org/m/m.gguf")
    got = parse_header_prefix(data[:whole.data_offset], size, "org/m/m.gguf")
    assert got.tensors == whole.tensors and got.metadata == whole.metadata and got.file_size == size
    with pytest.raises(ModelLoadError, match="not a GGUF file \\(bad magic b'<htm'\\): org/m/m.gguf"):
        parse_header_prefix(b"<html>" + data[6:100], size, "org/m/m.gguf")
    with pytest.raises(ModelLoadError, match="truncated"):  # the header cannot fit in the file's size
        parse_header_prefix(data[:whole.data_offset], whole.data_offset, "org/m/m.gguf")
