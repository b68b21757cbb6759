"""Helpers shared by tests/test_native_*.py: the skip when the native build is missing, and a GGUF
rewriter that makes malformed copies of a good file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from dgcli.engine import native

NATIVE_OK, NATIVE_REASON = native.available()
requires_native = pytest.mark.skipif(not NATIVE_OK, reason=f"native library unavailable: {NATIVE_REASON}")


def rewrite_gguf(src: Path, dst: Path, *, drop_keys: tuple[str, ...] = (), set_keys: dict[str, tuple[Any, Any]] | None = None,
                 drop_tensors: tuple[str, ...] = (), tensor_edit: Callable[[str, np.ndarray], np.ndarray] | None = None) -> Path:
    """Copy `src` to `dst` with keys dropped / replaced ({key: (value, GGUFValueType)}) and tensors
    dropped or edited (F32/F16 tensors only for edits)."""
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
    for name, (value, vtype) in set_keys.items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        data = np.array(t.data)
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if tensor_edit is not None and qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = tensor_edit(t.name, data)
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, data, raw_shape=list(reversed([int(x) for x in t.shape])), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
