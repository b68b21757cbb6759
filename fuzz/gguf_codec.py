"""A raw GGUF reader/writer for the fuzz harness: every field with its byte offset, and a writer
that encodes whatever it is given (wrong types, impossible counts) without checking anything.

Deliberately independent of dgcli, so the same harness measures any version of dg.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
                  U64: "<Q", I64: "<q", F64: "<d"}
INTEGER_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
FLOAT_TYPES = (F32, F64)


@dataclass
class Kv:
    key: str
    vtype: int
    value: Any  # scalar; bytes for STRING; (element type, list) for ARRAY


@dataclass
class TensorInfo:
    name: bytes
    dims: list[int]
    ttype: int
    offset: int


@dataclass
class CountField:
    """A length/count/type field in the header: where a fuzzer can write an impossible value."""

    offset: int
    width: int  # bytes: 4 or 8
    what: str


@dataclass
class Gguf:
    version: int
    kvs: list[Kv]
    tensors: list[TensorInfo]
    data: bytes  # the tensor data section, from its aligned start
    header_end: int = 0  # offset of the end of the tensor infos in the parsed file
    counts: list[CountField] = field(default_factory=list)
    kv_spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (start, end) offsets

    def get(self, key: str) -> Kv | None:
        for kv in self.kvs:
            if kv.key == key:
                return kv
        return None

    def set(self, key: str, vtype: int, value: Any) -> None:
        for kv in self.kvs:
            if kv.key == key:
                kv.vtype, kv.value = vtype, value
                return
        self.kvs.append(Kv(key, vtype, value))

    def remove(self, key: str) -> None:
        self.kvs = [kv for kv in self.kvs if kv.key != key]

    @property
    def alignment(self) -> int:
        kv = self.get("general.alignment")
        return kv.value if kv is not None and kv.vtype in INTEGER_TYPES and kv.value > 0 else 32

    @property
    def architecture(self) -> str:
        kv = self.get("general.architecture")
        return kv.value.decode() if kv is not None and kv.vtype == STRING else ""


class _Cursor:
    def __init__(self, blob: bytes):
        self.blob, self.pos = blob, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.blob, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        n = self.take("<Q")
        out = self.blob[self.pos:self.pos + n]
        self.pos += n
        return out


def parse(blob: bytes) -> Gguf:
    """Parse a well-formed GGUF (the shipped files), recording where each count field sits."""
    c = _Cursor(blob)
    assert blob[:4] == b"GGUF", "not a GGUF"
    c.pos = 4
    version = c.take("<I")
    counts = [CountField(8, 8, "n_tensors"), CountField(16, 8, "n_kv")]
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    g = Gguf(version, [], [], b"", counts=counts)
    for _ in range(n_kv):
        start = c.pos
        counts.append(CountField(c.pos, 8, "key length"))
        key = c.string().decode()
        counts.append(CountField(c.pos, 4, f"type of {key}"))
        vtype = c.take("<I")
        g.kvs.append(Kv(key, vtype, _read_value(c, vtype, key, counts)))
        g.kv_spans[key] = (start, c.pos)
    for _ in range(n_tensors):
        counts.append(CountField(c.pos, 8, "tensor name length"))
        name = c.string()
        counts.append(CountField(c.pos, 4, f"n_dims of {name.decode()}"))
        n_dims = c.take("<I")
        dims = []
        for d in range(n_dims):
            counts.append(CountField(c.pos, 8, f"dim {d} of {name.decode()}"))
            dims.append(c.take("<Q"))
        counts.append(CountField(c.pos, 4, f"type of {name.decode()}"))
        ttype = c.take("<I")
        counts.append(CountField(c.pos, 8, f"offset of {name.decode()}"))
        g.tensors.append(TensorInfo(name, dims, ttype, c.take("<Q")))
    g.header_end = c.pos
    start = -(-c.pos // g.alignment) * g.alignment
    g.data = blob[start:]
    return g


def _read_value(c: _Cursor, vtype: int, key: str, counts: list[CountField]) -> Any:
    if vtype in SCALAR_FORMATS:
        return c.take(SCALAR_FORMATS[vtype])
    if vtype == STRING:
        counts.append(CountField(c.pos, 8, f"string length of {key}"))
        return c.string()
    assert vtype == ARRAY, (key, vtype)
    counts.append(CountField(c.pos, 4, f"element type of {key}"))
    etype = c.take("<I")
    counts.append(CountField(c.pos, 8, f"array length of {key}"))
    n = c.take("<Q")
    if etype == STRING:
        return etype, [c.string() for _ in range(n)]
    return etype, [c.take(SCALAR_FORMATS[etype]) for _ in range(n)]


def encode_value(vtype: int, value: Any) -> bytes:
    if vtype in SCALAR_FORMATS:
        return struct.pack(SCALAR_FORMATS[vtype], value)
    if vtype == STRING:
        data = value if isinstance(value, bytes) else str(value).encode()
        return struct.pack("<Q", len(data)) + data
    if vtype == ARRAY:
        etype, items = value
        out = [struct.pack("<IQ", etype, len(items))]
        out += [encode_value(etype, item) for item in items]
        return b"".join(out)
    raise ValueError(f"cannot encode type {vtype}")


def serialize(g: Gguf) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", g.version, len(g.tensors), len(g.kvs))]
    for kv in g.kvs:
        out.append(encode_value(STRING, kv.key.encode()))
        out.append(struct.pack("<I", kv.vtype))
        out.append(encode_value(kv.vtype, kv.value))
    for t in g.tensors:
        out.append(encode_value(STRING, t.name))
        out.append(struct.pack("<I", len(t.dims)))
        out += [struct.pack("<Q", d) for d in t.dims]
        out.append(struct.pack("<IQ", t.ttype, t.offset))
    head = b"".join(out)
    pad = -len(head) % g.alignment
    return head + b"\0" * pad + g.data
