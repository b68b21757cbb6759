"""Which ops of dg's one-graph step ggml's GPU backends take, asked of their own supports_op.

ggml-metal: its `ggml_metal_device_supports_op` (and the helper it calls) are cut out of the
vendored ggml-metal-device.m, compiled with the host's C compiler against ggml's headers with the
device object stubbed to its properties (tests/opcheck/), and asked about every node of the step as
llama.cpp builds it for a GPU, captured on the CPU through llama.cpp's eval callback.
ggml-cuda: its `ggml_backend_cuda_device_supports_op` needs CUDA's headers and a device to run, so
it is read as text: each op of the step must have its own case, and the conditions of those cases
are checked against the captured nodes (`CUDA_CONDITIONS`).

Both texts are pinned by hash (METAL_SHA256, CUDA_SHA256 in tests/test_backend_ops.py): a new
llama.cpp changes them and the test says to re-read them against the stubs and the conditions here.

    python tests/backend_ops.py capture MODEL HARNESS   # (the test's subprocess) one JSON line per graph
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPCHECK_DIR = Path(__file__).resolve().parent / "opcheck"
VENDOR = "vendor/llama.cpp"
METAL_DEVICE_SOURCE = "ggml/src/ggml-metal/ggml-metal-device.m"
METAL_COMMON_SOURCE = "ggml/src/ggml-metal/ggml-metal-common.cpp"
METAL_SOURCE = "ggml/src/ggml-metal/ggml-metal.cpp"
CUDA_SOURCE = "ggml/src/ggml-cuda/ggml-cuda.cu"
CUDA_FATTN_SOURCE = "ggml/src/ggml-cuda/fattn.cu"

# The functions cut out of ggml-metal, in the order they are compiled: supports_op, the helpers it
# calls that decide between matrix kernels (ggml-metal-common.cpp, C++ only in name), and the bytes
# its buffers allocate for a node (scratch for some ops beyond the tensor itself).
METAL_FUNCTIONS = ((METAL_COMMON_SOURCE, "static bool ggml_metal_fwht_supported_size("),
                   (METAL_COMMON_SOURCE, "bool ggml_metal_op_mul_mat_use_fwht("),
                   (METAL_COMMON_SOURCE, "bool ggml_metal_op_mul_mat_use_mm("),
                   (METAL_COMMON_SOURCE, "bool ggml_metal_op_mul_mat_id_use_mm("),
                   (METAL_DEVICE_SOURCE, "static bool ggml_metal_supports_mul_mat_op("),
                   (METAL_DEVICE_SOURCE, "bool ggml_metal_device_supports_op("),
                   (METAL_SOURCE, "static size_t ggml_backend_metal_buffer_type_get_alloc_size("))
# ggml-cuda's supports_op, the flash-attention kernel choice its FLASH_ATTN_EXT case defers to, and
# the definitions CUDA_CONDITIONS relies on (the K/V types, the KV stride, when CUB is used).
CUDA_SOURCES = ((CUDA_SOURCE, "static bool ggml_backend_cuda_device_supports_op("),
                (CUDA_FATTN_SOURCE, "static best_fattn_kernel ggml_cuda_get_best_fattn_kernel("),
                (CUDA_FATTN_SOURCE, "static bool ggml_cuda_fattn_kv_type_supported("),
                ("ggml/src/ggml-cuda/fattn-common.cuh", "#define FATTN_KQ_STRIDE"),
                ("ggml/src/ggml-cuda/common.cuh", "#if !defined(GGML_USE_HIP) && (defined(GGML_USE_MUSA) || CUDART_VERSION >= 11070)"))

# The environment of the capture: ggml's matmuls everywhere (dg's CPU GEMMs are CPU-only custom ops
# that a GPU never sees), weights outside the CPU's repack buffers, flash attention on (as where a GPU
# runs the context; a CPU-only one runs the attention as matmuls).
GPU_FORM_ENV = {"DG_LM_HEAD": "ggml", "DG_DENSE_GEMM": "ggml", "DG_EXPERT_GEMM": "ggml", "DG_CPU_REPACK": "0",
                "DG_FLASH_ATTN": "1"}


def _load_build_module():
    spec = importlib.util.spec_from_file_location("dg_native_build", ROOT / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vendored_llama_cpp() -> Path:
    """The vendored llama.cpp of the pinned sdist, as native/build.py extracts it (from its cache); where
    our patch changes ggml (dg's CUDA kernels touch ggml-cuda's supports_op), a copy of its ggml/ with
    the patched files over it, in a temporary folder, so that the checks read what is built."""
    build = _load_build_module()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = build.fetch_sdist(Path(tmp) / "fetch.log")
        vendor = build.extract_pristine(sdist) / VENDOR
        patched = {rel: data for rel, data in build.patched_contents(vendor, Path(tmp) / "patch.log").items()
                   if rel.startswith("ggml/")}
    if not patched:
        return vendor
    copy = Path(tempfile.mkdtemp(prefix="dg-opcheck-src-"))
    shutil.copytree(vendor / "ggml", copy / "ggml", symlinks=True)
    for rel, data in patched.items():
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes(data)
    return copy


# -- cutting functions out of C sources ------------------------------------------------------------------


def _skip_literal_or_comment(text: str, i: int) -> int:
    """The index after the comment or literal starting at i, or i when none starts there."""
    if text.startswith("//", i):
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if text.startswith("/*", i):
        end = text.find("*/", i + 2)
        if end < 0:
            raise ValueError("unterminated comment")
        return end + 2
    if text[i] in "\"'":
        quote, j = text[i], i + 1
        while j < len(text) and text[j] != quote:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    return i


def extract_function(text: str, head: str) -> str:
    """The definition starting with `head` (a unique prefix of its signature) up to its closing brace."""
    starts = [m.start() for m in re.finditer(re.escape(head), text)]
    if len(starts) != 1:
        raise ValueError(f"{head!r} occurs {len(starts)} times")
    i = text.index("{", starts[0])
    depth = 0
    while i < len(text):
        j = _skip_literal_or_comment(text, i)
        if j != i:
            i = j
            continue
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[starts[0]:i + 1]
        i += 1
    raise ValueError(f"no closing brace for {head!r}")


def functions_text(llama: Path, functions: tuple[tuple[str, str], ...]) -> str:
    return "\n\n".join(extract_function((llama / path).read_text(), head) for path, head in functions) + "\n"


def metal_function_text(llama: Path) -> str:
    return functions_text(llama, METAL_FUNCTIONS)


def cuda_function_text(llama: Path) -> str:
    """The CUDA_SOURCES: functions whole, other heads as their line (the #if with the line after it)."""
    parts = []
    for path, head in CUDA_SOURCES:
        text = (llama / path).read_text()
        if head.startswith("#"):
            lines = text[text.index(head):].splitlines()
            parts.append("\n".join(lines[:2] if head.startswith("#if") else lines[:1]))
        else:
            parts.append(extract_function(text, head))
    return "\n\n".join(parts) + "\n"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- the Metal harness ----------------------------------------------------------------------------------


def llama_lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama_cpp is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def _ggml_base_library(lib_dir: Path) -> Path:
    """The file of libggml-base that libllama loads (its soname where the wheel has one)."""
    for name in ("libggml-base.so.0", "libggml-base.so", "libggml-base.0.dylib", "libggml-base.dylib"):
        if (lib_dir / name).exists():
            return lib_dir / name
    raise RuntimeError(f"no libggml-base in {lib_dir}")


def build_metal_harness(llama: Path, out_dir: Path) -> Path:
    """tests/opcheck/harness.c with ggml-metal's supports_op, as one shared library linked to the
    installed libggml-base (ggml's own tensor helpers). Returns its path."""
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        raise RuntimeError(f"no C compiler ({cc}) to build ggml-metal's supports_op")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metal_supports_op.inc").write_text(
        "// cut from ggml-metal by tests/backend_ops.py (METAL_FUNCTIONS)\n\n" + metal_function_text(llama))
    ggml = llama / "ggml"
    includes = [f"-I{d}" for d in (out_dir, OPCHECK_DIR, ggml / "include", ggml / "src", ggml / "src" / "ggml-metal")]
    lib_dir = llama_lib_dir()
    base = _ggml_base_library(lib_dir)
    harness = out_dir / ("libdgopcheck.dylib" if sys.platform == "darwin" else "libdgopcheck.so")
    cmd = [cc, "-std=c11", "-O1", "-fPIC", "-shared", "-w", *includes, str(OPCHECK_DIR / "harness.c"), "-o",
           str(harness), str(base), f"-Wl,-rpath,{lib_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building ggml-metal's supports_op failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    return harness


def load_harness(path: Path):
    import ctypes

    lib = ctypes.CDLL(str(path))
    lib.dg_opcheck_eval.restype = ctypes.c_bool
    lib.dg_opcheck_eval.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p]
    lib.dg_opcheck_line.restype = ctypes.c_char_p
    lib.dg_opcheck_line.argtypes = [ctypes.c_int]
    lib.dg_opcheck_profile_name.restype = ctypes.c_char_p
    lib.dg_opcheck_profile_name.argtypes = [ctypes.c_int]
    lib.dg_opcheck_probe.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


def profile_names(lib) -> list[str]:
    return [lib.dg_opcheck_profile_name(i).decode() for i in range(lib.dg_opcheck_profiles())]


# -- nodes ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    type: str
    ne: tuple[int, int, int, int]
    layout: str  # harness.c's letters: c contiguous, 1, 2, r rows, t transposed, e packed elements, 3

    @classmethod
    def parse(cls, text: str) -> "Tensor | None":
        if text == "-":
            return None
        type_name, ne, layout = text.split(":")
        return cls(type_name, tuple(int(v) for v in ne.split(",")), layout)


@dataclass(frozen=True)
class Node:
    graph: str
    name: str
    op: str
    sub: str  # the unary or GLU op, "-" for others
    tensor: Tensor
    src: tuple["Tensor | None", ...]
    op_params: tuple[int, int, int, int]
    metal_alloc: int  # the bytes a Metal buffer allocates for the node (get_alloc_size)
    metal: tuple[bool, ...]  # supports_op per harness profile

    @property
    def kind(self) -> str:
        return self.op if self.sub == "-" else f"{self.op}:{self.sub}"

    @classmethod
    def parse(cls, graph: str, line: str) -> "Node":
        name, op, sub, tensor, *rest = line.split("\t")
        srcs, params, alloc, metal = rest[:4], rest[4], rest[5], rest[6]
        return cls(graph, name, op, sub, Tensor.parse(tensor), tuple(Tensor.parse(s) for s in srcs),
                   tuple(int(v) for v in params.split(",")), int(alloc), tuple(v == "1" for v in metal.split(",")))


def nodes_from_capture(lines: list[str]) -> list[Node]:
    out = []
    for line in lines:
        record = json.loads(line)
        out.extend(Node.parse(record["graph"], node) for node in record["nodes"])
    return out


# -- ggml-cuda's supports_op as text ---------------------------------------------------------------------


def switch_cases(body: str) -> dict[str, str]:
    """`case X:` label -> the text of its case group, for the outermost switch in `body` (labels of
    nested switches are not its own)."""
    start = body.index("switch (op->op)")
    i = body.index("{", start) + 1
    depth, groups, current = 1, {}, None
    group_start = i
    while i < len(body) and depth:
        j = _skip_literal_or_comment(body, i)
        if j != i:
            i = j
            continue
        ch = body[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 1 and (body.startswith("case ", i) or body.startswith("default:", i)):
            m = re.match(r"case\s+(\w+)\s*:|default\s*:", body[i:])
            if current is not None and body[group_start:i].strip():  # the previous group ends here
                for label in current:
                    groups[label] = body[group_start:i]
                current = None
            if current is None:
                current = []
            current.append(m.group(1) or "default")
            i += m.end()
            group_start = i
            continue
        i += 1
    if current:
        for label in current:
            groups[label] = body[group_start:i - 1]
    return groups


def nested_cases(group: str, switch_on: str) -> dict[str, str]:
    """The same for the nested `switch (switch_on)` inside a case group (UNARY, GLU)."""
    return switch_cases(group.replace(f"switch ({switch_on})", "switch (op->op)", 1))


def unconditional(group: str) -> bool:
    """A case group that is `return true;` and nothing else (braces and a `break;` aside)."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", group, flags=re.S)
    return re.fullmatch(r"\{?\s*return\s+true\s*;\s*\}?\s*(break\s*;)?", code.strip()) is not None


def cuda_case_groups(function_text: str) -> dict[str, str]:
    """Each op kind (as Node.kind names them: "MUL_MAT", "UNARY:TANH", "GLU:GEGLU") -> its case group
    in ggml-cuda's supports_op; the unary and GLU sub-ops have their nested switch's group."""
    body = extract_function(function_text, CUDA_SOURCES[0][1])
    top = switch_cases(body)
    out = {label.removeprefix("GGML_OP_"): text for label, text in top.items()}
    for op, on, prefix in (("UNARY", "ggml_get_unary_op(op)", "GGML_UNARY_OP_"), ("GLU", "ggml_get_glu_op(op)", "GGML_GLU_OP_")):
        for label, text in nested_cases(top[f"GGML_OP_{op}"], on).items():
            if label != "default":
                out[f"{op}:{label.removeprefix(prefix)}"] = text
    return out


# ggml-cuda's conditions for the case groups of the ops dg's graphs use that are not `return true;`,
# as read in the texts CUDA_SHA256 pins (tests/test_backend_ops.py), over the captured nodes.
FLOATS = {"f32", "f16"}
CUDA_MUL_MAT_TYPES = {"f32", "f16", "q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "nvfp4", "q2_K",
                      "q3_K", "q4_K", "q5_K", "q6_K", "q8_K", "iq1_m", "iq1_s", "iq2_s", "iq2_xs", "iq2_xxs", "iq3_s",
                      "iq3_xxs", "iq4_nl", "iq4_xs", "bf16"}
CUDA_GET_ROWS_TYPES = {"f16", "f32", "bf16", "i32", "q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K",
                       "q4_K", "q5_K", "q6_K", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "iq4_xs"}
CUDA_CPY_PAIRS = {("f32", "q8_0"), ("q8_0", "f32"), ("f32", "q4_0"), ("q4_0", "f32"), ("f32", "q4_1"), ("q4_1", "f32"),
                  ("f32", "q5_0"), ("q5_0", "f32"), ("f32", "q5_1"), ("q5_1", "f32"), ("f32", "iq4_nl"), ("f32", "i32"),
                  ("i32", "f32"), ("i32", "i32")}
CUDA_SET_ROWS_TYPES = {"f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"}
CUDA_FATTN_KV_TYPES = {"f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"}
CUDA_FATTN_KQ_STRIDE = 256
GGML_PREC_F32 = 10
QUANTIZED = {"q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "mxfp4", "nvfp4", "q2_K", "q3_K", "q4_K",
             "q5_K", "q6_K", "q8_K", "iq1_m", "iq1_s", "iq2_s", "iq2_xs", "iq2_xxs", "iq3_s", "iq3_xxs", "iq4_nl",
             "iq4_xs", "tq1_0", "tq2_0"}


def _binary(n: Node) -> bool:  # ADD, SUB, MUL, DIV without BF16
    return n.src[0].type in FLOATS and n.src[1].type in FLOATS and n.tensor.type in FLOATS


def _mul_mat(n: Node) -> bool:  # a bf16 src1 aside: dg's activations are F32
    a, b = n.src[0], n.src[1]
    if "e" not in a.layout or "e" not in b.layout or (b.type == "f16" and a.type != "f16"):
        return False
    if n.op == "MUL_MAT_ID" and n.op_params[3] == GGML_PREC_F32:
        return False
    return a.type in CUDA_MUL_MAT_TYPES


def _flash_attn(n: Node) -> bool:  # ggml_cuda_get_best_fattn_kernel(...) != BEST_FATTN_KERNEL_NONE
    q, k, v, mask = n.src
    gqa_ratio = q.ne[2] // k.ne[2]
    max_bias_is_zero = n.op_params[1] == 0  # the float's bits
    gqa_opt = (gqa_ratio >= 2 and mask is not None and max_bias_is_zero and k.ne[1] % CUDA_FATTN_KQ_STRIDE == 0
               and all("a" in t.layout for t in (q, k, v, mask) if t is not None and t.type not in QUANTIZED))
    head = k.ne[0]
    if head in (40, 64, 72, 80, 96, 112, 128, 256):
        heads_ok = v.ne[0] == head
    elif head == 512:
        heads_ok = v.ne[0] == head and gqa_opt
    else:  # 192, 320, 576 are other models' shapes: not read into this table
        heads_ok = False
    return (heads_ok and k.type in CUDA_FATTN_KV_TYPES and v.type in CUDA_FATTN_KV_TYPES
            and (mask is None or mask.ne[2] == 1))


CUDA_CONDITIONS = {
    "ADD": _binary, "SUB": _binary, "MUL": _binary, "DIV": _binary,
    "MUL_MAT": _mul_mat, "MUL_MAT_ID": _mul_mat,
    "OUT_PROD": lambda n: n.tensor.type == "f32" and n.src[0].type == "f32" and n.src[1].type == "f32",
    "GET_ROWS": lambda n: n.src[0].type in CUDA_GET_ROWS_TYPES or (
        n.src[0].type in ("iq4_nl", "mxfp4") and n.src[0].ne[0] % 256 == 0),
    "SET_ROWS": lambda n: ((n.tensor.type in CUDA_SET_ROWS_TYPES and n.src[0].type == "f32")
                           or (n.tensor.type == "f16" and n.src[0].type == "f16")) and n.src[1].type in ("i64", "i32"),
    "CPY": lambda n: ((n.src[0].type in FLOATS | {"bf16"} and n.src[1].type in FLOATS | {"bf16"})
                      or (n.src[0].type, n.src[1].type) in CUDA_CPY_PAIRS
                      or (n.src[0].type == n.src[1].type and "c" in n.src[0].layout and "c" in n.src[1].layout)),
    "REPEAT": lambda n: n.src[0].type in FLOATS,
    "CONCAT": lambda n: (n.src[0].type == n.src[1].type == n.tensor.type and n.src[0].type not in QUANTIZED),
    "RMS_NORM": lambda n: "r" in n.src[0].layout,
    "ROPE": lambda n: "e" in n.src[0].layout and "2" in n.src[0].layout,
    "SCALE": lambda n: n.src[0].type in ("f32", "bf16") and n.tensor.type == n.src[0].type,
    "SUM_ROWS": lambda n: n.src[0].type == "f32" and n.tensor.type == "f32" and "r" in n.src[0].layout,
    # with CUB (CUDART_VERSION >= 11070: every CUDA dg builds for, 12 and 13) any row; else rows of 1024
    "TOP_K": lambda n: True,
    "ARGSORT": lambda n: True,
    "UNARY:NEG": lambda n: "c" in n.src[0].layout,
    "UNARY:STEP": lambda n: "c" in n.src[0].layout,
    "UNARY:TANH": lambda n: "c" in n.src[0].layout,
    "UNARY:EXP": lambda n: "c" in n.src[0].layout,
    "GLU:GEGLU": lambda n: "1" in n.src[0].layout,
    "FLASH_ATTN_EXT": _flash_attn,
    # dg's patch: its step op and the view after it, only where libllama registered them with
    # ggml-cuda (DG_CUDA_FUSED_STEP; docs/gpu.md, "dg's CUDA kernels"); the GPU form captured here
    # has no custom op, and no other custom op is taken
    "CUSTOM": lambda n: False,
}


def cuda_verdicts(nodes: list[Node], groups: dict[str, str]) -> list[tuple[Node, str]]:
    """(node, why not) for every node ggml-cuda would not take, read from its case group's text."""
    out = []
    for n in nodes:
        group = groups.get(n.kind)
        if group is None or n.kind == "default":
            out.append((n, "no case in ggml-cuda's supports_op"))
        elif unconditional(group):
            continue
        elif n.kind not in CUDA_CONDITIONS:
            out.append((n, "its case has conditions tests/backend_ops.py has not read (CUDA_CONDITIONS)"))
        elif not CUDA_CONDITIONS[n.kind](n):
            out.append((n, "its case's condition is false for this node"))
    return out


# -- the capture (run in its own process: the GPU form's environment, a real-size model) -----------------


def capture(model: Path, harness: Path, canvas_tokens: int = 256, top_k: int = 64) -> list[dict]:
    """The graphs a generation runs, each node as harness.c records it: the prompt's prefill, the
    one-graph step in the ggml-ops form a GPU backend gets, self-conditioned in both forms (top-k in
    with the next step's top-k out; dense, the default: the soft embedding in, the next one's product
    out) and the canvas's commit."""
    import ctypes

    import numpy as np

    from dgcli.runtime import native
    from dgcli.runtime.model import DiffusionModel

    lib = load_harness(harness)
    callback_type = native.lib().ggml_backend_sched_eval_callback
    callback = callback_type(ctypes.cast(lib.dg_opcheck_eval, ctypes.c_void_p).value)
    rng = np.random.default_rng(0)
    graphs = []

    def take(graph: str) -> None:
        graphs.append({"graph": graph, "nodes": [lib.dg_opcheck_line(i).decode()
                                                 for i in range(lib.dg_opcheck_count())]})
        lib.dg_opcheck_clear()

    with DiffusionModel(model, n_ctx=1024, eval_callback=(callback, ctypes.c_void_p(0))) as m:
        assert m.canvas_length == canvas_tokens, m.canvas_length
        lib.dg_opcheck_clear()
        m.prefill([2, 105, 40, 41, 42, 43, 106])
        take("prefill")
        canvas = rng.integers(0, m.vocab_size, size=(1, canvas_tokens))
        ids = np.stack([rng.choice(m.vocab_size, size=top_k, replace=False) for _ in range(canvas_tokens)])
        probs = rng.dirichlet(np.ones(top_k), size=canvas_tokens).astype(np.float32)
        m.denoise_step(canvas, 1.0, rng.random((1, canvas_tokens)), sc_topk=(ids[None], probs[None]), top_k=top_k,
                       portable_ops=True)
        take("step")
        soft = rng.standard_normal((1, canvas_tokens, m.n_embd)).astype(np.float32)
        m.denoise_step(canvas, 1.0, rng.random((1, canvas_tokens)), sc_soft=soft, next_soft=True, portable_ops=True)
        take("dense-step")
        m.commit(canvas[0])
        take("commit")
    return graphs


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "capture":
        print(__doc__, file=sys.stderr)
        return 2
    missing = {k: v for k, v in GPU_FORM_ENV.items() if os.environ.get(k) != v}
    if missing:
        print(f"capture: run with {missing} in the environment", file=sys.stderr)
        return 2
    for graph in capture(Path(argv[1]), Path(argv[2])):
        print(json.dumps(graph))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
