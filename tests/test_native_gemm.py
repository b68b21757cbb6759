"""dg's matmul kernels, torch-free: ggml's MoE experts as one GEMM per expert, the int8 GEMM on dg's
own repack (the LM head, the decoder's dense Q8_0 / Q5_0 weights, the experts) and the K-quant
tiles, each against ggml's own matmul and a double-precision sum, and each left to ggml for the
types and batches it does not take.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from native_helpers import avx2_tiles, requires_native, small_q4_k_m_gguf

pytestmark = [requires_native, pytest.mark.slow]  # the kernels at the real model's widths

PROMPT = [2, 105, 40, 41, 42, 43, 44, 45, 46, 47, 48, 106, 107, 105, 60, 61]


def _canvas(seed: int, vocab: int, length: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, length)


# ---- MoE experts as one GEMM per expert ------------------------------------------------------------


_LOGITS_SCRIPT = """
import sys, numpy as np
from dgcli.runtime.model import DiffusionModel
path, threads, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with DiffusionModel(path, n_threads=threads, exact=True, n_ctx=256, n_seq_max=2) as m:
    m.prefill({prompt})
    canvases = np.random.default_rng(19).integers(0, m.vocab_size, (2, 16))
    np.save(out, m.decode_canvases(canvases))
"""


def _logits_in_subprocess(path, threads: int, out, moe_gemm: bool) -> np.ndarray:
    # ggml's MUL_MAT_ID in both (DG_EXPERT_GEMM=ggml): this compares its two paths, not our tiles
    env = dict(os.environ, DG_MOE_GEMM="1" if moe_gemm else "0", DG_CPU_REPACK="0", DG_EXPERT_GEMM="ggml")
    script = _LOGITS_SCRIPT.format(prompt=PROMPT)
    subprocess.run([sys.executable, "-c", script, str(path), str(threads), str(out)], env=env, check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return np.load(out)


def _tiny_quantized(tmp_path, weights: str, seed: int):
    """The tiny random model with its matrices in Q8_0, or in Q5_0 (Q4_K_M files' down projections):
    "q5_0" keeps the embedding (so the LM head) Q8_0, "q5_0 lm head" makes it Q5_0 too."""
    import gguf

    from dgcli.testing.tiny import q5_0_type, write_tiny_random_gguf

    def all_q5_0(spec):
        qtype = q5_0_type(spec)
        return gguf.GGMLQuantizationType.Q5_0 if qtype == gguf.GGMLQuantizationType.Q8_0 else qtype

    storage = {"q8_0": {"outtype": "q8_0"}, "q5_0": {"storage": q5_0_type},
               "q5_0 lm head": {"storage": all_q5_0}}[weights]
    return write_tiny_random_gguf(tmp_path / f"{weights.replace(' ', '-')}.gguf", seed=seed, **storage)


@pytest.mark.parametrize("weights", ["q8_0", "q5_0"])
@pytest.mark.subprocess
def test_moe_expert_gemm_matches_the_per_row_path(tmp_path, weights):
    """Q8_0 and Q5_0 experts: the per-expert GEMM (gathered rows, one llamafile_sgemm each, scattered
    back) computes the same products as ggml's per-row vec_dot path (DG_MOE_GEMM=0), whatever the
    thread split; only float summation order may differ."""
    path = _tiny_quantized(tmp_path, weights, seed=4)
    per_row = _logits_in_subprocess(path, 2, tmp_path / "rows.npy", moe_gemm=False)
    for threads in (1, 2):
        gemm = _logits_in_subprocess(path, threads, tmp_path / f"gemm{threads}.npy", moe_gemm=True)
        assert float(np.max(np.abs(gemm - per_row))) < 1e-3
    assert float(np.std(per_row)) > 1.0  # real logits, not a degenerate output


# ---- the LM head on our repacked int8 GEMM ---------------------------------------------------------


KERNELS = {"avx2": 1, "avx-vnni": 1, "avx512-vnni": 2, "emulated": 3}  # avx-vnni: the AVX2 family on AVX-VNNI


WEIGHT_TYPES = {"q8_0": 8, "q5_0": 6}  # ggml_type
K_QUANT_TYPES = {"q4_K": 12, "q6_K": 14}  # ggml_type: the types with tiles of their own (AVX2)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("weight_type", sorted(WEIGHT_TYPES))
@pytest.mark.parametrize("n_embd, n_vocab, n_cols, stream", [
    (64, 500, 16, "0"), (128, 37, 9, "0"), (2816, 1000, 70, "0"), (32 * 600, 40, 9, "0"),
    (96, 512, 37, "1"),  # whole row groups, each column's 16 results streamed into the logits
])
def test_lm_head_kernel_agrees_with_a_double_precision_sum(kernel, weight_type, n_embd, n_vocab, n_cols, stream,
                                                           monkeypatch):
    """Each kernel on random Q8_0 or Q5_0 weights (a partial last row group, a partial column tile)
    against a float64 sum of the same quantized activations and the weights as ggml's dequantizer
    decodes them: float32 rounding only, so the Q5_0 -> int8 repack loses nothing. Rows of 600 blocks
    (as the transposed embeddings' 8192) are multiplied in chunks of 256, the last one shorter; the
    vectorized quantization equals the portable loop byte for byte. DG_STREAM_RESULTS=1 writes the
    results with streaming stores wherever a group's rows are whole (the VNNI family's 16-row groups;
    the default does so for results of over 64 MB only)."""
    import ctypes

    from dgcli.runtime import native

    monkeypatch.setenv("DG_STREAM_RESULTS", stream)
    avx2_tiles(kernel, monkeypatch)
    err = ctypes.c_double()
    rc = native.lib()._lib.dg_lm_head_selftest(KERNELS[kernel], WEIGHT_TYPES[weight_type], n_embd, n_vocab, n_cols,
                                               11, ctypes.byref(err))
    if rc == 1:
        pytest.skip(f"this CPU lacks the {kernel} kernel's instructions")
    assert rc == 0
    assert err.value < 1e-5


@pytest.mark.parametrize("weight_type", sorted(WEIGHT_TYPES))
@pytest.mark.parametrize("n_embd, n_vocab, n_cols, stream", [
    (64, 500, 16, "0"), (2816, 1000, 70, "0"), (32 * 600, 40, 37, "0"), (96, 70, 256, "0"), (32 * 7, 33, 48, "0"),
    (96, 512, 40, "1"),  # whole groups streamed: two AMX column tiles and 8 columns on VNNI's
])
def test_amx_tiles_agree_with_a_double_precision_sum(weight_type, n_embd, n_vocab, n_cols, stream, monkeypatch):
    """The VNNI layout's GEMM on AMX's tiles (16 columns a tile, the rest on VNNI's): whole and partial
    groups and column tiles, even and odd block counts (the tiles take blocks two at a time), chunked
    rows of 600 blocks, the results streamed where asked; against the float64 sum as above, and the
    same with AMX switched off."""
    import ctypes

    from dgcli.runtime import native

    monkeypatch.setenv("DG_STREAM_RESULTS", stream)
    lib = native.lib()._lib
    if not lib.dg_amx_in_use():
        pytest.skip("this CPU has no AMX-INT8 (or Linux does not grant its tile state)")
    for amx in ("1", "0"):
        monkeypatch.setenv("DG_AMX", amx)
        assert lib.dg_amx_in_use() == (amx == "1")
        err = ctypes.c_double()
        rc = lib.dg_lm_head_selftest(KERNELS["avx512-vnni"], WEIGHT_TYPES[weight_type], n_embd, n_vocab, n_cols, 13,
                                     ctypes.byref(err))
        assert rc == 0
        assert err.value < 1e-5


def _logits_with_lm_head(path, lm_head: str, monkeypatch):
    """(LM head path, decode_canvas logits, a graph step) of a model loaded with DG_LM_HEAD=lm_head
    (read when the model's first graph is built)."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel

    monkeypatch.setenv("DG_LM_HEAD", lm_head)
    with DiffusionModel(path, n_threads=2, n_ctx=128) as m:
        path_used = native.lib()._lib.dg_lm_head_path(m._model).decode()
        m.prefill(PROMPT)
        canvas = _canvas(20, m.vocab_size)
        logits = m.decode_canvas(canvas)
        [step] = m.denoise_step(canvas[None], 0.6, np.full((1, 16), 0.5), top_k=4, return_values=True)
    return path_used, logits, step


@pytest.mark.parametrize("weights", ["q8_0", "q5_0 lm head"])
def test_repacked_lm_head_gives_ggml_matmul_logits(tmp_path, monkeypatch, weights):
    """A Q8_0 or Q5_0 LM head on our GEMM (this CPU's kernel, and the VNNI layout emulated) against
    ggml's matmul: the same quantized products, float summation order aside."""
    path = _tiny_quantized(tmp_path, weights, seed=5)
    used, reference, _ = _logits_with_lm_head(path, "ggml", monkeypatch)
    assert used == "ggml"
    for lm_head in ("auto", "emulated"):
        used, logits, step = _logits_with_lm_head(path, lm_head, monkeypatch)
        if lm_head == "auto" and used == "ggml":
            continue  # no kernel for this CPU: nothing else to compare
        assert used != "ggml"
        assert float(np.max(np.abs(logits - reference))) < 1e-3
        # the graph step reads the same logits
        assert step.argmax.tolist() == np.argmax(logits, axis=1).tolist()


def test_lm_head_path_stays_ggml_for_other_types(tiny_gguf, monkeypatch):
    """F32 output weights (the tiny test model): ggml's matmul, whatever DG_LM_HEAD says."""
    used, _, _ = _logits_with_lm_head(tiny_gguf, "emulated", monkeypatch)
    assert used == "ggml"


# ---- the decoder's other dense Q8_0 and Q5_0 weights on the same GEMM ----------------------------


class _NodeCapture:
    """llama.cpp's per-node eval callback keeping the F32 values of the named graph nodes: the last
    evaluation of each in `values`, every evaluation in graph order in `order`."""

    def __init__(self, names: set[str]):
        import ctypes

        from dgcli.runtime import native

        base = ctypes.CDLL(native.loaded_library("ggml-base", "ggml_get_name"))
        for fn, restype in (("ggml_get_name", ctypes.c_char_p), ("ggml_get_data", ctypes.c_void_p),
                            ("ggml_nbytes", ctypes.c_size_t)):
            getattr(base, fn).restype, getattr(base, fn).argtypes = restype, [ctypes.c_void_p]
        self.values: dict[str, np.ndarray] = {}
        self.order: list[tuple[str, np.ndarray]] = []

        def on_node(tensor, ask, _user_data):
            name = base.ggml_get_name(tensor).decode()
            if ask:
                return name in names
            data = ctypes.string_at(base.ggml_get_data(tensor), base.ggml_nbytes(tensor))
            self.values[name] = np.frombuffer(data, dtype=np.float32).copy()
            self.order.append((name, self.values[name]))
            return True

        self.callback = (ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(on_node), None)


# layer 0's projections and the self-conditioning MLP's: their inputs are the same on both paths
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("weight_type", sorted(WEIGHT_TYPES))
@pytest.mark.parametrize("n_in, n_out, n_expert, n_used, n_tokens, per_slot, nth", [
    (704, 2816, 16, 8, 48, True, 2),    # the real down projection's widths, fewer experts
    (2816, 1408, 16, 8, 24, False, 3),  # the real gate+up's
    (64, 37, 5, 2, 9, True, 1),         # a partial last row group
    (96, 100, 6, 3, 7, False, 4),       # more threads than some experts have groups
    (64, 16, 32, 8, 3, True, 5),        # most experts unused
])
def test_expert_gemm_kernel_agrees_with_a_double_precision_sum(kernel, weight_type, n_in, n_out, n_expert, n_used,
                                                               n_tokens, per_slot, nth, monkeypatch):
    """The experts' GEMM (each row group packed on the fly, vectorized on AVX2) against a float64 sum of
    the same quantized activations and the experts as ggml's dequantizer decodes them, on random routing
    with uneven shares, the work split as `nth` threads split it: an output left unwritten by the split
    is NaN and fails; float32 rounding is all that may differ."""
    import ctypes

    from dgcli.runtime import native

    avx2_tiles(kernel, monkeypatch)
    err = ctypes.c_double()
    rc = native.lib()._lib.dg_experts_selftest(KERNELS[kernel], WEIGHT_TYPES[weight_type], n_in, n_out, n_expert,
                                               n_used, n_tokens, per_slot, nth, 13, ctypes.byref(err))
    if rc == 1:
        pytest.skip(f"this CPU lacks the {kernel} kernel's instructions")
    assert rc == 0
    assert err.value < 1e-5


@pytest.mark.parametrize("n_in, n_out, n_expert, n_used, n_tokens, per_slot, nth", [
    (2816, 1408, 16, 8, 24, False, 3),  # the real gate+up's widths, fewer experts
    (256, 37, 5, 2, 9, True, 1),        # one super-block, a partial last row group (packed by scalar code)
    (512, 100, 6, 3, 7, False, 4),      # more threads than some experts have groups
    (256, 16, 32, 8, 3, True, 5),       # most experts unused
])
@pytest.mark.parametrize("weight_type", ["q4_K", "q6_K"])
@pytest.mark.parametrize("tiles", ["avx2", "avx-vnni"])
def test_k_quant_expert_gemm_agrees_with_a_double_precision_sum(tiles, weight_type, n_in, n_out, n_expert, n_used,
                                                                 n_tokens, per_slot, nth, monkeypatch):
    """Q4_K and Q6_K experts (Q4_K_M files' gate+up; their LM head and some down projections) on their
    AVX2 tiles (vpmaddubsw, or AVX-VNNI's vpdpbusd): random super-blocks (Q4_K: 6-bit scales and mins, both fp16 factors; Q6_K: 6-bit quants,
    int8 scales of the whole range, the fp16 factor last) against a float64 sum of the same
    Q8_K-quantized activations and the weights as ggml's dequantizer decodes them (Q4_K's offsets, Q6_K's
    -32, included); split as `nth` threads split it."""
    import ctypes

    from dgcli.runtime import native

    avx2_tiles(tiles, monkeypatch)
    err = ctypes.c_double()
    rc = native.lib()._lib.dg_experts_selftest(KERNELS["avx2"], K_QUANT_TYPES[weight_type], n_in, n_out, n_expert,
                                               n_used, n_tokens, per_slot, nth, 13, ctypes.byref(err))
    if rc == 1:
        pytest.skip("this CPU lacks AVX2, the only K-quant tiles")
    assert rc == 0
    assert err.value < 1e-5


@pytest.mark.parametrize("n_in, n_out, n_expert, n_used, n_tokens, per_slot, nth, stream", [
    (2816, 1408, 1, 1, 256, False, 2, "0"),  # a dense canvas product at the real width (whole tiles of 16 columns)
    (2816, 1408, 16, 8, 24, False, 3, "0"),  # experts of uneven token counts, most tiles partly zero columns
    (256, 37, 5, 2, 9, True, 1, "0"),        # one super-block, a partial last row group (packed by scalar code)
    (512, 100, 1, 1, 17, False, 4, "0"),     # one column past a whole tile
    (512, 96, 1, 1, 40, False, 2, "1"),      # each group's results streamed into the result's rows (AMX's route)
    (256, 64, 6, 3, 11, True, 2, "1"),       # the same into rows of (token, slot) pairs
])
@pytest.mark.parametrize("weight_type", ["q4_K", "q6_K"])
@pytest.mark.parametrize("amx", ["1", "0"], ids=["amx", "span-tiles"])
def test_vnni_k_quants_packed_on_the_fly_agree_with_a_double_precision_sum(weight_type, n_in, n_out, n_expert, n_used,
                                                                           n_tokens, per_slot, nth, stream, amx,
                                                                           monkeypatch):
    """Q4_K and Q6_K packed on the fly for the VNNI family (the route its dense K-quant weights take): on
    AMX's tiles where AMX runs, else each group repacked for the repacked experts' span tiles (DG_AMX=0
    forces that route on an AMX CPU); against the same float64 sum as AVX2's tiles, split as `nth` threads
    split it. DG_STREAM_RESULTS=1: AMX's results written with streaming stores at any size."""
    import ctypes

    from dgcli.runtime import native

    lib = native.lib()._lib
    if amx == "1" and not lib.dg_amx_in_use():
        pytest.skip("this CPU has no AMX-INT8 (or Linux does not grant its tile state)")
    monkeypatch.setenv("DG_AMX", amx)
    monkeypatch.setenv("DG_STREAM_RESULTS", stream)
    err = ctypes.c_double()
    rc = lib.dg_experts_selftest(KERNELS["avx512-vnni"], K_QUANT_TYPES[weight_type], n_in, n_out, n_expert, n_used,
                                 n_tokens, per_slot, nth, 17, ctypes.byref(err))
    if rc == 1:
        pytest.skip("this CPU lacks AVX-512 VNNI")
    assert rc == 0
    assert err.value < 1e-5


@pytest.mark.parametrize("weight_type", ["q4_K", "q6_K"])
def test_k_quant_experts_have_no_tile_but_avx2s(weight_type):
    """The emulated (VNNI) layout has no Q4_K or Q6_K tile: the self-test says the kernel is missing, and
    a width that is not whole super-blocks is refused."""
    import ctypes

    from dgcli.runtime import native

    err = ctypes.c_double()
    selftest = native.lib()._lib.dg_experts_selftest
    type_id = K_QUANT_TYPES[weight_type]
    assert selftest(KERNELS["emulated"], type_id, 256, 16, 4, 2, 4, False, 1, 1, ctypes.byref(err)) == 1
    assert selftest(KERNELS["avx2"], type_id, 288, 16, 4, 2, 4, False, 1, 1, ctypes.byref(err)) == -1


_EXPERT_NODES = {"ffn_moe_gate_up-0", "ffn_moe_down_scaled-0"}


def _run_with_expert_gemm(path, experts: str, threads: int, exact: bool, monkeypatch):
    """A model loaded with DG_EXPERT_GEMM=experts: how many expert tensors run on our tiles, the
    prefill's and a decode's logits, a graph step, and layer 0's expert products of that decode."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel

    monkeypatch.setenv("DG_EXPERT_GEMM", experts)
    capture = _NodeCapture(_EXPERT_NODES)
    with DiffusionModel(path, n_threads=threads, n_ctx=128, exact=exact, eval_callback=capture.callback) as m:
        count = native.lib()._lib.dg_expert_gemm_count(m._model)
        prefill = m.prefill(PROMPT, return_logits=True)
        canvas = _canvas(20, m.vocab_size)
        [step] = m.denoise_step(canvas[None], 0.6, np.full((1, 16), 0.5), top_k=4, return_values=True)
        capture.values.clear()
        logits = m.decode_canvas(canvas)
        return count, m.header.get("diffusion-gemma.block_count"), prefill, logits, step, dict(capture.values)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
@pytest.mark.parametrize("weights", ["q8_0", "q5_0"])
def test_experts_on_our_tiles_give_ggml_results(tmp_path, monkeypatch, weights, exact):
    """A Q8_0 or Q5_0 model's MoE experts (gate+up and down of every layer) on our tiles, with 1 and 2
    threads and the VNNI layout emulated, against ggml's MUL_MAT_ID (exact mode: the same graph
    otherwise; fast mode: build_moe_ffn's): layer 0's expert products (same inputs on both paths)
    within float rounding; the logits within 1e-3 in exact mode. Not in fast mode: there the dense
    FFN's GELU reads an F16 table, so a last-bit difference can step a value by 1e-3 (here: 1e-7 into
    layer 4's dense FFN, 1e-3 out), which later layers amplify; the prefill's last row is compared."""
    path = _tiny_quantized(tmp_path, weights, seed=8)
    n_ref, n_layer, ref_prefill, ref_logits, _, ref_nodes = _run_with_expert_gemm(path, "ggml", 2, exact, monkeypatch)
    assert n_ref == 0 and set(ref_nodes) == _EXPERT_NODES
    assert float(np.std(ref_logits)) > 1.0  # real logits, not a degenerate output
    for experts, threads in (("auto", 1), ("auto", 2), ("emulated", 2)):
        count, _, prefill, logits, step, nodes = _run_with_expert_gemm(path, experts, threads, exact, monkeypatch)
        if experts == "auto" and count == 0:
            continue  # no kernel for this CPU: nothing else to compare
        assert count == 2 * n_layer
        for name in sorted(_EXPERT_NODES):
            scale = float(np.max(np.abs(ref_nodes[name])))
            assert scale > 0 and float(np.max(np.abs(nodes[name] - ref_nodes[name]))) <= 1e-5 * scale, name
        assert float(np.max(np.abs(prefill - ref_prefill))) < 1e-3
        if exact:
            assert float(np.max(np.abs(logits - ref_logits))) < 1e-3
        assert step.argmax.tolist() == np.argmax(logits, axis=1).tolist()


def test_experts_of_other_types_stay_on_ggml(tiny_gguf, monkeypatch):
    """F32 experts (the tiny test model): ggml's MUL_MAT_ID, whatever DG_EXPERT_GEMM says."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel

    monkeypatch.setenv("DG_EXPERT_GEMM", "emulated")
    with DiffusionModel(tiny_gguf, n_threads=2, n_ctx=128) as m:
        assert native.lib()._lib.dg_expert_gemm_count(m._model) == 0


_PROJECTIONS = {"Qcur-0", "Kcur-0", "Vcur-0", "attn_output-0", "ffn_up-0", "ffn_gate-0", "ffn_down-0",
                "sc_ffn_up", "sc_ffn_gate", "sc_signal"}  # sc_signal: the MLP's down projection


def _run_with_dense_gemm(path, dense: str, monkeypatch):
    """A model loaded with DG_DENSE_GEMM=dense (read when its first graph is built): the number of dense
    weights repacked, the prefill's and a plain decode's logits, a graph step, and the projections of a
    self-conditioned decode."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel

    monkeypatch.setenv("DG_DENSE_GEMM", dense)
    capture = _NodeCapture(_PROJECTIONS)
    with DiffusionModel(path, n_threads=2, n_ctx=128, eval_callback=capture.callback) as m:
        repacked = native.lib()._lib.dg_dense_repacked_count(m._model)
        prefill = m.prefill(PROMPT, return_logits=True)
        canvas = _canvas(20, m.vocab_size)
        logits = m.decode_canvas(canvas)
        [step] = m.denoise_step(canvas[None], 0.6, np.full((1, 16), 0.5), top_k=4, return_values=True)
        sc_ids = np.stack([np.random.default_rng(i).choice(m.vocab_size, 4, replace=False) for i in range(len(canvas))])
        capture.values.clear()
        m.decode_canvas(canvas, sc_topk=(sc_ids.astype(np.int32), np.full((len(canvas), 4), 0.25, dtype=np.float32)))
    return repacked, prefill, logits, step, dict(capture.values)


def _dense_repackable_weights(path) -> int:
    """The dense matrices `dg info`'s memory estimate counts as repacked (all but the LM head): what the
    native side repacks must be what the estimate counts."""
    import gguf

    from dgcli.modelfile.info import _REPACKED_WEIGHTS, REPACKED_TYPES

    return sum(1 for t in gguf.GGUFReader(path).tensors
               if t.name != "output.weight" and _REPACKED_WEIGHTS.fullmatch(t.name)
               and t.tensor_type.name in REPACKED_TYPES)


@pytest.mark.parametrize("weights", ["q8_0", "q5_0"])
def test_repacked_dense_weights_give_ggml_matmul_results(tmp_path, monkeypatch, weights):
    """A Q8_0 or Q5_0 model's attention, dense FFN and self-conditioning MLP on our GEMM (this CPU's
    kernel, and the VNNI layout emulated) against ggml's matmul: the same quantized products, float
    summation order aside (Q5_0's quants minus 16 are the int8 quants, so its repack is lossless too). Each projection of a self-conditioned decode is compared where its input is the same on
    both paths (layer 0, the self-conditioning MLP): this random model's global attention turns a
    last-bit difference in Q (2e-7) into 6e-3 one layer later and 0.2 at the last, so its final
    self-conditioned logits are no test of the GEMM. The prefill's and a plain decode's logits are."""
    path = _tiny_quantized(tmp_path, weights, seed=6)
    n_ref, ref_prefill, ref_logits, _, ref_nodes = _run_with_dense_gemm(path, "ggml", monkeypatch)
    assert n_ref == 0 and set(ref_nodes) == _PROJECTIONS
    assert float(np.std(ref_logits)) > 1.0  # real logits, not a degenerate output
    for dense in ("auto", "emulated"):
        n, prefill, logits, step, nodes = _run_with_dense_gemm(path, dense, monkeypatch)
        if dense == "auto" and n == 0:
            continue  # no kernel for this CPU: nothing else to compare
        assert n == _dense_repackable_weights(path) > 0
        assert float(np.max(np.abs(prefill - ref_prefill))) < 1e-3
        assert float(np.max(np.abs(logits - ref_logits))) < 1e-3
        assert step.argmax.tolist() == np.argmax(logits, axis=1).tolist()
        for name in sorted(_PROJECTIONS):
            scale = float(np.max(np.abs(ref_nodes[name])))
            assert scale > 0 and float(np.max(np.abs(nodes[name] - ref_nodes[name]))) <= 1e-5 * scale, name


def _q8_k_dequantized(x: np.ndarray) -> np.ndarray:
    """x [rows, n] as ggml's quantize_row_q8_K_ref quantizes it (per 256: the value of largest
    magnitude, the first of equals, maps to -127; round half to even in float32), decoded."""
    blocks = x.astype(np.float32).reshape(-1, 256)
    peak = blocks[np.arange(len(blocks)), np.argmax(np.abs(blocks), axis=1)]
    iscale = np.divide(np.float32(-127.0), peak, out=np.zeros_like(peak), where=peak != 0).astype(np.float32)
    quants = np.minimum(127.0, np.rint(blocks * iscale[:, None]))
    scale = np.divide(np.float32(1.0), iscale, out=np.zeros_like(iscale), where=iscale != 0).astype(np.float32)
    return (quants * scale[:, None]).reshape(x.shape)


@pytest.mark.parametrize("family", ["avx2", "avx-vnni", "avx512-vnni"])
def test_k_quant_dense_weights_on_our_tiles_give_ggml_products(tmp_path, monkeypatch, family):
    """A Q4_K_M file's dense Q4_K and Q6_K weights (attention, dense FFN, self-conditioning MLP, and the
    Q6_K LM head) on the experts' K-quant tiles as one expert, kept out of the repack buffers for them:
    AVX2's tiles (vpmaddubsw, or AVX-VNNI's vpdpbusd), or the VNNI family's (AMX's tiles where the CPU has them, else the span tiles of the
    repacked experts, each group repacked on the fly).
    Each such product of a self-conditioned canvas decode against float64 over what ggml multiplies: the weights as its
    dequantizer decodes them and the node's own input quantized as its Q8_K (so a last-bit difference
    upstream, which a requantization can turn into 1e-3, cannot hide or fake an error). Where the
    inputs are the same on both paths (layer 0's Q, K, V, the self-conditioning MLP's gate and up),
    also against ggml's repacked GEMM (DG_DENSE_GEMM=ggml) run for run; a one-token decode keeps
    ggml's matmul."""
    import gguf

    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel

    family = avx2_tiles(family, monkeypatch)  # avx-vnni: the AVX2 family on AVX-VNNI's tiles
    path = small_q4_k_m_gguf(tmp_path / "q4_k_m.gguf", seed=5)
    reader = gguf.GGUFReader(path)
    k_quants = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K)
    weights = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors
               if t.tensor_type in k_quants and len(t.shape) == 2}
    # the graph's name for each projection -> its weight
    node_weight = {"Qcur-0": "blk.0.attn_q.weight", "Kcur-0": "blk.0.attn_k.weight", "Vcur-0": "blk.0.attn_v.weight",
                   "attn_output-1": "blk.1.attn_output.weight", "ffn_gate-0": "blk.0.ffn_gate.weight",
                   "ffn_up-0": "blk.0.ffn_up.weight", "ffn_down-0": "blk.0.ffn_down.weight",
                   "ffn_down-1": "blk.1.ffn_down.weight", "lm_head": "token_embd.weight",
                   "sc_ffn_gate": "self_cond_gate.weight", "sc_ffn_up": "self_cond_up.weight",
                   "sc_signal": "self_cond_down.weight"}
    node_weight = {node: w for node, w in node_weight.items() if w in weights}
    assert len(node_weight) >= 10
    # the Q6_K ones: the tied LM head and a more-bits layer's down projection
    assert {n for n, w in node_weight.items() if w in ("token_embd.weight", "blk.1.ffn_down.weight")} == \
        {"lm_head", "ffn_down-1"}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.Q6_K for t in reader.tensors
               if t.name in ("token_embd.weight", "blk.1.ffn_down.weight"))
    monkeypatch.setenv("DG_EXPERT_GEMM", "ggml")  # the experts' path the same in both runs

    def run(dense: str):
        monkeypatch.setenv("DG_DENSE_GEMM", dense)
        capture = _NodeCapture(set(node_weight) | {"tiled_in"})
        with DiffusionModel(path, n_threads=2, n_ctx=128, eval_callback=capture.callback) as m:
            count = native.lib()._lib.dg_dense_tiled_count(m._model)
            head_path = native.lib()._lib.dg_lm_head_path(m._model).decode()
            m.prefill(PROMPT)
            canvas = _canvas(20, m.vocab_size)
            sc_ids = np.stack([np.random.default_rng(i).choice(m.vocab_size, 4, replace=False) for i in range(16)])
            capture.order.clear()
            m.decode_canvas(canvas, sc_topk=(sc_ids.astype(np.int32), np.full((16, 4), 0.25, dtype=np.float32)))
        return count, head_path, capture.order  # in graph order: each product's input precedes it

    count, head_path, seen = run(family)  # forced: an AVX-512 VNNI CPU's automatic choice is its own family
    if count == 0:
        pytest.skip(f"this CPU has no {family} K-quant tiles for dense weights (it lacks {family})")
    assert count == len(weights)  # the embedding's count is the LM head's
    amx = native.lib()._lib.dg_amx_in_use()
    assert head_path == ("avx2" if family == "avx2" else "AMX" if amx else "avx512-vnni") + " K-quant tile"
    checked = set()
    for k, (name, out) in enumerate(seen):
        if name not in node_weight:
            continue
        inputs = [v for n, v in seen[:k] if n == "tiled_in"]
        assert inputs, f"{name}: no tiled input before it (not on the tile)"
        w = weights[node_weight[name]]
        x = _q8_k_dequantized(inputs[-1].reshape(-1, w.shape[1])).astype(np.float64)
        expected = x @ w.T
        got = out.reshape(expected.shape)
        assert float(np.max(np.abs(got - expected))) <= 1e-5 * float(np.max(np.abs(expected))), name
        checked.add(name)
    assert checked == set(node_weight)

    _, _, ref_seen = run("ggml")
    ours, ref = dict(seen), dict(ref_seen)
    assert "tiled_in" not in ref
    for name in ("Qcur-0", "Kcur-0", "Vcur-0", "sc_ffn_gate", "sc_ffn_up"):
        if name in node_weight:
            scale = float(np.max(np.abs(ref[name])))
            assert float(np.max(np.abs(ours[name] - ref[name]))) <= 1e-5 * scale, name

    # which op runs: the tile for a canvas, ggml's MUL_MAT for one token
    monkeypatch.setenv("DG_DENSE_GEMM", family)
    monkeypatch.setenv("DG_LM_HEAD", family)
    for node in ("Qcur-0", "ffn_down-1", "lm_head"):
        canvas_ops, token_ops = _ops_for_a_canvas_and_one_token(
            path, 1, lambda n: n.name == node and n.op in ("CUSTOM", "MUL_MAT"))
        assert canvas_ops == {"CUSTOM"} and token_ops == {"MUL_MAT"}, node


def test_dense_weights_of_other_types_stay_on_ggml(tiny_gguf, monkeypatch):
    """F32 weights (the tiny test model): ggml's matmul, whatever DG_DENSE_GEMM says."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel

    monkeypatch.setenv("DG_DENSE_GEMM", "emulated")
    with DiffusionModel(tiny_gguf, n_threads=2, n_ctx=128) as m:
        assert native.lib()._lib.dg_dense_repacked_count(m._model) == 0


def _ops_for_a_canvas_and_one_token(path, threads: int, picked) -> tuple[set[str], set[str]]:
    """The ops of the graph nodes `picked(node)` selects, in a 16-token canvas decode and in a one-token
    prefill after a prompt: which path a batch of that size takes."""
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.profile import NodeProfiler

    profiler = NodeProfiler()
    try:
        with DiffusionModel(path, n_threads=threads, n_ctx=128, eval_callback=profiler.eval_callback) as m:
            m.prefill(PROMPT)

            def ops(run) -> set[str]:
                profiler.enabled = True
                run()
                profiler.enabled = False
                return {n.op for n in profiler.take() if picked(n)}

            return ops(lambda: m.decode_canvas(_canvas(20, m.vocab_size))), ops(lambda: m.prefill([20], return_logits=True))
    finally:
        profiler.close()


def test_cpu_contexts_run_attention_as_matmuls_without_flash_attention(tiny_gguf, monkeypatch):
    """Without a GPU (dgcli.runtime.model.flash_attention_wanted) a canvas's and a token's attention run
    as the scores' and their product with V's matmuls, not ggml's row-at-a-time FLASH_ATTN_EXT, which
    DG_FLASH_ATTN=1 brings back; the canvas's logits agree to the F16 cache's rounding (ggml's CPU flash
    attention also sums V in F16, the matmuls in F32: on the tiny model 0.05 from exact mode's logits against
    0.09, at a largest logit of 16)."""
    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel

    if native.gpu_devices():
        pytest.skip("a GPU is in use here: llama.cpp keeps its flash attention")
    attention = lambda n: n.op == "FLASH_ATTN_EXT" or (n.op == "MUL_MAT" and n.name.startswith("kq"))  # noqa: E731
    logits = {}
    for forced, op in (("", "MUL_MAT"), ("1", "FLASH_ATTN_EXT")):
        monkeypatch.setenv("DG_FLASH_ATTN", forced)
        assert _ops_for_a_canvas_and_one_token(tiny_gguf, 1, attention) == ({op}, {op})
        with DiffusionModel(tiny_gguf, n_threads=1, n_ctx=128) as m:
            m.prefill(PROMPT)
            logits[op] = m.decode_canvas(_canvas(20, m.vocab_size))
    scale = float(np.max(np.abs(logits["FLASH_ATTN_EXT"])))
    assert float(np.std(logits["MUL_MAT"])) > 0.1
    assert float(np.max(np.abs(logits["MUL_MAT"] - logits["FLASH_ATTN_EXT"]))) < 1e-2 * scale


F16_FAMILIES = {"avx512": 512, "avx2": 256}  # dg_f16_gemm_runs' answer for each


@pytest.mark.parametrize("m, n, k, heads, heads_kv, permuted, nth", [
    (320, 256, 256, 4, 2, True, 2),   # scores of a canvas: permuted queries, grouped key heads
    (256, 64, 512, 2, 2, False, 1),   # values x probabilities, contiguous
    (37, 17, 41, 3, 1, False, 3),     # partial panels, tiles and k steps
    (100, 20, 1100, 1, 1, True, 2),   # k in three chunks, the later ones added to the first
    (40, 600, 70, 1, 1, False, 5),    # column blocks (more than 256 columns, more threads than panels)
])
@pytest.mark.parametrize("family", sorted(F16_FAMILIES))
def test_f16_matmul_agrees_with_a_double_precision_sum(m, n, k, heads, heads_kv, permuted, nth, family, monkeypatch):
    """ggml-cpu's F16 x F32 MUL_MAT (the attention's products without flash attention) through a CPU graph,
    on each family of dg's kernel (DG_F16_GEMM=avx512 / avx2): the F32 operand is used as it is, so the
    result is within float32 rounding of a float64 sum; ggml's own (DG_F16_GEMM=0) rounds that operand to
    F16 first, 1e-4 off, which tells the two apart."""
    import ctypes

    from dgcli.runtime import native

    lib = native.lib()._lib

    def error() -> float:
        err = ctypes.c_double()
        assert lib.dg_f16_matmul_selftest(m, n, k, heads, heads_kv, permuted, nth, 23, ctypes.byref(err)) == 0
        return err.value

    monkeypatch.setenv("DG_F16_GEMM", "0")
    assert lib.dg_f16_gemm_runs(m, n, k) == 0
    assert 1e-5 < error() < 1e-3
    monkeypatch.setenv("DG_F16_GEMM", family)
    if lib.dg_f16_gemm_runs(m, n, k) == 0:
        pytest.skip(f"this CPU lacks the {family} kernel's instructions: ggml's runs (checked above)")
    assert lib.dg_f16_gemm_runs(m, n, k) == F16_FAMILIES[family]
    assert error() < 2e-6


def test_f16_matmul_follows_the_cpu_kernel_family(monkeypatch):
    """Unset, the widest family this CPU runs; DG_CPU_KERNELS=avx2 the AVX2 one (so that one AVX-512
    machine measures both), =ggml ggml's own; a one-token decode's products (one column) and small
    batches keep ggml's vector dot products."""
    from dgcli.runtime import native

    lib = native.lib()._lib
    monkeypatch.delenv("DG_F16_GEMM", raising=False)
    monkeypatch.delenv("DG_CPU_KERNELS", raising=False)
    widest = lib.dg_f16_gemm_runs(512, 256, 256)
    assert widest in (0, 256, 512)
    if widest == 0:
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA and F16C: ggml's kernel throughout")
    assert lib.dg_f16_gemm_runs(512, 1, 256) == 0
    assert lib.dg_f16_gemm_runs(512, 15, 256) == 0
    monkeypatch.setenv("DG_CPU_KERNELS", "avx2")
    assert lib.dg_f16_gemm_runs(512, 256, 256) == 256
    monkeypatch.setenv("DG_CPU_KERNELS", "ggml")
    assert lib.dg_f16_gemm_runs(512, 256, 256) == 0


def test_experts_take_our_tiles_only_for_batches_that_pay_for_the_packing(tmp_path, monkeypatch):
    """Packing a row group costs about three columns of tile work: a canvas (16 tokens here, 4 experts
    top-2: 8 per expert) runs the experts on our tiles, a one-token decode (half a token per expert)
    keeps ggml's MUL_MAT_ID, whose per-row dot products read each weight once (on the real model
    the tiles took 1.7x ggml's time for one token)."""
    monkeypatch.setenv("DG_EXPERT_GEMM", "emulated")  # the same rule for every kernel, on any CPU
    path = _tiny_quantized(tmp_path, "q8_0", seed=4)
    canvas_ops, token_ops = _ops_for_a_canvas_and_one_token(
        path, 2, lambda n: n.op in ("CUSTOM", "MUL_MAT_ID")
        and n.name.startswith(("ffn_moe_gate_up", "experts_gemm", "ffn_moe_down")))
    assert canvas_ops == {"CUSTOM"} and token_ops == {"MUL_MAT_ID"}
