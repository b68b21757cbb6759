"""`dg info`: what a GGUF holds, read from its header (never loaded into llama.cpp).

Also the pre-flight checks the CLI runs before loading a model: is it a readable GGUF, is it the
right architecture for the command with hyperparameters llama.cpp can take, does it fit in this
machine's memory. All of them share one parse of the header (dgcli/modelfile/header.py).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dgcli.errors import DgError, ModelLoadError
from dgcli.modelfile.header import GgufHeader, read_header
from dgcli.modelfile.hparams import AR_ARCH, DIFFUSION_ARCH, check_model_header, sampler_defaults
from dgcli.modelfile.layout import layout_tensors
from dgcli.params import DIFFUSION_PARAM_KEYS, REFERENCE_DEFAULTS_KEY, DiffusionParams
from dgcli.runtime.cpu import cpu_flags, is_x86_64
from dgcli.runtime.offload import PlacementPlan, plan_placement
from dgcli.units import format_bytes

# llama.cpp mmaps the weights; KV cache, compute buffers and the process itself come on top: 5% over
# the weights (activations, the mapping's slack), the logits of a micro-batch twice (llama.cpp's
# compute buffer and its output buffer: 1.1 GB at the real vocabulary, 2 MB for the demo's), and the
# process (Python, numpy, dg's modules, llama.cpp's library: 70 MB measured for the demo model, whose
# weights are 2 MB). The fixed 256 MiB this replaced made the demo "need" 270.7 MB, and left the real
# model's logits to the percentage.
MEMORY_OVERHEAD_FACTOR = 1.05
PROCESS_BYTES = 100 * 1000**2
# Where a sampler default comes from: the file's own value, the file's value that dg filled with the
# reference's default (the checkpoint had none), or no value in the file (the reference's default applies).
FROM_GGUF, FROM_GGUF_REFERENCE_DEFAULT, FROM_DEFAULT = "gguf", "gguf: reference default", "default"
# On the GPU, besides the offloaded weights and their layers' KV cache: the CUDA context, cuBLAS's
# workspace, and a compute buffer holding a micro-batch of logits (and their softcapped copy).
GPU_RUNTIME_BYTES = 512 * 1024**2


def metal_step_scratch_bytes(vocab: int, canvas: int) -> int:
    """What a Metal buffer allocates for the one-graph step's TOP_K and CUMSUM over [vocab, canvas]
    (ggml-metal's get_alloc_size: the top-k takes 2 int32 per input element, the cumulative sum twice
    its output), on top of the logits memory_plan counts for every GPU: 1 GiB at real widths.
    tests/test_backend_ops.py checks it against ggml-metal's own function."""
    return 2 * 4 * vocab * canvas + 2 * 4 * vocab * canvas
N_UBATCH = 512
KV_CONTEXT = 4096  # dg's default context (runtime.model.DEFAULT_N_CTX)



class TooBigForMemory(DgError):
    pass


@dataclass
class GpuMemory:
    """The GPU memory a fit is judged against: detected through llama.cpp, or given (dg info --gpu-memory)."""

    name: str
    total: int
    free: int
    # Apple's GPUs through ggml-metal: memory shared with the CPU (a RAM fit counts the GPU's share
    # too), and the step's Metal scratch (metal_step_scratch_bytes)
    metal: bool = False


# kB/MB/GB/TB decimal, as dg prints sizes (dgcli.units); KiB/MiB/GiB/TiB binary, as they say
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


MAX_SIZE = 2**60  # 1 EiB: past any memory, and still exact in a float and an int64


def parse_size(text: str) -> int:
    """'16GB' (16 * 10**9), '16 GiB' (16 * 2**30), '12g', '8000000000' -> bytes."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text or "")
    unit = m and _SIZE_UNITS.get(m[2].lower())
    if not m or unit is None:
        raise DgError(f"invalid size {text!r}: expected a number with an optional unit, e.g. 16GB or 12GiB")
    size = float(m[1]) * unit  # inf for a number past a float's range
    if not 1 <= size <= MAX_SIZE:
        raise DgError(f"invalid size {text!r}: expected from 1 byte to 1 EiB")
    return int(size)


def detect_gpus() -> list[GpuMemory]:
    """The GPUs the installed llama.cpp can offload to; none when it is CPU-only or missing."""
    try:
        from dgcli.runtime import native

        return [GpuMemory(f"{d.name} ({d.description})", d.total, d.free, metal=d.backend == native.METAL_BACKEND)
                for d in native.gpu_devices()]
    except DgError:
        return []


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
    file_type: str | None  # general.file_type's quant (e.g. Q4_K_M), else the dominant weight type (e.g. Q4_K)
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
    problem: str | None = None  # why dg would refuse to load it (check_model_header), if it would
    ram_total: int = 0
    ram_available: int = 0
    memory_needed: int = 0  # system memory (RAM) this placement needs
    # offload: what was asked, what it means on this machine, and the GPU side's need
    gpu_layers: int = 0
    n_cpu_moe: int = 0
    gpu_name: str | None = None  # None: no GPU (everything stays in RAM)
    gpu_total: int = 0
    gpu_free: int = 0
    gpu_needed: int = 0
    offloaded_layers: int = 0
    placement: list[tuple[str, str, int, int]] = field(default_factory=list)  # (what, where, tensors, bytes)
    # diffusion: the transposed embeddings of dense self-conditioning (counted in the needs above), and where
    self_cond_bytes: int = 0
    self_cond_on_gpu: bool = False
    # the context whose KV cache the needs count (dg info -c N), in tokens; None: none asked for (the
    # default context's cache is then counted on the GPU only)
    kv_context: int | None = None

    @property
    def is_diffusion(self) -> bool:
        return self.architecture == DIFFUSION_ARCH

    @property
    def fits_ram(self) -> bool:
        return self.memory_needed <= self.ram_total

    @property
    def fits_available_ram(self) -> bool:
        return self.memory_needed <= self.ram_available

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_needed <= self.gpu_total

    @property
    def fits_available_gpu(self) -> bool:
        return self.gpu_needed <= self.gpu_free

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["placement"] = [dict(what=w, where=d, tensors=n, bytes=b) for w, d, n, b in self.placement]
        for name in ("is_diffusion", "fits_ram", "fits_available_ram", "fits_gpu", "fits_available_gpu"):
            out[name] = getattr(self, name)
        return out


def logits_bytes(vocab: int, canvas: int) -> int:
    """A micro-batch's logits (the larger of a prompt chunk and a canvas), float32, held twice."""
    return 2 * max(N_UBATCH, canvas) * vocab * 4


def memory_needed(weight_bytes: int, vocab: int = 0, canvas: int = 0) -> int:
    """RAM for a process holding `weight_bytes` of weights and making logits over `vocab` tokens."""
    return int(weight_bytes * MEMORY_OVERHEAD_FACTOR) + logits_bytes(vocab, canvas) + PROCESS_BYTES


def attention_scores_bytes(get, arch: str, n_layer: int, n_ctx: int, canvas: int) -> int:
    """A CPU-only context's attention scores (dgcli.runtime.model.flash_attention_wanted: no flash attention
    there): one micro-batch's queries (the larger of a prompt chunk and a canvas) against n_ctx cells, every
    head, float32 (their softmax takes their place: the demo at 32768 cells measured 322 MiB of compute
    buffer against 34 with flash attention, this 268 MB). `get(key)` reads a GGUF key."""
    heads = max(_layer_values(get(f"{arch}.attention.head_count"), max(n_layer, 1), 1))
    return max(N_UBATCH, canvas) * n_ctx * min(max(heads, 1), 4096) * 4


def _layer_values(value: Any, n_layer: int, default: int) -> list[int]:
    if isinstance(value, list) and len(value) == n_layer and all(isinstance(v, int) for v in value):
        return value
    return [value if isinstance(value, int) and value >= 0 else default] * n_layer


def kv_cache_bytes(get, arch: str, n_layer: int, n_ctx: int = KV_CONTEXT) -> list[int]:
    """Per layer, the F16 KV cache of a dg context: sliding layers keep window + one micro-batch of cells.
    `get(key)` reads a GGUF key (None when absent)."""
    heads = _layer_values(get(f"{arch}.attention.head_count_kv"), n_layer, 1)
    pattern = get(f"{arch}.attention.sliding_window_pattern")
    sliding = [bool(v) for v in pattern] if isinstance(pattern, list) and len(pattern) == n_layer else [False] * n_layer
    window = get(f"{arch}.attention.sliding_window")
    window = window if isinstance(window, int) and window > 0 else n_ctx
    out = []
    for il in range(n_layer):
        swa = "_swa" if sliding[il] else ""
        k = get(f"{arch}.attention.key_length{swa}") or get(f"{arch}.attention.key_length") or 128
        v = get(f"{arch}.attention.value_length{swa}") or k
        cells = min(n_ctx, window + N_UBATCH) if sliding[il] else n_ctx
        out.append(int(cells) * int(heads[il]) * (int(k) + int(v)) * 2)
    return out


def memory_plan(get, tensors: list[tuple[str, int]], vocab: int, file_size: int, n_gpu_layers: int, n_cpu_moe: int,
                gpus: list[GpuMemory], context: tuple[int, int] | None = None) -> tuple[PlacementPlan, int, int]:
    """(placement, RAM need, GPU need) for this offload, from a GGUF's keys (`get`) and (name, bytes)
    tensor list. Without a GPU everything is in RAM: llama.cpp ignores --gpu-layers then.
    `context` = (cells per sequence, sequences): the KV cache of a context asked for, counted wherever
    it goes (RAM too); without it, a default context's on the GPU only."""
    arch = get("general.architecture")
    n_layer = get(f"{arch}.block_count")
    n_layer = n_layer if isinstance(n_layer, int) and 0 < n_layer <= 4096 else 0
    plan = plan_placement(tensors, n_layer, n_gpu_layers, n_cpu_moe, gpu=bool(gpus) and n_gpu_layers != 0)
    if context is not None:
        n_ctx, n_seq = context
        kv = [n_seq * b for b in kv_cache_bytes(get, arch, n_layer, n_ctx)]
    else:
        kv = kv_cache_bytes(get, arch, n_layer)
    canvas = get("diffusion.canvas_length")
    canvas = canvas if isinstance(canvas, int) and canvas > 0 else 0
    if plan.gpu_weight_bytes == 0:
        if context is None:
            return plan, memory_needed(file_size, vocab, canvas), 0
        # the context's KV cache, and its attention scores, which share the compute buffer with the logits
        # (one or the other at a time: past the logits only the excess counts)
        scores = max(0, attention_scores_bytes(get, arch, n_layer, n_ctx, canvas) - logits_bytes(vocab, canvas))
        return plan, memory_needed(file_size, vocab, canvas) + scores + sum(kv), 0
    start = n_layer + 1 - plan.gpu_layer_count
    kv_gpu = sum(kv[il] for il in range(max(start, 0), n_layer))
    gpu_need = plan.gpu_weight_bytes + kv_gpu + logits_bytes(vocab, canvas) + GPU_RUNTIME_BYTES
    # the host keeps its copy of the logits (llama.cpp's output buffer) beside the GPU's
    ram_need = memory_needed(plan.ram_weight_bytes, vocab, canvas) + (sum(kv) - kv_gpu)
    if any(g.metal for g in gpus):
        if canvas:  # the one-graph step's sampler pass in ggml ops (dg_denoise_step on a GPU)
            gpu_need += metal_step_scratch_bytes(vocab, canvas)
        ram_need += gpu_need  # one memory: what the GPU holds is taken from RAM
    return plan, ram_need, gpu_need


def header_plan(header: GgufHeader, n_gpu_layers: int, n_cpu_moe: int, gpus: list[GpuMemory],
                context: tuple[int, int] | None = None):
    """memory_plan from the header: what `dg info` and the pre-load check use."""
    plan, ram_need, gpu_need = memory_plan(header.get, tensor_sizes(header), header.n_vocab or 0, header.file_size,
                                           n_gpu_layers, n_cpu_moe, gpus, context)
    sc_ram, sc_gpu = self_cond_copy_bytes(header, plan)
    if any(g.metal for g in gpus):  # one memory: the copy a Mac's GPU holds is taken from RAM too
        sc_ram += sc_gpu
    repacked = repacked_bytes(header, plan) + repacked_expert_growth(header, plan)
    return plan, ram_need + repacked + sc_ram, gpu_need + sc_gpu


# The weights dg's int8 GEMMs copy into their own layout when they run on this CPU (x86-64 with AVX2;
# native/patch/src/diffusion-gemma-lm-head.h): the Q8_0 or Q5_0 LM head and the decoder's dense Q8_0
# and Q5_0 projections. 36 bytes per 32 weights (Q8_0: 34, Q5_0: 22), in memory beside the mapped file.
_REPACKED_WEIGHTS = re.compile(r"output\.weight|self_cond_(gate|up|down)\.weight|"
                               r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
REPACKED_TYPES = {"Q8_0": 34, "Q5_0": 22}  # the types repacked, and their bytes per 32 weights


def _cpu_runs_repacked_gemms() -> bool:
    return is_x86_64() and "avx2" in cpu_flags()


def repacked_bytes(header: GgufHeader, plan: PlacementPlan) -> int:
    """Bytes of the repacked copies a diffusion-gemma model makes of its CPU-resident Q8_0 and Q5_0 weights:
    none where a GPU is in use (llama.cpp then runs a canvas's matmuls on host weights on the GPU, and dg's
    CPU GEMMs stand aside). With --gpu-layers 0 on a machine with a GPU they stand aside too, but the plan
    has no GPU then: the estimate stays on the safe side."""
    if header.architecture != "diffusion-gemma" or plan.gpu or not _cpu_runs_repacked_gemms():
        return 0
    on_gpu = {t.name for t in plan.tensors if t.on_gpu}
    tensors = {t.name: t for t in header.tensors}
    if "output.weight" not in tensors and "token_embd.weight" in tensors:  # the LM head tied to the embedding
        tied = tensors["token_embd.weight"]
        tensors["output.weight"] = tied
        if any(t.on_gpu for t in plan.tensors if t.name.startswith("output.weight")):
            on_gpu.add("output.weight")
    return sum(t.n_bytes * 36 // REPACKED_TYPES[t.type_name] for name, t in tensors.items()
               if _REPACKED_WEIGHTS.fullmatch(name) and name not in on_gpu and t.type_name in REPACKED_TYPES
               and len(t.shape) == 2 and t.shape[0] % 32 == 0)


# The MoE experts dg repacks while loading into a layout of its int8 GEMM (its own buffer type, native
# diffusion-gemma-experts.cpp), which replaces the file's copy. Per group of 8 rows (AVX2) or 16 (AVX-512
# VNNI), the bytes of each block of 32 or super-block of 256 (dg_experts::stored_group_bytes): AVX2's Q8_0
# and Q5_0 with each row-block's quant sum, Q4_K with its 6-bit scales unpacked on both, AVX2's Q6_K with
# its correction; VNNI's Q8_0 and Q5_0 put the group's scales first, padded to 64 bytes.
_EXPERT_BLOCK_BYTES = {"avx2": {"Q8_0": 36, "Q5_0": 24, "Q4_K": 148, "Q6_K": 214},
                       "avx512-vnni": {"Q8_0": 34, "Q5_0": 22, "Q4_K": 148, "Q6_K": 210}}
_EXPERT_WEIGHTS = re.compile(r"blk\.\d+\.ffn_(gate_up|up|gate|down)_exps\.weight")


def expert_layout_family() -> str | None:
    """The kernel family whose layout the experts are repacked into on this machine, by the native rule
    (dg_experts::repack_kernel_for_cpu): DG_EXPERT_GEMM, else DG_CPU_KERNELS, else the widest family the
    CPU runs; None where they stay in the file's layout (no AVX2, not x86-64, ggml's kernels asked for)."""
    if not is_x86_64():
        return None
    flags = cpu_flags()
    runs = {"avx512-vnni": "avx512_vnni" in flags, "avx2": "avx2" in flags}
    asked = next((v for v in (os.environ.get("DG_EXPERT_GEMM"), os.environ.get("DG_CPU_KERNELS"))
                  if v and v != "auto"), None)
    if asked is not None:
        return asked if runs.get(asked) else None
    return next((family for family, here in runs.items() if here), None)


def repacked_expert_bytes(type_name: str, n_in: int, n_out: int, n_expert: int, family: str) -> int | None:
    """Bytes of n_expert experts of n_out rows of n_in weights in `family`'s repacked layout (partial row
    groups padded to whole ones), or None for a type or width it does not repack."""
    per_block = _EXPERT_BLOCK_BYTES[family].get(type_name)
    block = 256 if type_name in ("Q4_K", "Q6_K") else 32
    if per_block is None or n_in <= 0 or n_in % block:
        return None
    group = 8 if family == "avx2" else 16
    n_blocks = n_in // block
    group_bytes = n_blocks * per_block * group
    if family == "avx512-vnni" and type_name in ("Q8_0", "Q5_0"):
        scales = n_blocks * 2 * group
        group_bytes += (scales + 63) // 64 * 64 - scales
    return n_expert * -(-n_out // group) * group_bytes


def repacked_expert_growth(header: GgufHeader, plan: PlacementPlan) -> int:
    """Bytes the repacked experts of a diffusion-gemma model add over their share of the file: the
    repack runs where no GPU is in use and the CPU runs a kernel family (the loader then drops the file's
    pages of those tensors, so only the growth is new)."""
    family = expert_layout_family()
    if header.architecture != "diffusion-gemma" or plan.gpu or family is None:
        return 0
    growth = 0
    for t in header.tensors:
        if _EXPERT_WEIGHTS.fullmatch(t.name) and len(t.shape) == 3:
            repacked = repacked_expert_bytes(t.type_name, *(int(n) for n in t.shape), family)
            growth += max(0, repacked - int(t.n_bytes)) if repacked is not None else 0
    return growth


def self_cond_copy_bytes(header: GgufHeader, plan: PlacementPlan) -> tuple[int, int]:
    """(RAM, GPU) bytes of the transposed token embeddings a diffusion-gemma model makes for the dense
    self-conditioning product on its first self-conditioned step (the default form; a top-k run never
    makes them): Q8_0 (34 bytes per 32 weights; 36 where dg's int8 GEMM repacks it on this CPU), F32
    where the vocabulary is not whole 32-token blocks. Beside the output layer: on the GPU when it is
    offloaded (native/patch/src/diffusion-gemma-embd-t.h)."""
    from dgcli.runtime.self_cond import DEFAULT_SC_TOP_K

    tensors = {t.name: t for t in header.tensors}
    embd = tensors.get("token_embd.weight")
    if header.architecture != "diffusion-gemma" or DEFAULT_SC_TOP_K or embd is None or len(embd.shape) != 2:
        return 0, 0
    n_embd, vocab = embd.shape
    on_gpu = any(t.on_gpu for t in plan.tensors if t.name.startswith("output"))
    if vocab % 32:
        size = vocab * n_embd * 4
    else:
        size = vocab * n_embd * (36 if not plan.gpu and _cpu_runs_repacked_gemms() else 34) // 32
    return (0, size) if on_gpu else (size, 0)


def tensor_sizes(header: GgufHeader) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor, in file order."""
    return [(t.name, t.n_bytes) for t in header.tensors]


def _reference_default_keys(header: GgufHeader, arch: str) -> list[str]:
    """The keys dg says it filled with the reference's defaults: only those dg adds and the file holds."""
    listed = header.get(REFERENCE_DEFAULTS_KEY)
    if not isinstance(listed, list):
        return []
    addable = [f"{arch}.final_logit_softcapping", *DIFFUSION_PARAM_KEYS]
    return [key for key in addable if key in listed and key in header.metadata]


def _scalar(header: GgufHeader, key: str, kind: type):
    """A scalar of the expected kind, or None (a malformed optional key reads as absent)."""
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        return None
    if kind is float:
        return float(f"{value:.7g}")  # float32 in the file: 0.3 instead of 0.30000001192092896
    return value


def declared_file_type(header: GgufHeader) -> str | None:
    """The quant the file says it is (`general.file_type`, as llama.cpp's quantizer writes it: 15 ->
    "Q4_K_M"), or None when the key is absent, not a uint32 or not a known type."""
    value = header.get("general.file_type")
    if header.type_of("general.file_type") != "uint32" or not isinstance(value, int):
        return None
    import gguf

    try:
        ftype = gguf.LlamaFileType(value)
    except ValueError:
        return None
    if ftype == gguf.LlamaFileType.GUESSED:
        return None
    return ftype.name.removeprefix("MOSTLY_").removeprefix("ALL_")


def dominant_weight_type(header: GgufHeader) -> str | None:
    """The type holding most bytes of the 2D weights (norms and scales stay F32 in every quant)."""
    weight_types: Counter = Counter()
    for t in header.tensors:
        if len(t.shape) >= 2:
            weight_types[t.type_name] += t.n_bytes
    return weight_types.most_common(1)[0][0] if weight_types else None


def quant_of(header: GgufHeader) -> str | None:
    """The file's quantization: general.file_type as the quantizer wrote it, else the dominant weight type."""
    return declared_file_type(header) or dominant_weight_type(header)


@dataclass(frozen=True)
class QuantPair:
    """The quantization types of the two files `dg compare` / `dg bench` time against each other."""

    diffusion: str | None
    autoregressive: str | None

    @property
    def match(self) -> bool:
        return self.diffusion == self.autoregressive

    def to_json(self) -> dict[str, Any]:
        return {"diffusion": self.diffusion, "autoregressive": self.autoregressive, "match": self.match}

    def mismatch_words(self) -> str | None:
        """One sentence for a table or a note when the types differ; None when they match."""
        if self.match:
            return None
        return (f"quantization differs: diffusion {self.diffusion or 'unknown'}, AR {self.autoregressive or 'unknown'} "
                "(the two sides' speeds are of different weight types)")


def quant_pair(diffusion_path: Path | str, ar_path: Path | str) -> QuantPair:
    return QuantPair(quant_of(read_header(diffusion_path)), quant_of(read_header(ar_path)))


def read_info(path: Path | str, *, n_gpu_layers: int = 0, n_cpu_moe: int = 0,
              gpus: list[GpuMemory] | None = None, n_ctx: int | None = None) -> GgufInfo:
    """What the file holds, and where its weights would go with this offload (gpus: detected when None),
    with the KV cache of a context of n_ctx tokens (0: the training context) when given. From the
    header alone: nothing is loaded, and arrays are not read."""
    return info_from_header(read_header(path), n_gpu_layers=n_gpu_layers, n_cpu_moe=n_cpu_moe, gpus=gpus,
                            n_ctx=n_ctx)


def context_cells(header: GgufHeader, n_ctx: int) -> int:
    """The KV cells a context of n_ctx tokens has; 0: the model's training context."""
    trained = header.arch("context_length")
    return n_ctx or (trained if isinstance(trained, int) and trained > 0 else KV_CONTEXT)


def info_from_header(header: GgufHeader, *, n_gpu_layers: int = 0, n_cpu_moe: int = 0,
                     gpus: list[GpuMemory] | None = None, n_ctx: int | None = None) -> GgufInfo:
    """read_info from a parsed header (a local file's, or one read from the Hub: dgcli.remote_gguf)."""
    import psutil

    arch = header.architecture
    if not arch:
        raise ModelLoadError(f"GGUF without general.architecture: {header.path}")

    histogram: dict[str, list[int]] = {}
    for t in header.tensors:
        row = histogram.setdefault(t.type_name, [0, 0, 0])
        row[0] += 1
        row[1] += t.n_elements
        row[2] += t.n_bytes
    types = sorted((TensorTypeCount(k, *v) for k, v in histogram.items()), key=lambda r: -r.bytes)

    filled = _reference_default_keys(header, arch)
    sampler, source = {}, {}
    if arch == DIFFUSION_ARCH:
        try:
            from_file = sampler_defaults(header)  # the reference's defaults for keys it lacks
        except ModelLoadError:  # a key of a non-numeric type: shown as the problem below
            from_file = None
        for key, name in DIFFUSION_PARAM_KEYS.items():
            in_file = from_file is not None and key in header.metadata
            sampler[name] = getattr(from_file if in_file else DiffusionParams(), name)
            source[name] = (FROM_DEFAULT if not in_file else
                            FROM_GGUF_REFERENCE_DEFAULT if key in filled else FROM_GGUF)
    try:
        check_tensors(check_model_header(header))
        problem = None
    except ModelLoadError as err:
        problem = str(err).removeprefix(f"{header.path}: ")

    vm = psutil.virtual_memory()
    if gpus is None:
        gpus = detect_gpus() if n_gpu_layers != 0 else []
    cells = context_cells(header, n_ctx) if n_ctx is not None else None
    plan, ram_need, gpu_need = header_plan(header, n_gpu_layers, n_cpu_moe, gpus, None if cells is None else (cells, 1))
    sc_ram, sc_gpu = self_cond_copy_bytes(header, plan)
    return GgufInfo(
        path=str(header.path),
        file_size=header.file_size,
        architecture=arch,
        name=_scalar(header, "general.name", str),
        parameter_count=sum(t.n_elements for t in header.tensors),
        tensor_count=len(header.tensors),
        tensor_types=types,
        file_type=quant_of(header),
        context_length=_scalar(header, f"{arch}.context_length", int),
        block_count=_scalar(header, f"{arch}.block_count", int),
        embedding_length=_scalar(header, f"{arch}.embedding_length", int),
        expert_count=_scalar(header, f"{arch}.expert_count", int),
        expert_used_count=_scalar(header, f"{arch}.expert_used_count", int),
        vocab_size=header.n_vocab,
        canvas_length=_scalar(header, "diffusion.canvas_length", int),
        sampler_defaults=sampler,
        sampler_defaults_source=source,
        final_logit_softcapping=_scalar(header, f"{arch}.final_logit_softcapping", float),
        reference_default_keys=filled,
        has_chat_template=isinstance(header.get("tokenizer.chat_template"), str),
        problem=problem,
        ram_total=vm.total,
        ram_available=vm.available,
        memory_needed=ram_need,
        gpu_layers=n_gpu_layers,
        n_cpu_moe=n_cpu_moe,
        gpu_name=", ".join(g.name for g in gpus) or None,
        gpu_total=sum(g.total for g in gpus),
        gpu_free=sum(g.free for g in gpus),
        gpu_needed=gpu_need,
        offloaded_layers=plan.gpu_layer_count,
        placement=plan.groups(),
        self_cond_bytes=sc_ram + sc_gpu,
        self_cond_on_gpu=sc_gpu > 0,
        kv_context=cells,
    )


def check_architecture(path: Path | str, *, diffusion: bool, command: str) -> str:
    """Refuse a GGUF of the wrong kind for `command`, or with a hyperparameter llama.cpp cannot
    take, before llama.cpp sees it."""
    header = read_header(path)
    arch = header.architecture
    if not arch:
        raise ModelLoadError(f"GGUF without general.architecture: {path}")
    if diffusion and arch != DIFFUSION_ARCH:
        raise ModelLoadError(
            f"{path} is a {arch!r} model, not a DiffusionGemma ({DIFFUSION_ARCH!r}) GGUF; "
            f"`dg {command}` needs a diffusion model (use it as --ar-model, or see `dg list`)"
        )
    if not diffusion and arch == DIFFUSION_ARCH:
        raise ModelLoadError(f"{path} is a diffusion model; the autoregressive side needs a stock gemma4 GGUF")
    check_tensors(check_model_header(header))
    return arch


# What llama.cpp's stock gemma4 loader takes as optional, or in another form, of the AR twin's layout
# (vendor/llama.cpp/src/models/gemma4.cpp): its tensors the loader requires are the rest.
_GEMMA4_OPTIONAL_ROLES = ("attn_v", "layer_scalar_encoder", "ffn_down_exps_scale")
_MOE_ROLES = ("ffn_gate_inp", "ffn_gate_inp_scale", "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2",
              "ffn_gate_up_exps", "ffn_down_exps", "ffn_down_exps_scale")


def missing_tensors(header: GgufHeader) -> list[str]:
    """The tensors of the file's layout (modelfile.layout: what dg's converter writes) that it lacks,
    in file order; for a gemma4 file, only those llama.cpp's stock loader requires. The header must
    have passed check_model_header (block_count and the sliding pattern are read from it)."""
    arch = header.architecture
    if arch not in (DIFFUSION_ARCH, AR_ARCH):
        return []
    pattern = [bool(v) for v in header.arch("attention.sliding_window_pattern")]
    have = {t.name for t in header.tensors}
    n_layer, shared = len(pattern), header.arch("attention.shared_kv_layers") or 0
    missing = []
    for name, role, il in layout_tensors(pattern, arch):
        if name in have or (role == "rope_freqs" and all(pattern)):  # only full layers use rope_freqs
            continue
        if arch == AR_ARCH:
            blk = f"blk.{il}."
            if (role in _GEMMA4_OPTIONAL_ROLES
                    or (role in ("attn_q", "attn_k") and blk + "attn_qkv.weight" in have)
                    or (role in ("attn_k", "attn_k_norm") and il >= n_layer - shared)  # shares an earlier KV cache
                    or (role in _MOE_ROLES and not header.arch("expert_count"))  # a dense gemma4
                    or (role == "ffn_gate_up_exps" and {blk + "ffn_gate_exps.weight", blk + "ffn_up_exps.weight"} <= have)):
                continue
        missing.append(name)
    return missing


def check_tensors(header: GgufHeader, shown: int = 4) -> None:
    """Refuse a GGUF without every tensor its layout needs (a converter that stopped early, a file
    edited by hand): llama.cpp would refuse it at load, or, for an optional one such as
    ffn_down_exps.scale, run without it."""
    missing = missing_tensors(header)
    if missing:
        more = f" and {len(missing) - shown} more" if len(missing) > shown else ""
        raise ModelLoadError(f"{header.path}: incomplete GGUF: {len(missing)} of its layout's tensors "
                             f"{'is' if len(missing) == 1 else 'are'} missing: {', '.join(missing[:shown])}{more}")


def check_fits_memory(path: Path | str, *, n_gpu_layers: int = 0, n_cpu_moe: int = 0,
                      gpus: list[GpuMemory] | None = None, n_ctx: int | None = None, n_seq: int = 1) -> None:
    """Refuse a model whose share does not fit in this machine's RAM, or in its GPU memory.

    RAM is compared against the total, not what is available: llama.cpp mmaps the file, so page cache
    is reusable. The GPU is compared against its free memory (another process's allocations stay).
    `n_ctx` (cells per sequence; 0: the training context) and `n_seq`: the KV cache of the context
    the load will ask for is counted too (llama.cpp clears it at once, so an oversized one is taken
    from RAM whole, and the kernel's OOM killer ends the process instead of an error).
    DG_SKIP_MEMORY_CHECK=1 skips it (e.g. for swap-backed experiments).
    """
    import psutil

    if os.environ.get("DG_SKIP_MEMORY_CHECK") == "1":
        return
    if gpus is None:
        gpus = detect_gpus() if n_gpu_layers != 0 else []
    header = read_header(path)
    context = None
    if n_ctx is not None:
        context = (context_cells(header, n_ctx), max(n_seq, 1))
    _, ram_need, gpu_need = header_plan(header, n_gpu_layers, n_cpu_moe, gpus, context)
    name, total = Path(path).name, psutil.virtual_memory().total
    if context is not None and ram_need > total and header_plan(header, n_gpu_layers, n_cpu_moe, gpus)[1] <= total:
        cells, n_seq = context
        asked = f"{n_seq} sequences of {cells} tokens" if n_seq > 1 else f"a context of {cells} tokens"
        raise TooBigForMemory(f"{name} with {asked} needs about {format_bytes(ram_need)} of RAM (most of it the KV "
                              f"cache and attention scores) but this machine has {format_bytes(total)}; use a smaller --ctx-size"
                              + (" or --parallel" if n_seq > 1 else ""))
    if ram_need > total:
        if any(g.metal for g in gpus):
            hint = "use a smaller quant (a Mac's GPU memory is its RAM: offloading frees none)"
        else:
            hint = ("offload more to the GPU (--gpu-layers, or a smaller --n-cpu-moe)" if gpu_need
                    else "use a smaller quant, or offload layers to a GPU with --gpu-layers")
        raise TooBigForMemory(f"{name} needs about {format_bytes(ram_need)} of RAM but this machine has "
                              f"{format_bytes(total)}; {hint}")
    free = sum(g.free for g in gpus)
    if gpu_need > free:
        fit = smallest_fitting_n_cpu_moe(path, n_gpu_layers, gpus)
        hint = f"try --n-cpu-moe {fit}" if fit is not None and fit > max(n_cpu_moe, 0) else "offload fewer layers (--gpu-layers)"
        raise TooBigForMemory(f"{name} needs about {format_bytes(gpu_need)} of GPU memory with "
                              f"{_offload_words(n_gpu_layers, n_cpu_moe)}, but {', '.join(g.name for g in gpus)} has "
                              f"{format_bytes(free)} free; {hint}")


def _offload_words(n_gpu_layers: int, n_cpu_moe: int) -> str:
    layers = "every layer offloaded" if n_gpu_layers < 0 else f"{n_gpu_layers} layers offloaded"
    experts = {0: "", -1: ", all experts in RAM", 1: ", the first layer's experts in RAM"}.get(
        n_cpu_moe, f", the first {n_cpu_moe} layers' experts in RAM")
    return layers + experts


def smallest_fitting_n_cpu_moe(path: Path | str, n_gpu_layers: int, gpus: list[GpuMemory]) -> int | None:
    """The fewest layers whose experts must stay in RAM for the rest to fit the GPUs' free memory
    (None: not even with every expert in RAM)."""
    header = read_header(path)
    n_layer = header.get(f"{header.architecture}.block_count")
    if not isinstance(n_layer, int) or not gpus:
        return None
    free = sum(g.free for g in gpus)

    def gpu_need(n: int) -> int:
        return header_plan(header, n_gpu_layers, n, gpus)[2]

    if gpu_need(n_layer) > free:
        return None
    lo, hi = 0, n_layer  # the GPU's need falls as N grows: the first N that fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if gpu_need(mid) <= free else (mid + 1, hi)
    return lo
