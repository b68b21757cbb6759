"""`dg info`: what a GGUF holds, read with the gguf package (never loaded into llama.cpp).

Also the pre-flight checks the CLI runs before loading a model: is it a readable GGUF, is it the
right architecture for the command, does it fit in this machine's memory.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dgcli.engine.types import DIFFUSION_PARAM_KEYS, REFERENCE_DEFAULTS_KEY, DgError, DiffusionParams, ModelLoadError

GGUF_MAGIC = b"GGUF"
DIFFUSION_ARCH = "diffusion-gemma"
# llama.cpp mmaps the weights; KV cache, compute buffers and the process itself come on top.
MEMORY_OVERHEAD_FACTOR = 1.10
MEMORY_OVERHEAD_BYTES = 256 * 1024**2
# Where a sampler default comes from: the file's own value, the file's value that dg filled with the
# reference's default (the checkpoint had none), or no value in the file (the reference's default applies).
FROM_GGUF, FROM_GGUF_REFERENCE_DEFAULT, FROM_DEFAULT = "gguf", "gguf: reference default", "default"


class TooBigForMemory(DgError):
    pass


@dataclass
class TensorTypeCount:
    type: str
    tensors: int
    parameters: int
    bytes: int


@dataclass
class GgufInfo:
    path: str
    file_size: int
    architecture: str
    name: str | None
    parameter_count: int
    tensor_count: int
    tensor_types: list[TensorTypeCount]
    file_type: str | None  # the dominant weight type, e.g. Q4_K
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    expert_count: int | None
    expert_used_count: int | None
    vocab_size: int | None
    canvas_length: int | None
    sampler_defaults: dict[str, Any] = field(default_factory=dict)  # field -> value
    sampler_defaults_source: dict[str, str] = field(default_factory=dict)  # field -> FROM_*
    final_logit_softcapping: float | None = None
    # keys beyond the published converter's: dg wrote the reference's defaults where the checkpoint had none
    reference_default_keys: list[str] = field(default_factory=list)
    has_chat_template: bool = False
    ram_total: int = 0
    ram_available: int = 0
    memory_needed: int = 0

    @property
    def is_diffusion(self) -> bool:
        return self.architecture == DIFFUSION_ARCH

    @property
    def fits_ram(self) -> bool:
        return self.memory_needed <= self.ram_total

    @property
    def fits_available_ram(self) -> bool:
        return self.memory_needed <= self.ram_available

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["is_diffusion"] = self.is_diffusion
        out["fits_ram"] = self.fits_ram
        out["fits_available_ram"] = self.fits_available_ram
        return out


def memory_needed(file_size: int) -> int:
    return int(file_size * MEMORY_OVERHEAD_FACTOR) + MEMORY_OVERHEAD_BYTES


def _check_magic(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelLoadError(f"not a GGUF file (a directory): {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}")


def _scalar(reader, key: str):
    fld = reader.fields.get(key)
    if fld is None:
        return None
    try:
        value = fld.contents()
    except Exception:  # noqa: BLE001 - a malformed optional key reads as absent
        return None
    if isinstance(value, float):
        return float(f"{value:.7g}")  # float32 in the file: 0.3 instead of 0.30000001192092896
    return value


def open_reader(path: Path | str):
    """A GGUFReader over `path`, or ModelLoadError naming what is wrong with the file."""
    from gguf import GGUFReader

    path = Path(path)
    _check_magic(path)
    try:
        reader = GGUFReader(path)
    except Exception as err:  # noqa: BLE001 - the gguf package raises many kinds on bad input
        raise ModelLoadError(f"not a valid GGUF file (truncated or corrupt): {path} ({type(err).__name__})") from None
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"truncated GGUF file: {path} ({size} bytes, tensor data needs {end})")
    return reader


def _reference_default_keys(reader, arch: str) -> list[str]:
    """The keys dg says it filled with the reference's defaults: only those dg adds and the file holds."""
    listed = _scalar(reader, REFERENCE_DEFAULTS_KEY)
    if not isinstance(listed, list):
        return []
    addable = [f"{arch}.final_logit_softcapping", *DIFFUSION_PARAM_KEYS]
    return [key for key in addable if key in listed and key in reader.fields]


def read_info(path: Path | str) -> GgufInfo:
    import psutil
    from gguf import GGMLQuantizationType

    path = Path(path)
    reader = open_reader(path)
    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"GGUF without general.architecture: {path}")

    histogram: dict[str, list[int]] = {}
    params = 0
    for t in reader.tensors:
        type_name = GGMLQuantizationType(t.tensor_type).name
        row = histogram.setdefault(type_name, [0, 0, 0])
        row[0] += 1
        row[1] += int(t.n_elements)
        row[2] += int(t.n_bytes)
        params += int(t.n_elements)
    types = sorted(
        (TensorTypeCount(k, v[0], v[1], v[2]) for k, v in histogram.items()), key=lambda r: -r.bytes
    )
    # The dominant 2D weight type names the quant (norms and scales stay F32 in every quant).
    weight_types = Counter()
    for t in reader.tensors:
        if len(t.shape) >= 2:
            weight_types[GGMLQuantizationType(t.tensor_type).name] += int(t.n_bytes)
    file_type = weight_types.most_common(1)[0][0] if weight_types else None

    filled = _reference_default_keys(reader, arch)
    sampler, source = {}, {}
    if arch == DIFFUSION_ARCH:
        reference_defaults = DiffusionParams()
        for key, name in DIFFUSION_PARAM_KEYS.items():
            value = _scalar(reader, key)
            sampler[name] = value if value is not None else getattr(reference_defaults, name)
            source[name] = (FROM_DEFAULT if value is None else
                            FROM_GGUF_REFERENCE_DEFAULT if key in filled else FROM_GGUF)

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    size = path.stat().st_size
    vm = psutil.virtual_memory()
    return GgufInfo(
        path=str(path),
        file_size=size,
        architecture=arch,
        name=_scalar(reader, "general.name"),
        parameter_count=params,
        tensor_count=len(reader.tensors),
        tensor_types=types,
        file_type=file_type,
        context_length=_scalar(reader, f"{arch}.context_length"),
        block_count=_scalar(reader, f"{arch}.block_count"),
        embedding_length=_scalar(reader, f"{arch}.embedding_length"),
        expert_count=_scalar(reader, f"{arch}.expert_count"),
        expert_used_count=_scalar(reader, f"{arch}.expert_used_count"),
        vocab_size=len(tokens.data) if tokens is not None else None,
        canvas_length=_scalar(reader, "diffusion.canvas_length"),
        sampler_defaults=sampler,
        sampler_defaults_source=source,
        final_logit_softcapping=_scalar(reader, f"{arch}.final_logit_softcapping"),
        reference_default_keys=filled,
        has_chat_template=_scalar(reader, "tokenizer.chat_template") is not None,
        ram_total=vm.total,
        ram_available=vm.available,
        memory_needed=memory_needed(size),
    )


def architecture_of(path: Path | str) -> str:
    reader = open_reader(path)
    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"GGUF without general.architecture: {path}")
    return arch


def check_architecture(path: Path | str, *, diffusion: bool, command: str) -> str:
    """Refuse a GGUF of the wrong kind for `command` before llama.cpp sees it."""
    arch = architecture_of(path)
    if diffusion and arch != DIFFUSION_ARCH:
        raise ModelLoadError(
            f"{path} is a {arch!r} model, not a DiffusionGemma ({DIFFUSION_ARCH!r}) GGUF; "
            f"`dg {command}` needs a diffusion model (use it as --ar-model, or see `dg list`)"
        )
    if not diffusion and arch == DIFFUSION_ARCH:
        raise ModelLoadError(f"{path} is a diffusion model; the autoregressive side needs a stock gemma4 GGUF")
    return arch


def check_fits_memory(path: Path | str, *, n_gpu_layers: int = 0) -> None:
    """Refuse a model that cannot fit in this machine's RAM (weights offloaded to a GPU excepted).

    Compared against total RAM, not available: llama.cpp mmaps the file, so page cache is reusable.
    DG_SKIP_MEMORY_CHECK=1 skips it (e.g. for swap-backed experiments).
    """
    import psutil

    if n_gpu_layers != 0 or os.environ.get("DG_SKIP_MEMORY_CHECK") == "1":
        return
    size = Path(path).stat().st_size
    need = memory_needed(size)
    total = psutil.virtual_memory().total
    if need > total:
        from dgcli.hub import format_bytes

        raise TooBigForMemory(
            f"{Path(path).name} needs about {format_bytes(need)} of RAM but this machine has {format_bytes(total)}; "
            "use a smaller quant, or offload layers with --gpu-layers"
        )
