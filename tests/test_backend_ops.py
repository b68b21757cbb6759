"""Does every node of dg's graphs run on a GPU backend? Asked of ggml-metal's own supports_op
(compiled here from the vendored source) and read from ggml-cuda's, about the nodes of a real-size
step captured on the CPU (tests/backend_ops.py says how). No Mac and no GPU are needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import backend_ops as ops
from backend_ops import Node, Tensor
from native_helpers import requires_native

pytestmark = requires_native

# sha256 of the texts tests/backend_ops.py cuts out of the vendored llama.cpp. When a llama.cpp
# upgrade changes one: re-read the new text against tests/opcheck/ (metal_stubs.h: what the device
# object holds; harness.c: the Apple GPU profiles, the stubbed scratch sizes) or against
# CUDA_CONDITIONS in tests/backend_ops.py, fix what no longer holds, then pin the new hash.
METAL_SHA256 = "666d0807b689d9d531f22a90a812b476741f37ba457524a181008de55b203cf2"
CUDA_SHA256 = "86777a82261a43d308b0e25c4bb1f64582304be0792734161110af00e4f5cc40"

# The real widths: Gemma 4 26B-A4B's vocabulary, hidden size and experts, dg's canvas. Two layers
# hold every kind of node: a sliding-window layer and a full-attention one (other head size, no V).
VOCAB, HIDDEN, EXPERTS, EXPERTS_USED, CANVAS, TOP_K = 262144, 2816, 128, 8, 256, 64


@pytest.fixture(scope="module")
def llama():
    return ops.vendored_llama_cpp()


@pytest.fixture(scope="module")
def harness(llama, tmp_path_factory):
    return ops.build_metal_harness(llama, tmp_path_factory.mktemp("opcheck"))


@pytest.fixture(scope="module")
def captured(harness, tmp_path_factory) -> list[Node]:
    """The prefill, one-graph step and commit of a real-width two-layer model (random Q4_K_M-typed
    weights, 1.7 GB written once per run), captured in their own process in the GPU form."""
    from dgcli.testing.tiny import write_synthetic_gguf

    model = write_synthetic_gguf(tmp_path_factory.mktemp("real-width") / "two-layers.gguf", n_layer=2,
                                 vocab_size=VOCAB, hidden=HIDDEN, outtype="q4_k_m", num_experts=EXPERTS,
                                 top_k_experts=EXPERTS_USED, canvas_length=CANVAS)
    try:
        env = dict(os.environ, **ops.GPU_FORM_ENV, PYTHONPATH=os.pathsep.join(filter(None, (
            str(ops.ROOT), os.environ.get("PYTHONPATH")))))
        done = subprocess.run([sys.executable, str(Path(ops.__file__)), "capture", str(model), str(harness)],
                              capture_output=True, text=True, env=env, timeout=900)
    finally:
        model.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    return ops.nodes_from_capture(done.stdout.splitlines())


def describe(node: Node) -> str:
    srcs = ", ".join(f"{s.type}{list(s.ne)}" for s in node.src if s is not None)
    return f"{node.graph}: {node.name} {node.kind} {node.tensor.type}{list(node.tensor.ne)} <- {srcs}"


# -- the pinned texts -------------------------------------------------------------------------------------


def test_ggml_metal_supports_op_is_the_text_read(llama):
    digest = ops.sha256_text(ops.metal_function_text(llama))
    assert digest == METAL_SHA256, (
        f"ggml-metal's supports_op / get_alloc_size changed (sha256 {digest}): re-read them against "
        "tests/opcheck/metal_stubs.h and harness.c, then pin the new hash in METAL_SHA256")


def test_ggml_cuda_supports_op_is_the_text_read(llama):
    digest = ops.sha256_text(ops.cuda_function_text(llama))
    assert digest == CUDA_SHA256, (
        f"ggml-cuda's supports_op or what CUDA_CONDITIONS relies on changed (sha256 {digest}): re-read it against "
        "CUDA_CONDITIONS in tests/backend_ops.py, then pin the new hash in CUDA_SHA256")


# -- the checks can tell yes from no ----------------------------------------------------------------------


def test_extract_function_skips_braces_in_comments_and_strings():
    text = 'int a(void) { return 1; }\nbool f(int x) { /* } */ const char *s = "}{"; // }\n if (x) { return 1; } return 0; }\nint g;'
    assert ops.extract_function(text, "bool f(") == text[text.index("bool f("):text.index("\nint g;")]
    with pytest.raises(ValueError, match="occurs 0 times"):
        ops.extract_function(text, "void h(")


def test_metal_check_tells_supported_ops_from_unsupported_ones(harness):
    lib = ops.load_harness(harness)
    assert ops.profile_names(lib) == ["apple7", "apple7-no-bfloat"]
    for profile in range(2):
        # 0 OUT_PROD (ggml-metal has no kernel), 1 the same contraction as MUL_MAT, 2 a Q4_K MUL_MAT, 3 CUSTOM
        assert [lib.dg_opcheck_probe(which, profile) for which in range(4)] == [0, 1, 1, 0]


def _node(op: str, dst: Tensor, *srcs: Tensor | None, sub: str = "-", params=(0, 0, 0, 0)) -> Node:
    return Node("probe", "probe", op, sub, dst, tuple(srcs) + (None,) * (4 - len(srcs)), params, 0, (True, True))


def test_cuda_check_tells_supported_ops_from_unsupported_ones(llama):
    groups = ops.cuda_case_groups(ops.cuda_function_text(llama))
    f32 = Tensor("f32", (2816, 256, 1, 1), "c12re3a")
    q8 = Tensor("q8_0", (2816, 64, 256, 1), "c12re3a")
    q4k = Tensor("q4_K", (2816, 704, 1, 1), "c12re3a")
    f16 = Tensor("f16", (2816, 256, 1, 1), "c12re3a")
    taken = [_node("OUT_PROD", f32, f32, f32), _node("MUL_MAT", f32, q4k, f32), _node("ARGMAX", f32, f32),
             _node("UNARY", f32, f32, sub="TANH")]
    refused = [_node("OUT_PROD", f32, q8, f32),                     # a quantized operand
               _node("MUL_MAT", f32, q4k, f16),                     # F16 activations with a quantized weight
               _node("UNARY", f32, Tensor("f32", (2816, 256, 1, 1), "2re"), sub="TANH"),  # not contiguous
               _node("CUSTOM", f32, f32),                           # no case at all
               _node("UNARY", f32, f32, sub="DIAG_NOT_A_UNARY_OP")]
    assert ops.cuda_verdicts(taken, groups) == []
    assert [n for n, _ in ops.cuda_verdicts(refused, groups)] == refused


# -- the real graphs ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_capture_is_the_gpu_form_at_real_widths(captured):
    step = [n for n in captured if n.graph == "step"]
    assert {n.graph for n in captured} == {"prefill", "step", "dense-step", "commit"}
    # dg's CPU-only ops (its GEMMs, the sampler's op) are what a GPU never sees
    assert not [n for n in captured if n.op == "CUSTOM"]
    [lm_head] = [n for n in step if n.op == "MUL_MAT" and n.tensor.ne[:2] == (VOCAB, CANVAS)]
    assert lm_head.src[0].ne[:2] == (HIDDEN, VOCAB)
    experts = [n for n in step if n.op == "MUL_MAT_ID"]
    assert len(experts) == 4 and all(n.src[0].ne[2] == EXPERTS and n.src[2].ne[:2] == (EXPERTS_USED, CANVAS)
                                     for n in experts)
    assert sorted(n.src[0].ne[0] for n in step if n.op == "FLASH_ATTN_EXT") == [256, 512]  # sliding, full
    # the sampler's pass as ggml ops, over the whole vocabulary of every canvas position
    for op in ("ARGMAX", "CUMSUM", "TOP_K", "SOFT_MAX"):
        assert any(n.op == op and n.src[0].ne[:2] == (VOCAB, CANVAS) for n in step), op
    # the top-k self-conditioning input: k rows of E per canvas position, contracted by a MUL_MAT
    [rows] = [n for n in step if n.name == "sc_rows"]
    assert rows.tensor.ne[:2] == (HIDDEN, TOP_K * CANVAS)
    [topk] = [n for n in step if n.name == "sc_topk_product"]
    assert topk.op == "MUL_MAT" and topk.src[0].ne[:3] == (TOP_K, HIDDEN, CANVAS)
    # the dense form (the default): the next step's soft embedding, one MUL_MAT of E^T and the probabilities
    [dense] = [n for n in captured if n.graph == "dense-step" and n.name == "sc_dense_product"]
    assert dense.op == "MUL_MAT" and dense.src[0].type == "q8_0" and dense.src[0].ne[:2] == (VOCAB, HIDDEN)
    assert dense.src[1].ne[:2] == (VOCAB, CANVAS) and dense.tensor.ne[:2] == (HIDDEN, CANVAS)
    assert not [n for n in captured if n.op == "OUT_PROD"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_node_runs_on_metal(captured):
    """ggml-metal's supports_op, on the oldest Apple GPU it runs matrix kernels on (with and without
    bfloat), takes every node of the prefill, the step and the commit: nothing falls back to the CPU."""
    refused = [describe(n) for n in captured if not all(n.metal)]
    assert not refused, "ggml-metal's supports_op refuses:\n" + "\n".join(refused)


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_node_runs_on_cuda(captured, llama):
    groups = ops.cuda_case_groups(ops.cuda_function_text(llama))
    refused = [f"{describe(n)}: {why}" for n, why in ops.cuda_verdicts(captured, groups)]
    assert not refused, "ggml-cuda's supports_op refuses:\n" + "\n".join(refused)


@pytest.mark.slow
@pytest.mark.subprocess
def test_dg_info_counts_the_scratch_metal_allocates_for_the_step(captured):
    """TOP_K and CUMSUM over [vocabulary, canvas] are where a Metal buffer allocates beyond the
    tensor (512 MiB each at real widths): dg info's GPU need on a Mac counts what get_alloc_size says."""
    from dgcli.modelfile.info import metal_step_scratch_bytes

    step = [n for n in captured if n.graph == "step"]
    scratch = sum(n.metal_alloc for n in step if n.op in ("TOP_K", "CUMSUM"))
    assert scratch == metal_step_scratch_bytes(VOCAB, CANVAS) == 1 << 30
