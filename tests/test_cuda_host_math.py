"""The host-side arithmetic of dg's CUDA kernels, checked on the CPU (no GPU, no CUDA toolkit).

native/tests/dg_cuda_host_test.cpp is compiled with the machine's C++ compiler against the kernels'
headers (native/patch/ggml/src/ggml-cuda/dg-moe-layout.cuh, dg-step-algo.cuh) and the CPU sampler
(native/patch/src/diffusion-gemma-sampler.cpp), then run:
- the compacted MoE grid's tile layout: every routed row in exactly one tile of its own expert, at
  most J rows a tile, no empty tile before the last, within the launch bound, and a MoE product
  computed tile by tile equal to the per-row product;
- the fused step's per-row algorithm (chunk statistics merged, candidates per chunk, the sample from
  one chunk) against the CPU step's row routine on the same rows: entropy, argmax, sample, top-k.
What runs only on a GPU (the kernels themselves) is checked by benchmarks/gpu_check.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "native" / "patch"
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH to build the host test")]


@pytest.fixture(scope="module")
def host_test(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("cuda-host") / "dg_cuda_host_test"
    cmd = [COMPILER, "-O2", "-std=c++17", "-I", str(PATCH / "ggml" / "src" / "ggml-cuda"), "-I", str(PATCH / "src"),
           "-I", str(PATCH / "include"), str(ROOT / "native" / "tests" / "dg_cuda_host_test.cpp"),
           str(PATCH / "src" / "diffusion-gemma-sampler.cpp"), "-o", str(exe)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    return exe


@pytest.mark.parametrize("group", ["layout", "step"])
def test_cuda_kernel_host_math(host_test, group):
    run = subprocess.run([str(host_test), group], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]
    assert " 0 failures" in run.stdout, run.stdout
