"""Helpers shared by tests/test_native_*.py: the `native` marker (skipped when the build is missing), a GGUF
rewriter that makes malformed copies of a good file, and a small file with a Q4_K_M file's types."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from dgcli.runtime import native

NATIVE_OK, NATIVE_REASON = native.available()
# A test that loads the patched llama.cpp is marked `native`; conftest.py skips it where it is not built.
requires_native = pytest.mark.native

# Layers the parity and replay tests offload: 0 here; benchmarks/gpu_check.py sets -1 (all) on a GPU machine.
GPU_LAYERS = int(os.environ.get("DG_TEST_GPU_LAYERS") or 0)

# (max, mean) |logit difference| allowed with layers on a GPU: why, in tests/test_gpu_parity.py
GPU_LOGIT_TOL = (1.5, 5e-2)


def avx2_tiles(family: str, monkeypatch) -> str:
    """The AVX2 family's tiles a test asks for: "avx-vnni" (vpdpbusd ymm; skipped where the CPU lacks
    AVX-VNNI) or "avx2" (vpmaddubsw, DG_AVX_VNNI=0, so that a CPU with AVX-VNNI tests them too), set in the
    environment, which a GEMM reads when it is made. Returns the native family's name ("avx2" for both);
    other families pass through."""
    if family == "avx-vnni":
        monkeypatch.delenv("DG_AVX_VNNI", raising=False)
        if not native.lib()._lib.dg_avx_vnni_in_use():
            pytest.skip("this CPU lacks AVX-VNNI (the AVX2 family's vpdpbusd tiles)")
        return "avx2"
    if family == "avx2":
        monkeypatch.setenv("DG_AVX_VNNI", "0")
    return family


def _gpu_reason() -> str:
    if not NATIVE_OK:
        return f"native library unavailable: {NATIVE_REASON}"
    if not native.gpu_devices():
        return "no GPU llama.cpp can offload to (a CPU build, or no device); benchmarks/gpu_check.py runs these on one"
    return ""


GPU_REASON = _gpu_reason()
requires_gpu = pytest.mark.skipif(bool(GPU_REASON), reason=GPU_REASON)


def rewrite_gguf(src: Path, dst: Path, *, drop_keys: tuple[str, ...] = (), set_keys: dict[str, tuple[Any, Any]] | None = None,
                 drop_tensors: tuple[str, ...] = (), tensor_edit: Callable[[str, np.ndarray], np.ndarray] | None = None) -> Path:
    """Copy `src` to `dst` with keys dropped / replaced ({key: (value, GGUFValueType)}, or
    (values, ARRAY, element GGUFValueType) for an array) and tensors dropped or edited (F32/F16
    tensors only for edits)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    set_keys = dict(set_keys or {})
    for name, fld in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture",) or name in drop_keys:
            continue
        if name in set_keys:
            continue
        vtype = gguf.GGUFValueType(fld.types[0])
        sub = gguf.GGUFValueType(fld.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, fld.contents(), vtype, sub_type=sub)
    for name, (value, vtype, *sub) in set_keys.items():
        writer.add_key_value(name, value, vtype, sub_type=sub[0] if sub else None)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        data = np.array(t.data)
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if tensor_edit is not None and qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = tensor_edit(t.name, data)
            writer.add_tensor(t.name, data)
        else:
            # the reader's array shape: elements for float types, bytes per row for quantized ones
            writer.add_tensor(t.name, data, raw_shape=list(data.shape), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def split_gguf(src: Path, out_dir: Path, prefix: str, n_parts: int) -> list[Path]:
    """`src` split as llama-gguf-split splits a model: PREFIX-0000i-of-0000N.gguf, the first part with
    every key, each part with `split.no`, `split.count`, `split.tensors.count` and its share of the tensors."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    tensors = list(reader.tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_parts):
        path = out_dir / f"{prefix}-{i + 1:05d}-of-{n_parts:05d}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        if i == 0:
            for name, fld in reader.fields.items():
                if name.startswith("GGUF.") or name == "general.architecture":
                    continue
                vtype = gguf.GGUFValueType(fld.types[0])
                sub = gguf.GGUFValueType(fld.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(name, fld.contents(), vtype, sub_type=sub)
        writer.add_key_value("split.no", i, gguf.GGUFValueType.UINT16)
        writer.add_key_value("split.count", n_parts, gguf.GGUFValueType.UINT16)
        writer.add_key_value("split.tensors.count", len(tensors), gguf.GGUFValueType.INT32)
        for t in tensors[i::n_parts]:
            data = np.array(t.data)
            writer.add_tensor(t.name, data, raw_shape=list(data.shape), raw_dtype=gguf.GGMLQuantizationType(t.tensor_type))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths


def small_q4_k_m_gguf(path: Path, seed: int = 0) -> Path:
    """A small random diffusion-gemma file with a Q4_K_M file's types (`dgcli.testing.tiny.q4_k_m_type`): hidden
    and expert widths of one 256-wide super-block, so its experts' gate+up are Q4_K and their down
    projections Q4_K (layer 0) or Q6_K (layer 1); 8 experts, top-2, a 16-token canvas."""
    from dgcli.testing.tiny import write_synthetic_gguf

    return write_synthetic_gguf(path, n_layer=2, vocab_size=512, hidden=256, outtype="q4_k_m", seed=seed,
                                intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                global_head_dim=128, num_global_key_value_heads=1, sliding_window=64, num_experts=8,
                                top_k_experts=2, moe_intermediate_size=256, canvas_length=16)


def small_gguf(path: Path, vocab_size: int) -> Path:
    """A random two-layer DiffusionGemma at small widths (hidden 64, 4 experts top-2, 16-token canvas,
    F32) with the given vocabulary: the shape the self-conditioning and step tests vary the vocabulary on."""
    from dgcli.testing.tiny import write_synthetic_gguf

    return write_synthetic_gguf(path, n_layer=2, vocab_size=vocab_size, hidden=64, outtype="f32",
                                intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                global_head_dim=32, num_global_key_value_heads=1, sliding_window=8, num_experts=4,
                                top_k_experts=2, moe_intermediate_size=32, canvas_length=16)
