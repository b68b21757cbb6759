"""Where a model's weights live: GPU offload, expert tensors kept in system memory, and the plan.

llama.cpp's rules, which dg follows and predicts:
- the layers are the model's n_layer blocks plus the output layer (output norm + LM head) as layer
  n_layer; `n_gpu_layers` offloads the LAST ones (-1: all n_layer + 1), the token embedding (input)
  always stays in system memory; a tied LM head is a second copy of the embedding, placed with the
  output layer (with it, diffusion-gemma's self-conditioning block);
- `n_cpu_moe` (llama.cpp's --n-cpu-moe) keeps the expert tensors (`blk.N.ffn_*_exps.*`) of the
  first N layers in system memory through a tensor buffer-type override (the pattern below, as
  llama.cpp's common/arg.cpp writes it); -1 keeps every layer's experts there (--cpu-moe). A
  26B-A4B MoE reads only 8 of 128 experts per token, so its experts are the cheapest weights to
  leave on the CPU: the attention, the dense FFN and the head stay on the GPU.

`plan_placement` predicts from the GGUF's tensor list (no loading) how many bytes each side holds;
`LoadReport.from_log` reads what llama.cpp actually did from its load log.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Iterable

from dgcli.errors import InvalidParameter

# llama.cpp's LLM_FFN_EXPS_REGEX (common/common.h): the expert weights of a MoE layer.
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
_BLOCK = re.compile(r"^blk\.(\d+)\.")
# llama.cpp's output layer: the final norm, the LM head and (diffusion-gemma) the self-conditioning block
OUTPUT_LAYER_TENSORS = ("output.", "output_norm.", "self_cond_")


def check_offload(n_gpu_layers: int, n_cpu_moe: int) -> None:
    for name, value in (("n_gpu_layers", n_gpu_layers), ("n_cpu_moe", n_cpu_moe)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise InvalidParameter(name, value, "-1 (all) or an integer >= 0")


def expert_override_pattern(n_cpu_moe: int, n_layer: int) -> str | None:
    """The regex (std::regex ECMAScript, searched in each tensor name) selecting the expert tensors
    that stay in system memory, or None when none do."""
    if n_cpu_moe == 0:
        return None
    if n_cpu_moe > n_layer:
        raise InvalidParameter("n_cpu_moe", n_cpu_moe, f"-1 (all) or at most the model's {n_layer} layers")
    if n_cpu_moe < 0 or n_cpu_moe == n_layer:
        return EXPERT_TENSORS
    # one alternation instead of llama.cpp's one pattern per layer: the loader tries every pattern on
    # every tensor; `blk\.1\.` cannot match blk.11
    layers = "|".join(str(i) for i in range(n_cpu_moe))
    return rf"^blk\.({layers}){EXPERT_TENSORS}"


# the decoder's dense weights dg's GEMMs take (native: dense() and dense_tiled() in the graph)
_DENSE_WEIGHT = re.compile(r"^blk\.(\d+)\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight$|^self_cond_(gate|up|down)\.weight$")
# the weight types dg's K-quant tiles run (AVX2, and AVX-512 VNNI's dense weights)
TILED_TYPES = ("Q4_K", "Q6_K")


def tiled_weight_pattern(header, expert_kernel: int, dense_kernel: int, gpu_in_use: bool) -> str | None:
    """The override pattern keeping a diffusion-gemma file's Q4_K and Q6_K weights that dg's own K-quant
    tiles run out of llama.cpp's CPU repack buffers, or None: the tiles read the file's layout, which a
    repack buffer changes. They run where no GPU is in use (the experts on AVX2's kernel 1, the dense
    weights on AVX2's or AVX-512 VNNI's, kernel 1 or 2), on the weights where
    they are measured faster than ggml's repacked kernels (docs/performance.md): the experts (native
    `dg_expert_kernel()`; ggml's repacked MUL_MAT_ID runs a canvas's experts one token at a time) and
    the dense weights (`dg_dense_kernel()`).
    The tied Q6_K LM head needs no pattern: llama.cpp's CPU repack does not take it."""
    if header.architecture != "diffusion-gemma" or gpu_in_use:
        return None
    # DG_Q6_K_TILE=0 leaves the Q6_K ones to ggml, as the native side then does (A/B runs)
    types = [t for t in TILED_TYPES if not (t == "Q6_K" and os.environ.get("DG_Q6_K_TILE") == "0")]
    tiled = [t.name for t in header.tensors if t.type_name in types]
    parts = []
    if expert_kernel == 1 and any(re.search(EXPERT_TENSORS, name) for name in tiled):
        parts.append(EXPERT_TENSORS)
    if dense_kernel in (1, 2):
        # by name, these types only (a repack buffer stays the faster home of any other type it takes),
        # one alternation of layers per weight: llama.cpp compiles the pattern anew for every tensor
        layers: dict[str, list[str]] = {}
        for name in tiled:
            if m := _DENSE_WEIGHT.match(name):
                role = name.split(".", 2)[2] if m[1] is not None else name
                layers.setdefault(role, []).append(m[1])
        for role, numbers in layers.items():
            escaped = re.escape(role)
            parts.append(rf"^{escaped}$" if numbers == [None] else rf"^blk\.({'|'.join(numbers)})\.{escaped}$")
    return "|".join(parts) or None


def expert_repack_pattern(header, takes) -> str | None:
    """The override pattern sending a diffusion-gemma file's expert tensors to dg's expert buffer (native
    `dg_expert_buffer_type`: repacked while loading for dg's int8 GEMM, MUL_MAT_ID on them runs it), or
    None: the tensors `takes(type_id, row_length)` accepts, by layer and role (one alternation of layers
    per role: llama.cpp compiles the pattern anew for every tensor)."""
    if header.architecture != "diffusion-gemma":
        return None
    layers: dict[str, list[str]] = {}
    for t in header.tensors:
        m = _BLOCK.match(t.name)
        if m and re.search(EXPERT_TENSORS, t.name) and takes(t.type_id, t.shape[0]):
            layers.setdefault(t.name.split(".", 2)[2], []).append(m[1])
    return "|".join(rf"^blk\.({'|'.join(numbers)})\.{re.escape(role)}$" for role, numbers in layers.items()) or None


def first_gpu_layer(n_gpu_layers: int, n_layer: int) -> int:
    """Layers il >= this one are offloaded (il == n_layer is the output layer)."""
    n = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
    return n_layer + 1 - n


@dataclass
class TensorPlace:
    name: str
    nbytes: int
    layer: int | None  # None: the input (token embedding) and unlayered tensors
    on_gpu: bool
    expert: bool = False


@dataclass
class PlacementPlan:
    """The predicted split of the weights between system memory and the GPU."""

    n_layer: int
    n_gpu_layers: int
    n_cpu_moe: int
    gpu: bool  # False: no GPU backend, everything stays in system memory
    tensors: list[TensorPlace] = field(default_factory=list)

    @property
    def ram_weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if not t.on_gpu)

    @property
    def gpu_weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.on_gpu)

    @property
    def gpu_layer_count(self) -> int:
        return 0 if not self.gpu else self.n_layer + 1 - first_gpu_layer(self.n_gpu_layers, self.n_layer)

    def groups(self) -> list[tuple[str, str, int, int]]:
        """(what, where, tensors, bytes) rows in first-seen order: the table `dg info` prints."""
        acc: dict[tuple[str, str], list] = {}
        for t in self.tensors:
            if t.layer is None:
                what = "token embedding (input)" if t.name.startswith("token_embd") else "RoPE frequencies"
            elif t.layer == self.n_layer:
                what = "output (norm, LM head, self-conditioning)"
            else:
                what = "experts" if t.expert else "attention, router, dense FFN"
            row = acc.setdefault((what, "GPU" if t.on_gpu else "RAM"), [0, 0, set()])
            row[0] += 1
            row[1] += t.nbytes
            if t.layer is not None and t.layer < self.n_layer:
                row[2].add(t.layer)
        return [((f"layers {layer_ranges(layers)} " if layers else "") + what, where, count, nbytes)
                for (what, where), (count, nbytes, layers) in acc.items()]


def layer_ranges(layers: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> '0-2, 5'."""
    out: list[str] = []
    for n in sorted(layers):
        if out and n == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def plan_placement(tensors: Iterable[tuple[str, int]], n_layer: int, n_gpu_layers: int, n_cpu_moe: int,
                   gpu: bool) -> PlacementPlan:
    """Predict where each weight goes (llama.cpp's rules, module docstring) from (name, bytes) pairs."""
    check_offload(n_gpu_layers, n_cpu_moe)
    pattern = expert_override_pattern(n_cpu_moe, n_layer)  # validates N even when nothing is offloaded
    regex = re.compile(pattern) if pattern and gpu else None
    start = first_gpu_layer(n_gpu_layers, n_layer) if gpu else n_layer + 1
    plan = PlacementPlan(n_layer=n_layer, n_gpu_layers=n_gpu_layers, n_cpu_moe=n_cpu_moe, gpu=gpu)
    names = []
    for name, nbytes in tensors:
        names.append(name)
        block = _BLOCK.match(name)
        if block:
            layer: int | None = int(block.group(1))
        elif name.startswith(OUTPUT_LAYER_TENSORS):
            layer = n_layer
        else:
            layer = None
        expert = bool(re.search(EXPERT_TENSORS, name))
        on_gpu = layer is not None and layer >= start and not (regex is not None and regex.search(name))
        plan.tensors.append(TensorPlace(name, int(nbytes), layer, on_gpu, expert))
    # a tied LM head on the GPU: llama.cpp loads the embedding a second time, there (on the CPU both
    # name the same mapped bytes)
    if "output.weight" not in names and n_layer >= start:
        embd = next((t for t in plan.tensors if t.name == "token_embd.weight"), None)
        if embd is not None:
            plan.tensors.append(TensorPlace("output.weight (tied: token_embd.weight)", embd.nbytes, n_layer, True))
    return plan


# -- what llama.cpp did ----------------------------------------------------------------------------

_BUFFER = re.compile(r"(\S+) (model|KV|compute) buffer size =\s*([\d.]+) MiB")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_OVERRIDE = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")


def mib_bytes(mib: float) -> int:
    """A size llama.cpp logged in MiB, in bytes."""
    return round(mib * 2**20)


@dataclass
class LoadReport:
    """Placement as llama.cpp's load log states it (its INFO and DEBUG lines)."""

    offloaded_layers: int | None = None  # None: the library has no GPU offload
    total_layers: int | None = None
    buffers: list[tuple[str, str, float]] = field(default_factory=list)  # (buffer, kind, MiB)
    overridden: list[tuple[str, str]] = field(default_factory=list)  # (tensor, buffer type)
    no_gpu_reason: str = ""  # with offloaded_layers None: why (native.no_gpu_reason())

    @classmethod
    def from_log(cls, lines: Iterable[str]) -> "LoadReport":
        report = cls()
        for line in lines:
            if m := _OFFLOADED.search(line):
                report.offloaded_layers, report.total_layers = int(m[1]), int(m[2])
            elif m := _BUFFER.search(line):
                report.buffers.append((m[1], m[2], float(m[3])))
            elif m := _OVERRIDE.search(line):
                report.overridden.append((m[1], m[2]))
        # a build with the RPC backend counts as able to offload and logs "offloaded N/N layers" even
        # with no device to put them on: what counts is a model buffer outside system memory
        if report.offloaded_layers and any(kind == "model" for _, kind, _ in report.buffers) \
                and all(name.startswith("CPU") for name, kind, _ in report.buffers if kind == "model"):
            report.offloaded_layers = None
        return report

    def why_cpu_only(self) -> str:
        """With offloaded_layers None: why llama.cpp kept every weight in system memory."""
        return self.no_gpu_reason or "this llama.cpp build has no GPU offload"

    def offload_missed(self, n_gpu_layers: int) -> str | None:
        """Why nothing was offloaded though `n_gpu_layers` asked for it; None when it was, or was not asked."""
        return self.why_cpu_only() if n_gpu_layers != 0 and self.offloaded_layers is None else None

    def output_on(self, backend_prefix: str) -> bool:
        """Whether the output layer (offloaded last: "offloaded N/N layers") went to a device whose buffers'
        names start with `backend_prefix` ("MTL" for ggml-metal's MTL0, MTL0_Mapped, ...)."""
        return (self.offloaded_layers is not None and self.offloaded_layers == self.total_layers
                and any(name.startswith(backend_prefix) for name, kind, _ in self.buffers if kind == "model"))

    def mib_by_device(self) -> dict[str, float]:
        """Buffer MiB per device name (CUDA0, CPU; a `_Mapped`/`_REPACK` suffix is the same memory)."""
        out: dict[str, float] = {}
        for name, _kind, mib in self.buffers:
            device = name.split("_")[0]
            out[device] = out.get(device, 0.0) + mib
        return out

    def to_json(self) -> dict:
        """Buffer sizes in bytes, as every size in dg's JSON (llama.cpp logs MiB to 2 decimals: each is
        good to 0.005 MiB, 5,243 bytes)."""
        return dict(offloaded_layers=self.offloaded_layers, total_layers=self.total_layers,
                    buffers=[dict(buffer=b, kind=k, bytes=mib_bytes(m)) for b, k, m in self.buffers],
                    overridden=[dict(tensor=t, buffer_type=b) for t, b in self.overridden],
                    **({"no_gpu_reason": self.no_gpu_reason} if self.no_gpu_reason else {}))
