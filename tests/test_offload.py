"""Partial offload on CPU: the expert-tensor patterns for --n-cpu-moe N, that llama.cpp applies them
(its load log names every overridden tensor and its buffer), the placement plan, and the RAM / GPU
memory fits with an injected GPU (no GPU here)."""

from __future__ import annotations

import json
import re
from collections import namedtuple

import pytest
from typer.testing import CliRunner

from dgcli.cli import app
from dgcli.convert import params_from_hf_config, tensor_plan
from dgcli.errors import InvalidParameter
from dgcli.modelfile import info
from dgcli.modelfile.info import GpuMemory
from dgcli.runtime.offload import (
    LoadReport,
    expert_override_pattern,
    first_gpu_layer,
    layer_ranges,
    plan_placement,
    tiled_weight_pattern,
)
from dgcli.testing.tiny import q4_k_m_type
from native_helpers import requires_native, small_q4_k_m_gguf

GB = 1024**3
EXPERT_SUFFIXES = ("ffn_gate_up_exps.weight", "ffn_down_exps.weight", "ffn_down_exps.scale")


def real_size_tensors(n_layer: int = 30) -> list[tuple[str, int]]:
    """(name, bytes) of a 26B-A4B diffusion-gemma GGUF in Q4_K_M-like types (what tiny's writer makes)."""
    import gguf

    text = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=n_layer,
                num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                num_global_key_value_heads=2, sliding_window=1024, num_experts=128, top_k_experts=8,
                moe_intermediate_size=704, max_position_embeddings=262144)
    params = params_from_hf_config({"model_type": "diffusion_gemma", "canvas_length": 256, "text_config": text})
    out = []
    for spec in tensor_plan(params, "diffusion-gemma"):
        block, size = gguf.GGML_QUANT_SIZES[q4_k_m_type(spec, n_layer)]
        n = 1
        for d in spec.shape:
            n *= d
        out.append((spec.name, n // block * size))
    return out


# -- the patterns ----------------------------------------------------------------------------------


def test_n_cpu_moe_pattern_selects_exactly_the_first_layers_experts():
    names = [name for name, _ in real_size_tensors()]
    for n in (1, 2, 10, 29):
        pattern = re.compile(expert_override_pattern(n, 30))
        picked = {name for name in names if pattern.search(name)}
        wanted = {f"blk.{i}.{suffix}" for i in range(n) for suffix in EXPERT_SUFFIXES}
        assert picked == wanted, n  # blk.1 must not pick blk.10-19, nor the router (ffn_gate_inp)


def test_cpu_moe_and_edges():
    assert expert_override_pattern(0, 30) is None
    every = expert_override_pattern(-1, 30)
    assert expert_override_pattern(30, 30) == every
    names = [name for name, _ in real_size_tensors(4)]
    assert {n for n in names if re.search(every, n)} == {f"blk.{i}.{s}" for i in range(4) for s in EXPERT_SUFFIXES}
    with pytest.raises(InvalidParameter, match="at most the model's 30 layers"):
        expert_override_pattern(31, 30)


def test_first_gpu_layer_follows_llama_cpp():
    # llama.cpp: i_gpu_start = n_layer + 1 - n_gpu_layers (the output layer is layer n_layer)
    assert first_gpu_layer(-1, 30) == 0
    assert first_gpu_layer(31, 30) == 0
    assert first_gpu_layer(99, 30) == 0
    assert first_gpu_layer(30, 30) == 1   # every block, but the LM head stays on the CPU
    assert first_gpu_layer(1, 30) == 30   # only the output layer
    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


# -- llama.cpp accepts them ------------------------------------------------------------------------


@requires_native
@pytest.mark.parametrize("n_cpu_moe, layers", [(0, []), (2, [0, 1]), (-1, list(range(6)))])
def test_llama_cpp_applies_the_override(tiny_gguf, n_cpu_moe, layers):
    """The load log names each tensor the override moved, and where (a CPU build has nothing else to
    offload, but the loader applies the overrides all the same)."""
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(tiny_gguf, n_threads=1, n_gpu_layers=-1, n_cpu_moe=n_cpu_moe, n_ctx=64) as m:
        report = m.load_report
        logits = m.decode_canvas(list(range(10, 26)))
    assert sorted(report.overridden) == sorted((f"blk.{i}.{s}", "CPU") for i in layers for s in EXPERT_SUFFIXES)
    assert any(kind == "model" for _, kind, _ in report.buffers)
    assert logits.shape == (16, 500)


@requires_native
def test_ar_model_takes_the_same_override(tiny_ar_gguf):
    from dgcli.runtime.model import ArModel

    with ArModel(tiny_ar_gguf, n_threads=1, n_gpu_layers=-1, n_cpu_moe=1, n_ctx=64) as ar:
        assert sorted(ar.load_report.overridden) == sorted((f"blk.0.{s}", "CPU") for s in EXPERT_SUFFIXES)


def test_k_quant_weights_are_kept_out_of_the_repack_buffers_only_where_our_tiles_take_them(tmp_path, tiny_gguf,
                                                                                           tiny_ar_gguf, monkeypatch):
    """Only a diffusion-gemma file's Q4_K / Q6_K experts on the AVX2 tiles (kernel 1) and dense Q4_K / Q6_K
    weights on the AVX2 or VNNI tiles (kernel 1 or 2; the experts' and the dense weights' kernels apart),
    with no GPU or RPC worker in use: elsewhere llama.cpp's repacked matmuls (or the GPU) are the faster path; other types keep their
    home. The embedding never: llama.cpp's CPU repack does not take the tied Q6_K LM head anyway.
    DG_Q6_K_TILE=0 leaves the Q6_K ones out."""
    from dgcli.modelfile.header import read_header

    header = read_header(small_q4_k_m_gguf(tmp_path / "q4_k_m.gguf"))
    types = {t.name: t.type_name for t in header.tensors}

    def kept(expert_kernel: int, dense_kernel: int, gpu_in_use: bool = False) -> set[str]:
        pattern = tiled_weight_pattern(header, expert_kernel, dense_kernel, gpu_in_use)
        return set() if pattern is None else {name for name in types if re.search(pattern, name)}

    experts = {name for name in types if "_exps." in name}
    dense = {name for name, t in types.items() if t in ("Q4_K", "Q6_K") and "_exps." not in name
             and name != "token_embd.weight"}
    assert {"blk.0.attn_q.weight", "blk.1.ffn_up.weight", "self_cond_gate.weight", "blk.1.ffn_down.weight"} <= dense
    assert types["blk.1.ffn_down.weight"] == "Q6_K" and types["token_embd.weight"] == "Q6_K"
    assert kept(1, 1) == experts | dense
    assert kept(1, 0) == experts and kept(0, 1) == dense and kept(2, 1) == dense
    assert kept(2, 2) == dense  # VNNI's experts are repacked while loading (their own buffer), never here
    assert kept(1, 1, gpu_in_use=True) == set() and kept(2, 2, gpu_in_use=True) == set()
    for kernel in (0, 3):  # ggml's, emulated: no K-quant tile
        assert kept(kernel, kernel) == set()
    for other in (tiny_gguf, tiny_ar_gguf):  # F32 weights; the AR twin
        assert tiled_weight_pattern(read_header(other), 1, 1, gpu_in_use=False) is None
    monkeypatch.setenv("DG_Q6_K_TILE", "0")
    assert kept(0, 1) == {name for name in dense if types[name] == "Q4_K"}


@requires_native
@pytest.mark.parametrize("n_cpu_moe, reported", [(0, []), (1, [0])])
def test_q4_k_experts_load_into_dgs_expert_buffer_and_reports_say_only_what_was_asked(tmp_path, monkeypatch,
                                                                                      n_cpu_moe, reported):
    """Loaded on this CPU build, the Q4_K experts go to dg's expert buffer type of the AVX2 family
    (llama.cpp's log: overridden to CPU_DG_EXPERTS_AVX2), repacked while loading, and run on its GEMM;
    `-v`'s report lists only the experts --n-cpu-moe asked for, since without a GPU every weight is in
    system memory anyway. DG_EXPERT_GEMM=ggml leaves them to ggml's buffers. The family is forced here:
    an AVX-512 CPU's automatic choice is another one."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel, cpu_repack_enabled

    path = small_q4_k_m_gguf(tmp_path / "q4_k_m.gguf")
    monkeypatch.setenv("DG_EXPERT_GEMM", "avx2")
    if native.lib()._lib.dg_expert_repack_kernel() != 1 or native.gpu_devices():
        pytest.skip("no AVX2 family for the experts here (or a GPU in use)")

    def load(experts: str) -> tuple[list, int, list[str]]:
        monkeypatch.setenv("DG_EXPERT_GEMM", experts)
        with native.collect_log() as log, DiffusionModel(path, n_threads=1, n_cpu_moe=n_cpu_moe, n_ctx=64) as m:
            count = native.lib()._lib.dg_expert_gemm_count(m._model)
            return m.load_report.overridden, count, list(log)

    overridden, count, log = load("avx2")
    gate_up = [line for line in log if "ffn_gate_up_exps.weight" in line and "overridden to" in line]
    assert len(gate_up) == 2 and all(line.endswith("overridden to CPU_DG_EXPERTS_AVX2") for line in gate_up)
    assert count == 4  # both layers' gate+up and down (layer 1's down is Q6_K)
    # the weights in dg's expert buffer, the down projections' per-expert scales (F32) in ggml's
    assert sorted(overridden) == sorted((f"blk.{i}.{s}", "CPU" if s.endswith(".scale") else "CPU_DG_EXPERTS_AVX2")
                                        for i in reported for s in EXPERT_SUFFIXES)

    overridden, count, log = load("ggml")
    assert count == 0
    gate_up = [line for line in log if "ffn_gate_up_exps.weight" in line and "overridden to" in line]
    # ggml's home for them: the repack buffers, where this CPU has them on (not on AMX CPUs)
    home = "CPU_REPACK" if cpu_repack_enabled() else "CPU"
    assert len(gate_up) == n_cpu_moe and all(line.endswith(f"overridden to {home}") for line in gate_up)

    monkeypatch.setenv("DG_Q4_K_TILE", "0")  # the A/B switch: every Q4_K weight left to ggml
    overridden, count, log = load("avx2")
    assert count == 1 and not any("attn_q.weight" in line and "overridden" in line for line in log)
    monkeypatch.setenv("DG_Q6_K_TILE", "0")  # and Q6_K's: layer 1's down projections back to ggml
    overridden, count, log = load("avx2")
    assert count == 0


def test_load_report_reads_a_cuda_log():
    """The lines a CUDA load logs (llama_model_load / llama_context formats) become the report."""
    log = [
        "load_tensors: offloading output layer to GPU",
        "load_tensors: offloading 30 repeating layers to GPU",
        "load_tensors: offloaded 31/31 layers to GPU",
        "load_tensors:        CUDA0 model buffer size = 12345.67 MiB",
        "load_tensors:   CPU_Mapped model buffer size =  3000.50 MiB",
        "tensor blk.0.ffn_gate_up_exps.weight (288 MiB q4_K) buffer type overridden to CUDA_Host",
        "llama_kv_cache:      CUDA0 KV buffer size =   400.00 MiB",
        "sched_reserve:      CUDA0 compute buffer size =  1100.00 MiB",
    ]
    report = LoadReport.from_log(log)
    assert (report.offloaded_layers, report.total_layers) == (31, 31)
    assert report.overridden == [("blk.0.ffn_gate_up_exps.weight", "CUDA_Host")]
    assert report.mib_by_device() == pytest.approx({"CUDA0": 12345.67 + 400 + 1100, "CPU": 3000.5})


# -- the plan and the fits ---------------------------------------------------------------------------


def test_plan_moves_expert_bytes_to_ram_as_n_grows():
    tensors = real_size_tensors()
    total = sum(b for _, b in tensors)
    assert 14 * GB < total < 17 * GB  # a Q4_K_M 26B-A4B: ~16 GB
    full = plan_placement(tensors, 30, -1, 0, gpu=True)
    # input embedding on the CPU; the tied LM head is a second copy on the GPU
    embd = dict(tensors)["token_embd.weight"]
    assert full.ram_weight_bytes == embd + dict(tensors)["rope_freqs.weight"]
    assert full.gpu_weight_bytes == total - full.ram_weight_bytes + embd
    expert_bytes = [sum(b for n, b in tensors if n.startswith(f"blk.{i}.") and "_exps." in n) for i in range(30)]
    previous = full
    for n in (5, 15, 30):
        plan = plan_placement(tensors, 30, -1, n, gpu=True)
        assert plan.ram_weight_bytes == full.ram_weight_bytes + sum(expert_bytes[:n])
        assert plan.gpu_weight_bytes == full.gpu_weight_bytes - sum(expert_bytes[:n])
        assert plan.gpu_weight_bytes < previous.gpu_weight_bytes
        previous = plan
    # no GPU: everything in RAM, whatever was asked
    none = plan_placement(tensors, 30, -1, 10, gpu=False)
    assert none.gpu_weight_bytes == 0 and none.ram_weight_bytes == total


@pytest.fixture(scope="module")
def tiny_diff(tmp_path_factory):
    from dgcli.testing.tiny import write_tiny_random_gguf

    return write_tiny_random_gguf(tmp_path_factory.mktemp("offload") / "diff.gguf", seed=2)


def fake_ram(monkeypatch, total: int, available: int | None = None) -> None:
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr("psutil.virtual_memory", lambda: VM(total, total if available is None else available))


def test_fits_are_answered_for_ram_and_gpu_separately(tiny_diff, monkeypatch):
    fake_ram(monkeypatch, 64 * GB)
    big, small = [GpuMemory("big", 24 * GB, 24 * GB)], [GpuMemory("small", 100 * 1024**2, 100 * 1024**2)]
    cpu_only = info.read_info(tiny_diff)
    offloaded = info.read_info(tiny_diff, n_gpu_layers=-1, gpus=big)
    assert cpu_only.gpu_needed == 0 and cpu_only.gpu_name is None
    assert offloaded.gpu_needed > 0 and offloaded.fits_gpu and offloaded.fits_available_gpu
    assert offloaded.memory_needed < cpu_only.memory_needed  # the offloaded weights left RAM
    assert offloaded.offloaded_layers == 7
    tight = info.read_info(tiny_diff, n_gpu_layers=-1, gpus=small)
    assert not tight.fits_gpu and tight.fits_ram
    # experts to RAM: the RAM side grows by what the GPU side loses
    moe = info.read_info(tiny_diff, n_gpu_layers=-1, n_cpu_moe=-1, gpus=big)
    assert moe.gpu_needed < offloaded.gpu_needed
    assert moe.memory_needed - offloaded.memory_needed == pytest.approx(
        (offloaded.gpu_needed - moe.gpu_needed) * info.MEMORY_OVERHEAD_FACTOR, rel=1e-3)
    assert ("layers 0-5 experts", "RAM") in [(w, d) for w, d, _, _ in moe.placement]
    doc = moe.to_json()
    assert doc["fits_gpu"] is True and doc["placement"][0]["where"] == "RAM"


def test_preload_check_refuses_what_does_not_fit(tiny_diff, monkeypatch):
    fake_ram(monkeypatch, 64 * GB)
    plenty = [GpuMemory("CUDA0 (test)", 24 * GB, 24 * GB)]
    info.check_fits_memory(tiny_diff, n_gpu_layers=-1, gpus=plenty)
    need = info.read_info(tiny_diff, n_gpu_layers=-1, gpus=plenty).gpu_needed
    # a GPU with room only once the experts leave: the message names the smallest --n-cpu-moe that fits
    just = info.read_info(tiny_diff, n_gpu_layers=-1, n_cpu_moe=3, gpus=plenty).gpu_needed
    card = [GpuMemory("CUDA0 (test)", 24 * GB, just)]
    assert just < need
    with pytest.raises(info.TooBigForMemory, match=r"of GPU memory with every layer offloaded, but CUDA0 \(test\) "
                                                   r"has .* free; try --n-cpu-moe 3"):
        info.check_fits_memory(tiny_diff, n_gpu_layers=-1, gpus=card)
    info.check_fits_memory(tiny_diff, n_gpu_layers=-1, n_cpu_moe=3, gpus=card)
    with pytest.raises(info.TooBigForMemory, match="offload fewer layers"):
        info.check_fits_memory(tiny_diff, n_gpu_layers=-1, gpus=[GpuMemory("tiny", GB, 1024)])
    # RAM is judged on what stays there: too little RAM fails even with everything offloaded
    fake_ram(monkeypatch, 1024**2)
    with pytest.raises(info.TooBigForMemory, match="of RAM .*offload more to the GPU"):
        info.check_fits_memory(tiny_diff, n_gpu_layers=-1, gpus=plenty)
    with pytest.raises(info.TooBigForMemory, match="of RAM .*offload layers to a GPU"):
        info.check_fits_memory(tiny_diff, n_gpu_layers=-1, gpus=[])


# -- the CLI ---------------------------------------------------------------------------------------


def test_info_answers_for_a_given_gpu(tiny_diff, monkeypatch):
    fake_ram(monkeypatch, 64 * GB)
    result = CliRunner().invoke(app, ["info", str(tiny_diff), "--n-cpu-moe", "2", "--gpu-memory", "16GB"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert re.search(r"GPU memory\s+needs ~.*a 16\.0 GB GPU \(--gpu-memory\): 16\.0 GB total, 16\.0 GB free: fits", out)
    assert "placement (7/7 layers offloaded)" in out
    assert re.search(r"layers 0-1 experts\s+│ RAM", out) and re.search(r"layers 2-5 experts\s+│ GPU", out)
    small = CliRunner().invoke(app, ["info", str(tiny_diff), "--gpu-layers", "-1", "--gpu-memory", "1MB"],
                               env={"COLUMNS": "200"})
    assert "DOES NOT FIT" in small.output
    doc = CliRunner().invoke(app, ["info", str(tiny_diff), "--cpu-moe", "--gpu-memory", "16GB", "--json"]).output
    assert '"n_cpu_moe": -1' in doc and '"fits_gpu": true' in doc


@pytest.mark.parametrize("args, message", [
    (["--cpu-moe", "--n-cpu-moe", "2"], "pass --cpu-moe or --n-cpu-moe N, not both"),
    (["--n-cpu-moe", "-3"], "invalid --n-cpu-moe -3"),
    (["--n-cpu-moe", "7"], "at most the model's 6 layers"),
    (["--gpu-memory", "lots"], "invalid size 'lots'"),
    # past a float's range (it was an OverflowError traceback), and sizes that round to no byte
    (["--gpu-layers", "-1", "--gpu-memory", "9" * 400], "expected from 1 byte to 1 EiB"),
    (["--gpu-layers", "-1", "--gpu-memory", "2000000TiB"], "expected from 1 byte to 1 EiB"),
    (["--gpu-layers", "-1", "--gpu-memory", "0.5"], "expected from 1 byte to 1 EiB"),
    # what every command that loads refuses (info answered "fits" for it)
    (["--gpu-layers", "99999999999", "--gpu-memory", "16GB"], "invalid --gpu-layers 99999999999"),
    (["--gpu-layers", "-2"], "invalid --gpu-layers -2"),
])
def test_bad_offload_flags_are_one_line_errors(tiny_diff, args, message):
    result = CliRunner().invoke(app, ["info", str(tiny_diff), *args])
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output


@requires_native
def test_generate_verbose_reports_where_the_experts_went(tiny_diff, monkeypatch):
    fake_ram(monkeypatch, 64 * GB)
    # a CPU build: --gpu-layers is ignored, the override still moves (here: keeps) the experts
    result = CliRunner().invoke(app, ["generate", "hi", "-m", str(tiny_diff), "--n-cpu-moe", "2", "--verbose",
                                      "--no-live", "--steps", "2", "-n", "4", "--seed", "0"])
    assert result.exit_code == 0, result.output
    from dgcli.runtime import native

    reason = native.no_gpu_reason()  # a CPU build: no GPU backend; a CUDA build without a driver: CUDA's words
    assert f"diffusion model diff.gguf: every weight is in system memory: {reason}" in " ".join(result.output.split())
    assert "kept in system memory (CPU): blk.{0-1}.ffn_gate_up_exps.weight" in result.output
    assert "kept in system memory (CPU): blk.{0-1}.ffn_down_exps.weight" in result.output


def test_no_gpu_reason_names_the_missing_backend_or_what_it_said(monkeypatch):
    from dgcli.runtime import native

    monkeypatch.setattr(native, "gpu_backends", lambda: [])
    assert native.no_gpu_reason().startswith("this llama.cpp build has no GPU backend")
    # a CUDA build on a machine whose driver is missing or too old: CUDA's own words
    monkeypatch.setattr(native, "gpu_backends", lambda: ["CUDA"])
    monkeypatch.setattr(native, "_backend_init_log", [
        "load_backend: loaded RPC backend",
        "ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA runtime version"])
    assert native.no_gpu_reason() == ("this llama.cpp build has CUDA but no GPU to use (failed to initialize CUDA: "
                                      "CUDA driver version is insufficient for CUDA runtime version)")
    monkeypatch.setattr(native, "_backend_init_log", [])
    assert native.no_gpu_reason() == "this llama.cpp build has CUDA but no GPU to use (no device found)"


@requires_native
def test_gpu_backends_lists_no_cpu_or_rpc():
    from dgcli.runtime import native

    native.lib()
    backends = native.gpu_backends()
    assert not {"CPU", "RPC"} & set(backends)
    # a device of GPU type implies its backend is listed
    assert bool(native.gpu_devices()) <= bool(backends)


@requires_native
@pytest.mark.parametrize("command", ["generate", "compare"])
def test_gpu_layers_without_a_gpu_warns_once_per_model_and_runs_on_the_cpu(command):
    from dgcli.runtime import native

    native.lib()
    if native.gpu_devices():
        pytest.skip("a GPU is visible: --gpu-layers offloads here")
    # the shipped demo models (compare runs the diffusion model and its AR twin)
    args = [command, "reverse: AB", "--gpu-layers", "-1", "--no-live", "-n", "4", "--seed", "0"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    expected = ["diffusion model"] + (["autoregressive model"] if command == "compare" else [])
    for what in expected:
        assert f"warning: --gpu-layers -1: {native.no_gpu_reason()}; the {what} runs on the CPU" in text
    assert text.count("warning: --gpu-layers") == len(expected)


def test_cuda_libraries_come_from_nvidia_pip_wheels(tmp_path, monkeypatch):
    """A CUDA build (libggml-cuda, or only its soname as in the slim GPU-check wheel) loads the CUDA
    runtime and cuBLAS from NVIDIA's pip wheels when the system has none; a CPU build loads nothing."""
    from dgcli.runtime import native

    wheels = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    wheels.mkdir(parents=True)
    for name in ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13"):
        (wheels / name).write_bytes(b"")
    monkeypatch.setattr("sys.path", [str(tmp_path / "site"), str(tmp_path / "elsewhere")])
    assert native.cuda_library_dirs() == [str(wheels)]
    opened = []

    def fake_cdll(name, mode=0):
        if "/" not in name:  # the system has no CUDA libraries
            raise OSError(name)
        opened.append(name)
        return name

    monkeypatch.setattr(native.ctypes, "CDLL", fake_cdll)
    monkeypatch.setattr(native, "_preloaded", [])
    llama = tmp_path / "llama_cpp" / "lib"
    llama.mkdir(parents=True)
    native._preload_cuda_libraries(str(llama))
    assert opened == []  # CPU build
    (llama / "libggml-cuda.so.0").write_bytes(b"")
    native._preload_cuda_libraries(str(llama))
    assert opened == [str(wheels / n) for n in ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13")]


@requires_native
@pytest.mark.parametrize("gpu_layers", [0, -1])
def test_bench_json_says_where_each_model_ran(tmp_path, gpu_layers):
    from dgcli.runtime import native

    native.lib()
    if native.gpu_devices():
        pytest.skip("a GPU is visible: --gpu-layers offloads here")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("rev\treverse: AB\n")
    result = CliRunner().invoke(app, ["bench", "--json", "--repeat", "1", "--max-new-tokens", "8", "--prompts",
                                      str(prompts), "--batch-sizes", "1", "--gpu-layers", str(gpu_layers)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc["placement"]) == {"diffusion", "speed", "autoregressive"}
    for role, placed in doc["placement"].items():
        assert any(b["kind"] == "model" and b["buffer"].startswith("CPU") for b in placed["buffers"])
        if gpu_layers == 0:  # nothing asked for: llama.cpp says "offloaded 0/N layers"
            assert placed["offloaded_layers"] in (0, None) and "no_gpu_reason" not in placed
        else:  # asked for, and there is no GPU here
            assert placed["offloaded_layers"] is None and placed["no_gpu_reason"] == native.no_gpu_reason()
    gpu_notes = [n for n in doc["notes"] if n.startswith("--gpu-layers")]
    if gpu_layers == 0:  # nothing was asked of a GPU: nothing to say
        assert gpu_notes == []
    else:
        assert gpu_notes == [f"--gpu-layers -1: the {role} model ran on the CPU: {native.no_gpu_reason()}"
                             for role in ("diffusion", "speed", "autoregressive")]


@requires_native
def test_generate_and_compare_json_say_where_the_models_ran():
    from dgcli.runtime import native

    native.lib()
    if native.gpu_devices():
        pytest.skip("a GPU is visible: --gpu-layers offloads here")
    common = ["reverse: AB", "-n", "4", "--seed", "0", "--json", "--gpu-layers", "-1"]
    generated = CliRunner().invoke(app, ["generate", *common])
    assert generated.exit_code == 0, generated.output
    compared = CliRunner().invoke(app, ["compare", *common])
    assert compared.exit_code == 0, compared.output
    compare_doc = json.loads(compared.stdout)
    placements = [json.loads(generated.stdout)["placement"], compare_doc["diffusion"]["placement"],
                  compare_doc["autoregressive"]["placement"]]
    for placed in placements:
        assert placed["offloaded_layers"] is None and placed["no_gpu_reason"] == native.no_gpu_reason()
        assert any(b["kind"] == "model" and b["buffer"].startswith("CPU") for b in placed["buffers"])


@requires_native
def test_bench_verbose_prints_where_each_model_went(tmp_path):
    # bench handed the engines its config's str paths, and --verbose's report took path.name: a traceback
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("rev\treverse: AB\n")
    result = CliRunner().invoke(app, ["bench", "--verbose", "--repeat", "1", "--max-new-tokens", "8", "--prompts",
                                      str(prompts), "--batch-sizes", "1"])
    assert result.exit_code == 0, result.output
    assert "diffusion model demo-diffusion.gguf: " in result.stderr
    assert "autoregressive model demo-ar.gguf: " in result.stderr


@requires_native
def test_verbose_placement_lines_are_not_wrapped_when_piped():
    # Rich wrapped the buffers line at 80 columns on a pipe: "..., CPU \ncompute 3.2 MB", a broken line for grep
    result = CliRunner().invoke(app, ["generate", "reverse: AB", "-n", "4", "--seed", "0", "--no-live", "--verbose"])
    assert result.exit_code == 0, result.output
    buffers = [line for line in result.stderr.splitlines() if line.startswith("  buffers: ")]
    assert len(buffers) == 1 and len(buffers[0]) > 80, result.stderr
    assert re.fullmatch(r"  buffers: (\S+ (model|KV|compute) \d+\.\d\d MB(, |$))+", buffers[0].rstrip()), buffers[0]


def test_verbose_buffer_sizes_are_decimal_and_not_more_precise_than_llama_cpp_said():
    from dgcli.cli.render import placement_lines

    report = LoadReport.from_log(["load_tensors:   CPU_Mapped model buffer size =     0.12 MiB",
                                  "llama_kv_cache:        CPU KV buffer size =     0.00 MiB",
                                  "llama_context:       CUDA0 compute buffer size =  1024.50 MiB"])
    # decimal units, as every size dg prints (they were MiB), to llama.cpp's 0.01 MiB: not "125.8 kB" (the
    # file's 128.0 kB embedding, rounded by llama.cpp and blown up), "0 B", "1.1 GB"
    assert placement_lines("m", report)[1] == "  buffers: CPU_Mapped model 0.13 MB, CPU KV 0.00 MB, CUDA0 compute 1074.27 MB"
    assert report.to_json()["buffers"][2] == {"buffer": "CUDA0", "kind": "compute", "bytes": round(1024.5 * 2**20)}


@requires_native
def test_cpu_moe_with_gpu_layers_0_offloads_nothing_as_asked():
    # --n-cpu-moe/--cpu-moe offload every layer "unless --gpu-layers says how many": `--gpu-layers 0` was
    # taken for "not given", so -v and the warning spoke of --gpu-layers -1, which nobody typed
    for flags in (["--cpu-moe", "--gpu-layers", "0"], ["--n-cpu-moe", "2", "-ngl", "0"]):
        result = CliRunner().invoke(app, ["generate", "reverse: AB", "-n", "4", "--seed", "0", "--no-live", "-v", *flags])
        assert result.exit_code == 0, result.output
        assert "--gpu-layers -1" not in result.stderr, result.stderr
        assert re.search(r"diffusion model \S+: 0/\d+ layers offloaded to the GPU", result.stderr), result.stderr
    # not given: every layer (here: the warning that there is no GPU to offload to)
    result = CliRunner().invoke(app, ["generate", "reverse: AB", "-n", "4", "--seed", "0", "--no-live", "--cpu-moe"])
    assert result.exit_code == 0, result.output
    from dgcli.runtime import native

    if not native.gpu_devices():  # named by the flag typed, not the --gpu-layers -1 it implies
        assert "warning: --cpu-moe (which offloads every layer but the experts it keeps): " in result.stderr, \
            result.stderr
        assert "--gpu-layers" not in result.stderr, result.stderr
        result = CliRunner().invoke(app, ["generate", "reverse: AB", "-n", "4", "--seed", "0", "--no-live",
                                          "--n-cpu-moe", "1"])
        assert result.exit_code == 0 and "warning: --n-cpu-moe (which offloads" in result.stderr, result.stderr


def test_memory_needs_count_the_transposed_embeddings_of_dense_self_conditioning(monkeypatch):
    """The dense form (the default) makes a Q8_0 copy of E^T on the first self-conditioned step,
    262144 x 2816 at real widths: 36 bytes per 32 weights where dg's int8 GEMM repacks it (CPU), 34 as
    ggml's Q8_0 beside the output layer on a GPU; dg info says so."""
    from dgcli.modelfile.info import self_cond_copy_bytes

    class Tensor:
        def __init__(self, name, shape):
            self.name, self.shape = name, shape

    class Header:
        architecture = "diffusion-gemma"
        tensors = [Tensor("token_embd.weight", (2816, 262144))]

    weights = 262144 * 2816
    tensors = real_size_tensors(2)
    monkeypatch.setattr(info, "_cpu_runs_repacked_gemms", lambda: True)
    cpu = plan_placement(tensors, 2, 0, 0, gpu=False)
    assert self_cond_copy_bytes(Header(), cpu) == (weights // 32 * 36, 0)
    gpu = plan_placement(tensors, 2, -1, 0, gpu=True)
    assert self_cond_copy_bytes(Header(), gpu) == (0, weights // 32 * 34)
    monkeypatch.setattr(info, "_cpu_runs_repacked_gemms", lambda: False)
    assert self_cond_copy_bytes(Header(), cpu) == (weights // 32 * 34, 0)
    # a vocabulary that is not whole 32-token blocks: an F32 copy
    Header.tensors = [Tensor("token_embd.weight", (64, 500))]
    assert self_cond_copy_bytes(Header(), cpu) == (64 * 500 * 4, 0)
    # only where dense is the default: a top-k default makes no copy
    monkeypatch.setattr("dgcli.runtime.self_cond.DEFAULT_SC_TOP_K", 64)
    assert self_cond_copy_bytes(Header(), cpu) == (0, 0)


def test_info_shows_the_self_conditioning_copy(tiny_diff, monkeypatch):
    fake_ram(monkeypatch, 64 * GB)
    meta = info.read_info(tiny_diff)
    assert meta.self_cond_bytes == 500 * 64 * 4 and not meta.self_cond_on_gpu  # dg-tiny: 500 tokens, F32
    assert meta.to_json()["self_cond_bytes"] == meta.self_cond_bytes
    result = CliRunner().invoke(app, ["info", str(tiny_diff)])
    assert result.exit_code == 0, result.output
    assert "dense (the reference's): 128.0 kB of transposed embeddings in RAM, made on first use" in " ".join(result.output.split())
