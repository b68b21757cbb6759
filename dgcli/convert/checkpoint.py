"""Reading a Hugging Face checkpoint without torch: safetensors headers checked and their tensors
memory-mapped with numpy (F32 / F16 / BF16), each GGUF tensor found under the names the
checkpoint's forms use.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from dgcli.convert.config import LayoutParams
from dgcli.convert.tensors import HF_LAYER_SUFFIX, HF_SELF_COND, TensorSpec
from dgcli.errors import DgError

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
# every dtype of the safetensors format, by its size in bytes (the ones above are the ones we convert)
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entry(path: Path, name: str, info: Any, base: int, size: int) -> tuple[Path, str, tuple[int, ...], int, int]:
    """(file, dtype, shape, byte offset, byte count) of one header entry, after checking that its
    data_offsets hold exactly its shape's bytes inside the file (reversed, negative or shifted
    offsets would give a GGUF of garbage weights)."""
    def bad(why: str) -> DgError:
        return DgError(f"{path.name}: tensor {name} {why}")

    if not isinstance(info, dict):
        raise bad("is not described by a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ST_ITEMSIZE:
        raise bad(f"has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"has an invalid shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad(f"has invalid data_offsets {offsets!r}")
    start, end = offsets
    nbytes = math.prod(shape) * _ST_ITEMSIZE[dtype]
    if end - start != nbytes:
        raise bad(f"has data_offsets {offsets} that do not hold its {dtype} {shape} data ({nbytes} bytes)")
    if base + end > size:
        raise DgError(f"{path.name} is truncated (tensor {name} ends past the file)")
    return path, dtype, tuple(shape), base + start, nbytes


class SafetensorsIndex:
    """Tensors of one or more .safetensors files, read lazily through numpy memmaps."""

    def __init__(self, files: Sequence[Path]):
        self.entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for path in files:
            self._read_header(path)

    def _read_header(self, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise DgError(f"{path.name} is not a safetensors file (too short)")
                n = int.from_bytes(head, "little")
                if n <= 0 or n > 100_000_000:
                    raise DgError(f"{path.name} is not a safetensors file (bad header size)")
                header = json.loads(f.read(n))
            size = path.stat().st_size
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise DgError(f"cannot read {path}: {exc}") from None
        if not isinstance(header, dict):
            raise DgError(f"{path.name} is not a safetensors file (its header is not a JSON object)")
        entries = {name: _tensor_entry(path, name, info, 8 + n, size)
                   for name, info in header.items() if name != "__metadata__"}
        # the format's rule: the tensors' bytes follow each other, no gap, no overlap (a shifted
        # offset would otherwise read its neighbour's bytes as weights)
        end = 0
        for name, (_, _, _, offset, nbytes) in sorted(entries.items(), key=lambda e: (e[1][3], e[1][4])):
            if offset - (8 + n) != end:
                raise DgError(f"{path.name}: tensor {name}'s data_offsets overlap or leave a gap before it")
            end += nbytes
        self.entries.update(entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def load(self, name: str, rows: slice | None = None) -> np.ndarray:
        """float32 copy of a tensor (or of a slice of its leading dimension)."""
        path, dtype, shape, offset, nbytes = self.entries[name]
        if dtype not in _ST_DTYPES:
            raise DgError(f"tensor {name} has unsupported dtype {dtype}")
        np_dtype = _ST_DTYPES[dtype]
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, np.float32)
        mm = np.memmap(path, dtype=np_dtype, mode="r", offset=offset, shape=shape)
        view = mm[rows] if rows is not None else mm
        if dtype == "BF16":
            return (np.asarray(view, dtype=np.uint32) << 16).view(np.float32)
        return np.array(view, dtype=np.float32)


def checkpoint_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DgError(f"cannot read {index}: {exc}") from None
        shards = weight_map.values() if isinstance(weight_map, dict) else None
        if shards is None or not all(isinstance(f, str) and f and not Path(f).is_absolute()
                                     and ".." not in Path(f).parts for f in shards):
            raise DgError(f"{index.name}: weight_map must map tensor names to shard files of the checkpoint")
        files = sorted({hf_dir / f for f in shards})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DgError(f"checkpoint shard(s) missing: {', '.join(missing)}")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise DgError(f"no .safetensors files in {hf_dir}")
    return files


def read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise DgError(f"{path.name} is missing from {path.parent}")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DgError(f"cannot read {path.name}: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise DgError(f"{path.name} must hold a JSON object")
    return data


class CheckpointReader:
    """Resolves layout roles to checkpoint tensors, whichever copy of a tied weight was saved."""

    _ENC = ("model.encoder.language_model.", "encoder.language_model.", "model.language_model.")
    _DEC = ("model.decoder.", "decoder.")

    def __init__(self, hf_dir: Path, params: LayoutParams):
        self.params = params
        self.st = SafetensorsIndex(checkpoint_files(hf_dir))

    def _first(self, candidates: Sequence[str], what: str) -> str:
        for name in candidates:
            if name in self.st:
                return name
        raise DgError(f"checkpoint lacks {what} (looked for {candidates[0]})")

    def _tied(self, suffix: str, what: str) -> str:
        """A weight shared by encoder and decoder: the decoder's copy when saved, else the encoder's."""
        names = [pre + suffix for pre in self._DEC + self._ENC]
        found = [n for n in names if n in self.st]
        if not found:
            raise DgError(f"checkpoint lacks {what} (looked for {names[0]})")
        return found[0]

    def hf_name(self, spec: TensorSpec) -> str:
        i = spec.layer
        if spec.role == "token_embd":
            return self._tied("embed_tokens.weight", "the token embedding") if any(
                pre + "embed_tokens.weight" in self.st for pre in self._DEC + self._ENC) else self._first(
                ["lm_head.weight"], "the token embedding")
        if spec.role == "output_norm":
            return self._tied("norm.weight", "the final norm")
        if spec.role in HF_SELF_COND:
            return self._first([pre + HF_SELF_COND[spec.role] for pre in self._DEC], f"{spec.role} (self-conditioning)")
        if spec.role == "layer_scalar_decoder":
            return self._first([f"{pre}layers.{i}.layer_scalar" for pre in self._DEC], f"decoder layer {i} layer_scalar")
        if spec.role == "layer_scalar_encoder":
            return self._first([f"{pre}layers.{i}.layer_scalar" for pre in self._ENC], f"encoder layer {i} layer_scalar")
        if spec.role in HF_LAYER_SUFFIX:
            return self._tied(f"layers.{i}.{HF_LAYER_SUFFIX[spec.role]}", f"layer {i} {HF_LAYER_SUFFIX[spec.role]}")
        raise DgError(f"internal: no checkpoint mapping for {spec.name}")

    def check_tied_lm_head(self, rows: int = 4096) -> None:
        """An lm_head.weight beside the embedding must be the embedding (the layout has no separate
        LM head: token_embd is it); one that differs would be dropped in silence."""
        if "lm_head.weight" not in self.st:
            return
        embd = self.hf_name(TensorSpec("token_embd.weight", (), "token_embd"))
        if embd == "lm_head.weight":
            return
        if self.st.shape("lm_head.weight") != self.st.shape(embd):
            raise DgError(f"checkpoint has an lm_head.weight of shape {list(self.st.shape('lm_head.weight'))} beside "
                          f"{embd} {list(self.st.shape(embd))}: a separate LM head is not supported (the GGUF "
                          "layout ties it to token_embd)")
        for start in range(0, self.st.shape(embd)[0], rows):
            part = slice(start, start + rows)
            if not np.array_equal(self.st.load("lm_head.weight", part), self.st.load(embd, part), equal_nan=True):
                raise DgError(f"checkpoint has an lm_head.weight that differs from {embd} (from row {start}): "
                              "a separate LM head is not supported (the GGUF layout ties it to token_embd)")

    def chunks(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        if spec.role == "rope_freqs":
            yield self.params.rope_freq_factors()
            return
        name = self.hf_name(spec)
        shape = self.st.shape(name)
        expected = spec.shape
        if spec.role.startswith("layer_scalar") and int(np.prod(shape)) == 1:
            shape = expected
            yield self.st.load(name).reshape(expected)
            return
        if tuple(shape) != tuple(expected):
            raise DgError(f"checkpoint tensor {name} has shape {list(shape)}, expected {list(expected)} from config.json")
        if len(expected) == 3:
            for e in range(expected[0]):  # one expert at a time keeps memory flat
                yield self.st.load(name, slice(e, e + 1))
        else:
            yield self.st.load(name)
