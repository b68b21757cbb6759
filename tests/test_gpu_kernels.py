"""benchmarks/gpu_kernels.py's pieces that need no GPU: what it reads from test-backend-ops, the cases it
asks for, the switches it sets, and the results file it writes (the device run itself is
benchmarks/gpu_check.py's, dry-run with --cpu-dry-run)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_kernels  # noqa: E402

# test-backend-ops' console output as it prints it (colours included), perf and test mode
PERF_OUT = """\
Testing 2 devices

Backend 1/2: CUDA0
  Device description: NVIDIA H200
  MUL_MAT_ID(type_a=q4_K,type_b=f32,n_mats=128,n_used=8,b=0,m=1408,n=256,k=2816,amax=1.000000,m_v=0):                 1190 runs -   843.21 us/run -  16.24 GFLOP/run - \x1b[1;34m 19.26 TFLOPS\x1b[0m
  MUL_MAT(type_a=q6_K,type_b=f32,m=4096,n=256,k=2816,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,src_overlap=0,m_v=0,pad=0):   9802 runs -   102.50 us/run -   5.91 GFLOP/run - \x1b[1;34m 57.65 TFLOPS\x1b[0m
  TOP_K(type=f32,ne=[262144,256,1,1],k=64,ties=0):                 40 runs - 25001.00 us/run -  262144 kB/run - \x1b[1;34m 10.73 GB/s\x1b[0m
  Backend CUDA0: \x1b[1;32mOK\x1b[0m
"""
TEST_OUT = """\
  MUL_MAT_ID(type_a=q4_K,type_b=f32,n_mats=128,n_used=8,b=0,m=1408,n=256,k=2816,amax=1.000000,m_v=0): \x1b[1;32mOK\x1b[0m
  MUL_MAT_ID(type_a=q5_0,type_b=f32,n_mats=128,n_used=8,b=0,m=2816,n=256,k=704,amax=1.000000,m_v=0): [MUL_MAT_ID] NMSE = 0.012345678 > 0.000500000 \x1b[1;31mFAIL\x1b[0m
  MUL_MAT_ID(type_a=bf16,type_b=f32,n_mats=128,n_used=8,b=0,m=1408,n=256,k=2816,amax=1.000000,m_v=0): not supported [CUDA0]
  2/3 tests passed
"""


def test_perf_output_is_read_per_case():
    cases = gpu_kernels.parse_tbo(PERF_OUT)
    assert [(c["op"], c["runs"], c["us"]) for c in cases] == [
        ("MUL_MAT_ID", 1190, 843.21), ("MUL_MAT", 9802, 102.5), ("TOP_K", 40, 25001.0)]
    assert [gpu_kernels.case_key(c) for c in cases] == [
        "moe q4_K 1408x2816 e128/8 n256", "dense q6_K 4096x2816 n256", "top_k [262144,256,1,1] k=64"]


def test_test_output_gives_each_case_its_status():
    cases = gpu_kernels.parse_tbo(TEST_OUT)
    assert [c["status"] for c in cases] == ["OK", "FAIL", "not supported"]
    assert "NMSE" in cases[1]["detail"]


def test_dense_auto_takes_the_shapes_where_bf16_ran_faster():
    line = "  MUL_MAT(type_a={t},type_b=f32,m={m},n=256,k={k},bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,src_overlap=0,m_v=0,pad=0):  10 runs - {us} us/run - 1 GFLOP/run - 1 TFLOPS"
    mmq = gpu_kernels.parse_tbo("\n".join([line.format(t="q4_K", m=4096, k=2816, us=100.0),
                                           line.format(t="q6_K", m=2816, k=4096, us=50.0),
                                           line.format(t="q8_0", m=2112, k=2816, us=80.0)]))
    bf16 = gpu_kernels.parse_tbo("\n".join([line.format(t="q4_K", m=4096, k=2816, us=40.0),
                                            line.format(t="q6_K", m=2816, k=4096, us=70.0),
                                            line.format(t="q8_0", m=2112, k=2816, us=79.0)]))
    perf = {"dense": {"base": mmq, "dense_bf16": bf16}}
    assert gpu_kernels.dense_auto_shapes(perf, ["mul_mat:q4_K:4096:256:2816", "mul_mat:q6_K:2816:256:4096",
                                                "mul_mat:q8_0:2112:256:2816"]) == ["4096x2816", "2112x2816"]
    # another file's shapes are not this one's
    assert gpu_kernels.dense_auto_shapes(perf, ["mul_mat:q6_K:2816:256:4096"]) == []


def test_switches_are_set_for_the_block_and_restored(monkeypatch):
    monkeypatch.setenv("DG_CUDA_TOPK", "radix")
    monkeypatch.delenv("DG_CUDA_FUSED_STEP", raising=False)
    with gpu_kernels.switched({"DG_CUDA_FUSED_STEP": "1"}):
        assert os.environ.get("DG_CUDA_FUSED_STEP") == "1"
        assert "DG_CUDA_TOPK" not in os.environ  # a setting is exactly its switches
    assert os.environ.get("DG_CUDA_TOPK") == "radix" and "DG_CUDA_FUSED_STEP" not in os.environ


def test_every_setting_names_only_known_switches():
    settings = gpu_kernels.variants(["4096x2816"])
    assert settings["base"] == {}
    assert settings["dense_auto"] == {"DG_CUDA_DENSE": "bf16:4096x2816"}
    assert settings["all"]["DG_CUDA_DENSE"] == "bf16:4096x2816" and settings["all"]["DG_CUDA_FUSED_STEP"] == "1"
    assert "dense_auto" not in gpu_kernels.variants([])
    for env in settings.values():
        assert set(env) <= set(gpu_kernels.SWITCHES)


def test_cases_come_from_the_files_tensors(tmp_path):
    from dgcli.testing.tiny import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "m.gguf", n_layer=2, outtype="q8_0", vocab_size=4096, hidden=256,
                                num_experts=8, top_k_experts=2, moe_intermediate_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                                num_global_key_value_heads=1)
    cases = gpu_kernels.model_cases(path, n_tokens=32)
    assert "mul_mat_id:q8_0:8:2:512:32:256" in cases["moe"]  # gate+up: 2 x 256 rows of 256
    assert "mul_mat_id:q8_0:8:2:256:32:256" in cases["moe"]  # down
    assert {c.split(":")[1] for c in cases["moe_half"]} == {"bf16", "f16"}
    assert "mul_mat:q8_0:4096:32:256" in cases["dense"]  # the LM head, tied to the embedding
    assert "mul_mat:q8_0:256:32:4096" in cases["dense"]  # the dense self-conditioning product, E^T x probs
    assert all(c.startswith("mul_mat:") for c in cases["dense"])
    assert cases["topk"] == [gpu_kernels.TOPK_CASE]


def test_results_file_has_the_issues_keys(tmp_path):
    quants = {"q4_k_m": {"step_ms": {"base": {"min": 67.1, "median": 67.8, "n": 8},
                                     "fused_step": {"min": 60.0, "median": 61.0, "n": 8}},
                         "decode_ms": {"base": {"min": 4.73, "median": 4.8, "n": 8}}}}
    doc = gpu_kernels.results_document("NVIDIA H200", quants, "q4_k_m", {"failed": []})
    path = gpu_kernels.write_results(tmp_path, doc)
    assert path.name.startswith("gpu-") and path.suffix == ".json"
    back = json.loads(path.read_text())
    assert {"device", "quant", "step_ms", "decode_ms", "variants"} <= back.keys()
    assert back["step_ms"] == 67.1 and back["decode_ms"] == 4.73
    assert back["variants"] == {"base": 67.1, "fused_step": 60.0}


def test_packed_tools_are_unpacked_and_executable(tmp_path):
    import gzip

    folder = tmp_path / "bin"
    folder.mkdir()
    with gzip.open(folder / f"{gpu_kernels.KERNEL_TEST}.gz", "wb") as f:
        f.write(b"#!/bin/sh\necho hello\n")
    tools = gpu_kernels.unpack_tools(folder, tmp_path / "out")
    assert tools[gpu_kernels.TEST_BACKEND_OPS] is None
    exe = tools[gpu_kernels.KERNEL_TEST]
    assert exe.read_bytes().startswith(b"#!/bin/sh") and os.access(exe, os.X_OK)


@pytest.fixture(scope="module")
def patched_test_backend_ops(tmp_path_factory):
    """test-backend-ops from the patched source, against the installed llama_cpp's libraries (the CPU
    build here: the DG_TBO_CASES our patch adds is host code, the same in a CUDA build)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import shutil
    import subprocess

    sys.path.insert(0, str(ROOT / "native"))
    import build

    lib = Path(llama_cpp.__file__).parent / "lib"
    sdist = build.cache_root().parent / "sdist" / build.SDIST_FILE
    if shutil.which("g++") is None or not (lib / "libggml.so").exists() or not sdist.exists():
        pytest.skip("needs g++, the installed llama_cpp's libraries and the cached sdist")
    tmp = tmp_path_factory.mktemp("tbo")
    pristine = build.extract_pristine(sdist) / "vendor" / "llama.cpp"
    src = tmp / "tbo.cpp"
    src.write_bytes(build.patched_contents(pristine, tmp / "log")["tests/test-backend-ops.cpp"])
    exe = tmp / "tbo"
    subprocess.run(["g++", "-O0", "-std=c++17", "-I", str(pristine / "ggml" / "include"), str(src), "-L", str(lib),
                    "-l:libggml.so", "-l:libggml-base.so", "-pthread", "-o", str(exe)], check=True)
    return exe, lib


@pytest.mark.subprocess
@pytest.mark.parametrize("bad", ["nonsense", "mul_mat:q4_K:0:256:2816", "mul_mat:q9_9:64:8:256"])
def test_test_backend_ops_refuses_a_bad_case_list(patched_test_backend_ops, bad):
    """A DG_TBO_CASES item it cannot read stops it with one line naming the variable, exit 1."""
    import subprocess

    exe, lib = patched_test_backend_ops
    env = dict(os.environ, DG_TBO_CASES=bad, LD_LIBRARY_PATH=str(lib))
    run = subprocess.run([str(exe), "perf", "-b", "CPU"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "DG_TBO_CASES" in run.stderr


@pytest.mark.subprocess
def test_test_backend_ops_runs_exactly_the_listed_cases(patched_test_backend_ops):
    import subprocess

    exe, lib = patched_test_backend_ops
    env = dict(os.environ, DG_TBO_CASES="top_k:4096:4:8;mul_mat:q8_0:64:8:256;mul_mat_id:q4_K:8:2:64:8:256",
               LD_LIBRARY_PATH=str(lib))
    ok = subprocess.run([str(exe), "perf", "-b", "CPU"], capture_output=True, text=True, timeout=600, env=env)
    assert ok.returncode == 0, ok.stderr[-500:]
    cases = gpu_kernels.parse_tbo(ok.stdout)
    assert [gpu_kernels.case_key(c) for c in cases] == ["top_k [4096,4,1,1] k=8", "dense q8_0 64x256 n8",
                                                          "moe q4_K 64x256 e8/2 n8"]
    assert all(c["us"] > 0 for c in cases)
