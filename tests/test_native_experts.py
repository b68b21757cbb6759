"""The MoE experts repacked while loading (native/patch/src/diffusion-gemma-experts.cpp): dg's CPU extra
buffer type per kernel family, MUL_MAT_ID on its tensors, and the CPU kernel family switch
(DG_CPU_KERNELS), torch-free.

Every kernel is checked against ggml's own MUL_MAT_ID on the same experts, on each family this CPU
runs: an AVX-512 VNNI CPU runs the AVX2 kernels too (DG_CPU_KERNELS=avx2), an AVX2-only CPU skips the
VNNI cases, saying why.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from native_helpers import avx2_tiles, requires_native, small_q4_k_m_gguf

pytestmark = requires_native

FAMILIES = {"avx2": 1, "avx512-vnni": 2}  # dg_expert_repack_kernel()'s numbers
TILES = ["avx2", "avx-vnni", "avx512-vnni"]  # the families' tiles: avx-vnni, the AVX2 layouts on AVX-VNNI
TYPES = {"q8_0": 8, "q5_0": 6, "q4_K": 12, "q6_K": 14}  # ggml_type: the types the registry's files give experts
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lib():
    from dgcli.runtime import native

    return native.lib()._lib


def _runs_here(family: str) -> bool:
    return bool(_lib().dg_expert_buffer_type(FAMILIES[family]))


# (n_in, n_out, n_expert, n_used, n_tokens, input per (token, expert), threads)
SHAPES = [
    (704, 2816, 16, 8, 48, True, 2),     # the real down projection's widths, fewer experts
    (2816, 1408, 16, 8, 24, False, 3),   # the real gate+up's
    (2816, 1408, 128, 8, 1, False, 2),   # a one-token decode: 8 of 128 experts, one column each
    (256, 37, 5, 2, 9, True, 1),         # a partial last row group
    (512, 100, 6, 3, 7, False, 4),       # more threads than some experts have groups
    (256, 16, 32, 8, 3, True, 5),        # most experts unused
    (96, 40, 4, 2, 11, False, 2),        # an odd count of blocks: VNNI's Q8_0 / Q5_0 scales padded
]


@pytest.mark.parametrize("family", TILES)
@pytest.mark.parametrize("weight_type", sorted(TYPES))
@pytest.mark.parametrize("n_in, n_out, n_expert, n_used, n_tokens, per_slot, threads", SHAPES)
def test_repacked_experts_give_ggml_mul_mat_id(family, weight_type, n_in, n_out, n_expert, n_used, n_tokens,
                                               per_slot, threads, monkeypatch):
    """MUL_MAT_ID on experts loaded into dg's buffer (repacked by its set_tensor, as the loader loads them)
    against ggml's own MUL_MAT_ID on the same ggml-quantized experts in plain memory, in one CPU graph:
    both quantize the activations the same way, so only float summation order may differ. An output the
    repacked GEMM computed wrong, skipped or read from the file's layout is far off."""
    family = avx2_tiles(family, monkeypatch)
    if not _runs_here(family):
        pytest.skip(f"this CPU lacks the {family} kernels' instructions")
    if weight_type in ("q4_K", "q6_K") and n_in % 256:
        pytest.skip(f"no {weight_type} tensor has rows of {n_in}: K-quant rows are whole 256-wide super-blocks")
    diff = ctypes.c_double(-1.0)
    rc = _lib().dg_expert_buffer_selftest(FAMILIES[family], TYPES[weight_type], n_in, n_out, n_expert, n_used,
                                          n_tokens, per_slot, threads, 11, ctypes.byref(diff))
    assert rc == 0
    assert diff.value < 2e-6


@pytest.mark.parametrize("prefetch", ["0", "1"], ids=["no-prefetch", "prefetch"])
@pytest.mark.parametrize("family", TILES)
@pytest.mark.parametrize("weight_type", sorted(TYPES))
def test_repacked_tiles_agree_with_a_double_precision_sum(family, weight_type, prefetch, monkeypatch):
    """The repacked GEMM's arithmetic against a float64 sum over the same quantized activations and the
    experts as ggml's dequantizer decodes them (random blocks over the types' whole ranges: Q4_K's 6-bit
    scales and mins, Q6_K's int8 scales, Q5_0's fifth bits), uneven routing, the work split over 3 threads;
    with and without the next group's prefetch (DG_EXPERT_PREFETCH; AMD CPUs have it by default)."""
    monkeypatch.setenv("DG_EXPERT_PREFETCH", prefetch)
    family = avx2_tiles(family, monkeypatch)
    if not _runs_here(family):
        pytest.skip(f"this CPU lacks the {family} kernels' instructions")
    err = ctypes.c_double(-1.0)
    rc = _lib().dg_experts_repacked_selftest(FAMILIES[family], TYPES[weight_type], 512, 72, 9, 3, 20, True, 3, 5,
                                             ctypes.byref(err))
    assert rc == 0
    assert err.value < 1e-5


def test_repacked_layouts_are_about_the_files_size():
    """The repacked experts replace the file's copy: each type's layout is within 10% of its file bytes
    (AVX2's Q8_0: + quant sums, 6%; its Q5_0: + sums, 9%; Q4_K: scales unpacked, 3%; AVX2's Q6_K: its
    correction, 2%; VNNI's Q8_0, Q5_0 and Q6_K: the file's bytes), and a width that is not whole blocks
    is refused."""
    lib = _lib()
    file_bytes = {"q8_0": 34 / 32, "q5_0": 22 / 32, "q4_K": 144 / 256, "q6_K": 210 / 256}
    checked = 0
    for family, kernel in FAMILIES.items():
        if not _runs_here(family):
            continue
        for name, type_id in TYPES.items():
            n_in, n_out, n_expert = 2816, 1408, 128
            size = lib.dg_expert_repacked_bytes(kernel, type_id, n_in, n_out, n_expert)
            ratio = size / (file_bytes[name] * n_in * n_out * n_expert)
            assert 1.0 <= ratio <= 1.10, (family, name, ratio)
            checked += 1
        assert lib.dg_expert_repacked_bytes(kernel, TYPES["q4_K"], 704, 16, 4) == -1  # 704 is not whole super-blocks
    if not checked:
        pytest.skip("this CPU runs no dg kernel family (no AVX2)")


def test_memory_plan_counts_the_repacked_layouts_bytes():
    """`dg info` and the pre-load check (dgcli.modelfile.info, no native library there) count the repacked
    experts' bytes as the native layouts of each family take them: real widths, an odd count of blocks
    (VNNI's Q8_0 / Q5_0 scales padded), a partial row group, widths a type does not repack."""
    from dgcli.modelfile.info import repacked_expert_bytes

    lib = _lib()
    checked = 0
    for family, kernel in FAMILIES.items():
        if not _runs_here(family):
            continue
        for name, type_id in TYPES.items():
            for n_in, n_out, n_expert in ((2816, 1408, 128), (704, 2816, 128), (96, 40, 3), (512, 37, 5), (100, 16, 2)):
                native_bytes = lib.dg_expert_repacked_bytes(kernel, type_id, n_in, n_out, n_expert)
                planned = repacked_expert_bytes(name.upper(), n_in, n_out, n_expert, family)
                assert (planned if planned is not None else -1) == native_bytes, (family, name, n_in, n_out)
                checked += 1
    if not checked:
        pytest.skip("this CPU runs no dg kernel family (no AVX2)")


# ---- the kernel family switch ---------------------------------------------------------------------

_KERNELS_SCRIPT = """
import json
from dgcli.runtime import native
lib = native.lib()._lib
print(json.dumps({"experts": lib.dg_expert_repack_kernel(), "dense": lib.dg_dense_kernel()}))
"""


def _kernels_under(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DG_")}
    out = subprocess.run([sys.executable, "-c", _KERNELS_SCRIPT], env=clean | env, cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_cpu_kernels_names_the_family_and_each_component_may_override_it():
    """DG_CPU_KERNELS picks the family of every component (experts, dense projections; the LM head reads
    the same way); a component's own variable wins; a family this CPU lacks means ggml's kernels."""
    if not _runs_here("avx2"):
        pytest.skip("this CPU lacks AVX2: every family is ggml's")
    vnni = 2 if _runs_here("avx512-vnni") else 0
    assert _kernels_under({"DG_CPU_KERNELS": "avx2"}) == {"experts": 1, "dense": 1}
    assert _kernels_under({"DG_CPU_KERNELS": "avx512-vnni"}) == {"experts": vnni, "dense": vnni}
    assert _kernels_under({"DG_CPU_KERNELS": "ggml"}) == {"experts": 0, "dense": 0}
    assert _kernels_under({"DG_CPU_KERNELS": "avx2", "DG_EXPERT_GEMM": "ggml"}) == {"experts": 0, "dense": 1}
    assert _kernels_under({"DG_CPU_KERNELS": "ggml", "DG_DENSE_GEMM": "avx2"}) == {"experts": 0, "dense": 1}
    assert _kernels_under({}) == _kernels_under({"DG_CPU_KERNELS": "auto"}) == \
        {"experts": vnni or 1, "dense": vnni or 1}


# ---- a model's experts through the loader ---------------------------------------------------------

_EXPERT_NODES = ("ffn_moe_gate_up-0", "ffn_moe_down_scaled-0")

_MODEL_SCRIPT = """
import ctypes, json, os, sys
import numpy as np
from dgcli.runtime import native
from dgcli.runtime.model import DiffusionModel

folder = os.path.dirname(native.lib()._lib._name)
base = ctypes.CDLL(os.path.join(folder, "libggml-base.so"))
for fn, restype in (("ggml_get_name", ctypes.c_char_p), ("ggml_get_data", ctypes.c_void_p), ("ggml_nbytes", ctypes.c_size_t)):
    getattr(base, fn).restype, getattr(base, fn).argtypes = restype, [ctypes.c_void_p]
wanted, nodes = set(sys.argv[3].split(",")), {}

def on_node(tensor, ask, _):
    name = base.ggml_get_name(tensor).decode()
    if ask:
        return name in wanted
    nodes[name] = np.frombuffer(ctypes.string_at(base.ggml_get_data(tensor), base.ggml_nbytes(tensor)), np.float32).tolist()
    return True

callback = (ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(on_node), None)
# exact mode: F32 GELU (ggml's reads an F16 table, which turns a last-bit difference into 1e-3 that later
# layers amplify); the expert products themselves are the fast mode's
with DiffusionModel(sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=128, exact=True, eval_callback=callback) as m:
    count = native.lib()._lib.dg_expert_gemm_count(m._model)
    prefill = m.prefill([2, 105, 40, 41, 42, 43, 44, 45, 46, 47, 48, 106], return_logits=True)
    decode = m.prefill([60], return_logits=True)  # a one-token batch: 2 of 8 experts, a column each
    canvas = np.random.default_rng(20).integers(0, m.vocab_size, m.canvas_length)
    nodes.clear()
    logits = m.decode_canvas(canvas)
    buffers = [name for name, kind, _ in m.load_report.buffers if kind == "model"]
    print(json.dumps({"count": count, "buffers": buffers, "prefill": prefill.tolist(), "decode": decode.tolist(),
                      "logits": logits.tolist(), "nodes": nodes, "n_layer": m.header.get("diffusion-gemma.block_count")}))
"""


def _run_model(path, env: dict[str, str], threads: int) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DG_")}
    out = subprocess.run([sys.executable, "-c", _MODEL_SCRIPT, str(path), str(threads), ",".join(_EXPERT_NODES)],
                         env=clean | env, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _model(tmp_path, weights: str):
    from dgcli.testing.tiny import write_tiny_random_gguf

    if weights == "q4_k_m":  # Q4_K gate+up; down Q4_K (layer 0) and Q6_K (layer 1)
        return small_q4_k_m_gguf(tmp_path / "q4_k_m.gguf", seed=3)
    return write_tiny_random_gguf(tmp_path / "q8_0.gguf", seed=8, outtype="q8_0")


@pytest.mark.subprocess
@pytest.mark.parametrize("weights", ["q8_0", "q4_k_m"])
def test_a_models_experts_are_repacked_and_give_ggml_results(tmp_path, weights):
    """A model's expert tensors (every layer's gate+up and down) land in the family's buffer while loading
    (llama.cpp's load report names it) and run there: layer 0's expert products within float rounding of
    ggml's MUL_MAT_ID (DG_EXPERT_GEMM=ggml, every other weight on the same family's kernels, so the inputs
    are the same), the logits of a prompt, a one-token decode and a canvas within 1e-3; at 1 and 2
    threads, on each family this CPU runs."""
    path = _model(tmp_path, weights)
    ran = 0
    for family in FAMILIES:
        if not _runs_here(family):
            continue
        ref = _run_model(path, {"DG_CPU_KERNELS": family, "DG_EXPERT_GEMM": "ggml"}, 2)
        assert ref["count"] == 0 and not any("DG_EXPERTS" in b for b in ref["buffers"])
        assert float(np.std(ref["logits"])) > 0.1  # real logits, not a degenerate output
        for threads in (1, 2):
            got = _run_model(path, {"DG_CPU_KERNELS": family}, threads)
            assert got["count"] == 2 * got["n_layer"]
            assert f"CPU_DG_EXPERTS_{'AVX2' if family == 'avx2' else 'VNNI'}" in got["buffers"]
            for name in _EXPERT_NODES:
                want, have = np.array(ref["nodes"][name]), np.array(got["nodes"][name])
                assert float(np.max(np.abs(have - want))) <= 1e-5 * float(np.max(np.abs(want))), (family, name)
            for key in ("prefill", "decode", "logits"):
                assert float(np.max(np.abs(np.array(got[key]) - np.array(ref[key])))) < 1e-3, (family, key)
            ran += 1
    if not ran:
        pytest.skip("this CPU runs no dg kernel family (no AVX2)")
