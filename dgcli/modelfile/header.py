"""The GGUF header, read once: what `dg info`, the CLI's pre-flight checks and the model load use.

    header = read_header("model.gguf")      # parsed on first use, then shared (keyed by the file's identity)
    header.get("diffusion.canvas_length"); header.arch("block_count"); header.tensors; header.n_vocab

The reader walks the file's own bytes (mmap + struct) and never builds what dg does not need:
arrays longer than KEEP_ARRAYS_UP_TO elements are scanned (their length and type kept, not their
values), and a count the file cannot hold is refused before any loop runs. The vocabulary
(`tokenizer.ggml.tokens`) is scanned once for what the load needs to know: its size, the ids of
a few token texts, and whether two entries are the same text (llama.cpp aborts on that).

Every problem becomes a ModelLoadError naming the file and what is wrong.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from dgcli.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# GGUF value types
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
              8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
INTEGER_TYPE_NAMES = frozenset({"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"})
FLOAT_TYPE_NAMES = frozenset({"float32", "float64"})

# per-layer arrays are kept (LLAMA_MAX_LAYERS is 512); vocabularies and merges are only scanned
KEEP_ARRAYS_UP_TO = 4096
# string arrays are walked entry by entry, and the vocabulary's texts are held while scanned: counts past
# these (a few bytes of header can declare them over a sparse file) cost time and memory, not a model
# (Gemma 4: 262144 tokens, about 515k merges)
MAX_VOCAB = 1 << 20
MAX_STRING_ARRAY = 1 << 22
MAX_KEYS = 1 << 16  # a model has some dozens; each costs a dict entry however few bytes it takes
# general.alignment: llama.cpp takes any power of two; more than this is a corrupt value
MAX_ALIGNMENT = 1 << 16
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535  # llama.cpp's gguf reader refuses longer keys

# token texts whose ids the vocabulary scan records: the end of a generation, and Gemma 4's
# thinking-channel markers (control tokens, which detokenizing normally drops; they stay in the text
# so that the CLI can show the thinking dimmed or hide it: dgcli.engine.thinking)
END_TOKEN_TEXTS = ("<eos>", "<turn|>")
VISIBLE_CONTROL_TEXTS = ("<|channel>", "<channel|>")
TOKEN_TEXTS_OF_INTEREST = END_TOKEN_TEXTS + VISIBLE_CONTROL_TEXTS


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the row length) first
    type_id: int
    type_name: str
    offset: int  # from the start of the data section
    n_elements: int
    n_bytes: int


@dataclass
class GgufHeader:
    """What a GGUF says about itself, without its weights."""

    path: Path
    file_size: int
    version: int
    metadata: dict[str, tuple[str, Any]] = field(default_factory=dict)  # key -> (type name, value)
    # arrays: key -> (element type name, length); values are in `metadata` only up to KEEP_ARRAYS_UP_TO
    arrays: dict[str, tuple[str, int]] = field(default_factory=dict)
    tensors: list[TensorEntry] = field(default_factory=list)
    data_offset: int = 0
    token_ids: dict[str, int] = field(default_factory=dict)  # TOKEN_TEXTS_OF_INTEREST found -> first id
    duplicate_token: tuple[bytes, int, int] | None = None  # (text, first id, second id)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata[key][1] if key in self.metadata else default

    def type_of(self, key: str) -> str | None:
        return self.metadata[key][0] if key in self.metadata else None

    @property
    def architecture(self) -> str | None:
        value = self.get("general.architecture")
        return value if isinstance(value, str) else None

    def arch_key(self, name: str) -> str:
        return f"{self.architecture}.{name}"

    def arch(self, name: str, default: Any = None) -> Any:
        """`{architecture}.{name}`, e.g. arch("block_count")."""
        return self.get(self.arch_key(name), default)

    @property
    def n_vocab(self) -> int | None:
        entry = self.arrays.get("tokenizer.ggml.tokens")
        return entry[1] if entry is not None and entry[0] == "string" else None

    def tensor(self, name: str) -> TensorEntry | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None


# -- reading ----------------------------------------------------------------------------------------


class _Cursor:
    """Reads from the mapped file; every read is checked against the file's end first."""

    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise EOFError

    def unpack(self, fmt: str, width: int) -> Any:
        self.need(width)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += width
        return value

    def u32(self) -> int:
        return self.unpack("<I", 4)

    def u64(self) -> int:
        return self.unpack("<Q", 8)

    def raw_string(self) -> bytes:
        n = self.u64()
        self.need(n)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out


class _Malformed(Exception):
    """A reason the header is malformed (becomes a ModelLoadError naming the file)."""


_cache: dict[tuple, GgufHeader] = {}
_cached_parts: dict[tuple, tuple] = {}  # a split model's other parts, as they were when it was parsed
_cache_lock = threading.Lock()


def _parts_identity(header: GgufHeader) -> tuple | None:
    """The other parts of a split model as they are now (None when one cannot be found)."""
    try:
        return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                     for st in (q.stat() for q in split_part_paths(header)))
    except (OSError, ModelLoadError):
        return None


def read_header(path: str | os.PathLike) -> GgufHeader:
    """The parsed header of a GGUF file (ModelLoadError if it cannot be read).

    Parsed once per file: later calls for the same unchanged file (same device, inode, size and
    modification time; for a split model, of every part) return the same object, so `dg info`, the
    pre-flight checks and the model load share one parse.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ModelLoadError(f"model file not found: {p}") from None
    except OSError as err:
        raise ModelLoadError(f"cannot read {p}: {err.strerror or err}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelLoadError(f"not a GGUF file (a directory): {p}")
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(f"not a GGUF file (not a regular file): {p}")
    key = (os.path.realpath(p), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None and (split_count(cached) == 1 or _parts_identity(cached) == _cached_parts.get(key)):
        return cached
    header = _parse_file(p, st.st_size)
    if split_count(header) > 1:
        header = merge_split(header, [_parse_split_part(path) for path in split_part_paths(header)])
    with _cache_lock:
        _cache.clear()  # one file at a time is all dg needs; keeps a long session from growing
        _cached_parts.clear()
        _cache[key] = header
        if split_count(header) > 1:
            _cached_parts[key] = _parts_identity(header)
    return header


# -- models split by llama-gguf-split ------------------------------------------------------------------
# The first part holds the model's keys and `split.count`; every part holds `split.no` (0-based) and
# its own tensors, in a data section of its own. llama.cpp loads the first part and finds the others
# beside it by name: PREFIX-00001-of-00003.gguf, PREFIX-00002-of-00003.gguf, ...
MAX_SPLIT_PARTS = 9999
_SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")


def split_count(header: GgufHeader) -> int:
    """How many files the model is split into (1: not split)."""
    count = header.get("split.count")
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 1 else 1


def split_part_paths(header: GgufHeader) -> list[Path]:
    """The other parts' paths, next to the first (ModelLoadError when the header is not a first part
    named as llama.cpp names one)."""
    count = split_count(header)
    m = _SPLIT_NAME.fullmatch(header.path.name)
    if header.get("split.no") != 0 or count > MAX_SPLIT_PARTS or m is None or int(m[2]) != 1 or int(m[3]) != count:
        raise ModelLoadError(f"{header.path}: a part of a model split in {count} files (split.no "
                             f"{header.get('split.no')!r}); pass the first part, named PREFIX-00001-of-{count:05d}.gguf")
    return [header.path.with_name(f"{m[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]


def _parse_split_part(p: Path) -> GgufHeader:
    try:
        st = p.stat()
    except OSError as err:
        raise ModelLoadError(f"a part of the split model is missing: {p} ({err.strerror or err})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(f"a part of the split model is not a regular file: {p}")
    return _parse_file(p, st.st_size)


def merge_split(first: GgufHeader, others: list[GgufHeader]) -> GgufHeader:
    """The whole model's header from its parts' (the first's keys, every part's tensors, the sum of
    their sizes); ModelLoadError when a part is not the one its place says, or a tensor is in two."""
    count = split_count(first)
    if len(others) != count - 1:
        raise ModelLoadError(f"{first.path}: {len(others) + 1} of the {count} parts of a split model")
    names = {t.name for t in first.tensors}
    tensors = list(first.tensors)
    for no, part in enumerate(others, start=1):
        if part.get("split.no") != no or part.get("split.count") != count:
            raise ModelLoadError(f"{part.path} is not part {no + 1} of {count} of {first.path.name} "
                                 f"(its split.no {part.get('split.no')!r}, split.count {part.get('split.count')!r})")
        for t in part.tensors:
            if t.name in names:
                raise ModelLoadError(f"{part.path}: tensor {t.name} is in two parts of the split model")
            names.add(t.name)
            tensors.append(t)
    declared = first.get("split.tensors.count")
    if isinstance(declared, int) and declared != len(tensors):
        raise ModelLoadError(f"{first.path}: the split model declares {declared} tensors, its parts hold {len(tensors)}")
    return GgufHeader(path=first.path, file_size=first.file_size + sum(p.file_size for p in others),
                      version=first.version, metadata=first.metadata, arrays=first.arrays, tensors=tensors,
                      data_offset=first.data_offset, token_ids=first.token_ids, duplicate_token=first.duplicate_token)


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()
        _cached_parts.clear()


def _parse_file(p: Path, size: int) -> GgufHeader:
    try:
        with open(p, "rb") as f:
            magic = f.read(4)  # first: a /proc file that refuses reads says so, whatever its size
            if size < 4 or len(magic) < 4:
                raise ModelLoadError(f"not a GGUF file (only {size} bytes): {p}")
            if magic != GGUF_MAGIC:
                raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {p}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                cur = _Cursor(buf, size)
                cur.pos = 4
                try:
                    return _parse(cur, p)
                except EOFError:
                    raise ModelLoadError(f"{p} is truncated or malformed: its GGUF header runs past the end of "
                                         f"the file ({size} bytes)") from None
                except _Malformed as err:
                    raise ModelLoadError(f"{p} is malformed: {err}") from None
                except (struct.error, OverflowError, MemoryError, ValueError):
                    raise ModelLoadError(f"{p} is truncated or malformed: its GGUF header cannot be read") from None
    except OSError as err:
        raise ModelLoadError(f"cannot read {p}: {err.strerror or err}") from None


def _parse(cur: _Cursor, p: Path, file_size: int | None = None) -> GgufHeader:
    """The header from `cur` (the file, or its first bytes: `file_size` is then the whole file's, and
    an EOFError means the header goes on past them)."""
    file_size = cur.size if file_size is None else file_size
    version = cur.u32()
    if version not in (2, 3):
        raise _Malformed(f"unsupported GGUF version {version} (dg reads versions 2 and 3)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    remaining = file_size - cur.pos
    # the smallest key/value takes 13 bytes, the smallest tensor entry 24: counts a file cannot hold
    if n_kv * 13 > remaining or n_tensors * 24 > remaining:
        raise ModelLoadError(f"{p} is truncated or malformed: its header declares {n_tensors} tensors and {n_kv} keys, "
                             f"more than its {file_size} bytes can hold")
    if n_kv > MAX_KEYS:
        raise _Malformed(f"its header declares {n_kv} keys; dg reads at most {MAX_KEYS}")
    header = GgufHeader(path=p, file_size=file_size, version=version)
    for _ in range(n_kv):
        key = _key(cur)
        if key in header.metadata:
            raise _Malformed(f"key {key} appears twice")
        vtype = cur.u32()
        header.metadata[key] = (TYPE_NAMES.get(vtype, "?"), _value(cur, vtype, key, header))

    alignment = header.get("general.alignment", 32)
    if header.type_of("general.alignment") not in (None, "uint32") or not isinstance(alignment, int) \
            or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise _Malformed(f"general.alignment = {alignment!r} (must be a power of two up to {MAX_ALIGNMENT})")
    entries = [_tensor_info(cur) for _ in range(n_tensors)]
    header.data_offset = -(-cur.pos // alignment) * alignment
    header.tensors = _check_tensors(entries, header.data_offset, alignment, file_size, p)
    return header


class HeaderGoesOn(Exception):
    """The bytes given end before the header does (parse_header_prefix needs more of the file)."""


def parse_header_prefix(data: bytes, file_size: int, name: str) -> GgufHeader:
    """The header of a GGUF of `file_size` bytes from its first bytes `data` (a file not on this
    machine: dgcli.remote_gguf). HeaderGoesOn when the header runs past `data`; ModelLoadError (naming
    `name`) when it is malformed, or cannot fit in `file_size`."""
    p = Path(name)
    if len(data) < 4:
        if len(data) >= file_size:
            raise ModelLoadError(f"not a GGUF file (only {file_size} bytes): {name}")
        raise HeaderGoesOn
    if data[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (bad magic {bytes(data[:4])!r}): {name}")
    cur = _Cursor(bytes(data), len(data))
    cur.pos = 4
    try:
        return _parse(cur, p, file_size)
    except EOFError:
        if len(data) >= file_size:
            raise ModelLoadError(f"{name} is truncated or malformed: its GGUF header runs past the end of "
                                 f"the file ({file_size} bytes)") from None
        raise HeaderGoesOn from None
    except _Malformed as err:
        raise ModelLoadError(f"{name} is malformed: {err}") from None
    except (struct.error, OverflowError, MemoryError, ValueError):
        raise ModelLoadError(f"{name} is truncated or malformed: its GGUF header cannot be read") from None


def _key(cur: _Cursor) -> str:
    raw = cur.raw_string()
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise _Malformed(f"a key of {len(raw)} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Malformed(f"a key that is not UTF-8 ({raw[:40]!r})") from None


def _value(cur: _Cursor, vtype: int, key: str, header: GgufHeader) -> Any:
    if vtype in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[vtype]
        return cur.unpack(fmt, struct.calcsize(fmt))
    if vtype == _STRING:
        return cur.raw_string().decode("utf-8", errors="replace")
    if vtype != _ARRAY:
        raise _Malformed(f"key {key} has unknown type {vtype}")
    etype, n = cur.u32(), cur.u64()
    header.arrays[key] = (TYPE_NAMES.get(etype, "?"), n)
    if etype in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[etype]
        width = struct.calcsize(fmt)
        cur.need(n * width)
        if n <= KEEP_ARRAYS_UP_TO:
            values = list(struct.unpack_from(f"<{n}{fmt[1]}", cur.buf, cur.pos))
            cur.pos += n * width
            return values
        cur.pos += n * width
        return None
    if etype == _STRING:
        cur.need(n * 8)  # each string takes at least its 8-byte length
        limit = MAX_VOCAB if key == "tokenizer.ggml.tokens" else MAX_STRING_ARRAY
        if n > limit:
            raise _Malformed(f"key {key} is an array of {n} strings; dg reads at most {limit}")
        if key == "tokenizer.ggml.tokens":
            _scan_vocabulary(cur, n, header)
            return None
        if n <= KEEP_ARRAYS_UP_TO:
            return [cur.raw_string().decode("utf-8", errors="replace") for _ in range(n)]
        _skip_strings(cur, n)
        return None
    raise _Malformed(f"key {key} is an array of {TYPE_NAMES.get(etype, f'unknown type {etype}')}")


def _scan_vocabulary(cur: _Cursor, n: int, header: GgufHeader) -> None:
    """One pass over the token texts: ids of the texts of interest, and the first repeated text.
    (The loop does as little as it can: 262144 tokens are most of a real model's header.)"""
    buf, size, pos = cur.buf, cur.size, cur.pos
    unpack_len = struct.Struct("<Q").unpack_from
    texts: list[bytes] = []
    append = texts.append
    for _ in range(n):
        if pos + 8 > size:
            raise EOFError
        length = unpack_len(buf, pos)[0]
        pos += 8
        if pos + length > size:
            raise EOFError
        append(buf[pos:pos + length])
        pos += length
    cur.pos = pos
    distinct = set(texts)
    if len(distinct) != n or b"" in distinct:
        header.duplicate_token = _first_duplicate(texts)
    for text in TOKEN_TEXTS_OF_INTEREST:
        if text.encode() in distinct:
            header.token_ids[text] = texts.index(text.encode())


def _first_duplicate(texts: list[bytes]) -> tuple[bytes, int, int] | None:
    seen: dict[bytes, int] = {}
    for i, text in enumerate(texts):
        text = text or b"[EMPTY_%d]" % i  # what llama.cpp names an empty token
        first = seen.setdefault(text, i)
        if first != i:
            return text, first, i
    return None


def _skip_strings(cur: _Cursor, n: int) -> None:
    buf, size, pos = cur.buf, cur.size, cur.pos
    unpack_len = struct.Struct("<Q").unpack_from
    for _ in range(n):
        if pos + 8 > size:
            raise EOFError
        pos += 8 + unpack_len(buf, pos)[0]
    if pos > size:
        raise EOFError
    cur.pos = pos


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    raw = cur.raw_string()
    name = raw.decode("utf-8", errors="replace")
    if not raw or len(raw) >= 64:  # GGML_MAX_NAME, with its terminating zero
        raise _Malformed(f"a tensor name of {len(raw)} bytes")
    n_dims = cur.u32()
    if n_dims > MAX_TENSOR_DIMS:
        raise _Malformed(f"tensor {name} has {n_dims} dimensions (1 to {MAX_TENSOR_DIMS})")
    shape = tuple(cur.u64() for _ in range(n_dims))
    return name, shape, cur.u32(), cur.u64()


def _check_tensors(entries: Iterable[tuple[str, tuple[int, ...], int, int]], data_offset: int, alignment: int,
                   size: int, p: Path) -> list[TensorEntry]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: PLC0415 (block sizes of the types)

    out, names = [], set()
    expected = 0  # llama.cpp's reader wants the tensors' data back to back, in order, each padded to the alignment
    for name, shape, type_id, offset in entries:
        if name in names:
            raise _Malformed(f"two tensors are named {name}")
        names.add(name)
        try:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise _Malformed(f"tensor {name} has an unknown type id {type_id}") from None
        n_elements = 1
        for d in shape:
            if d <= 0 or d >= 1 << 62:
                raise _Malformed(f"tensor {name} has shape {list(shape)}")
            n_elements *= d
        if n_elements >= 1 << 62:
            raise _Malformed(f"tensor {name} has shape {list(shape)} ({n_elements} elements)")
        row = shape[0] if shape else 1
        if row % block:
            raise _Malformed(f"tensor {name} of type {qtype.name} has rows of {row} values, "
                             f"not a multiple of its block size {block}")
        if offset % alignment:
            raise _Malformed(f"tensor {name} starts at offset {offset}, not a multiple of the alignment {alignment}")
        n_bytes = n_elements // block * type_size
        end = data_offset + offset + n_bytes
        if end > size:
            raise ModelLoadError(f"{p} is truncated: tensor {name} ends at byte {end}, the file has {size}")
        if offset != expected:
            raise _Malformed(f"tensor {name} starts at offset {offset} of the data section; the tensors before it "
                             f"end at {expected} (GGUF stores them back to back)")
        expected += -(-n_bytes // alignment) * alignment
        out.append(TensorEntry(name, shape, type_id, qtype.name, offset, n_elements, n_bytes))
    return out
