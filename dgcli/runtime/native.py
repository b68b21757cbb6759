"""ctypes access to our patched llama.cpp: llama-cpp-python's low-level API plus our dg_* functions.

`lib()` returns llama-cpp-python's `llama_cpp.llama_cpp` module with the dg_* functions of
native/patch/include/diffusion-gemma.h (and the sampler's dg_sampler_step) declared on its `_lib`.
Importing this module never fails; `lib()` raises NativeUnavailable (a DgError) with the reason
when the library is missing or was built without our patch.

llama.cpp's log goes to a ring buffer instead of stderr (DG_VERBOSE=1 echoes it), so normal runs
are quiet and a failure can quote llama.cpp's own reason (`last_error()`).

That log reaches Python through a ctypes callback, on every forward too. Python runs a signal
handler at the next bytecode, which is often inside that callback, where the KeyboardInterrupt
cannot propagate: ctypes prints "Exception ignored on calling ctypes callback function" and drops
it. Every native call that may log therefore runs inside `deferred_interrupts()`: Ctrl-C is
recorded there and raised as KeyboardInterrupt as soon as the call returns.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

from dgcli.errors import DgError

BUILD_HINT = "build it with `python native/build.py`"

# ggml_log_level
LOG_NONE, LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_CONT = 0, 1, 2, 3, 4, 5

GGML_TYPE_F32 = 0

# dg_denoise_step flags (native/patch/include/diffusion-gemma.h)
DG_STEP_EXACT = 1
DG_STEP_PORTABLE_OPS = 2


class StepOutputs(ctypes.Structure):
    """struct dg_step_outputs: where dg_denoise_step writes its per-position results."""

    _fields_ = [
        ("entropy", ctypes.POINTER(ctypes.c_float)),
        ("argmax", ctypes.POINTER(ctypes.c_int32)),
        ("sampled", ctypes.POINTER(ctypes.c_int32)),
        ("topk_ids", ctypes.POINTER(ctypes.c_int32)),
        ("topk_probs", ctypes.POINTER(ctypes.c_float)),
        ("dropped", ctypes.POINTER(ctypes.c_float)),
        ("values", ctypes.POINTER(ctypes.c_float)),
        ("soft", ctypes.POINTER(ctypes.c_float)),
    ]


class SelfCond(ctypes.Structure):
    """struct dg_self_cond: a decoder forward's self-conditioning input, one of three forms (top-k ids
    and probabilities, the whole distribution, or the soft embedding itself)."""

    _fields_ = [
        ("topk_ids", ctypes.POINTER(ctypes.c_int32)),
        ("topk_probs", ctypes.POINTER(ctypes.c_float)),
        ("k", ctypes.c_int32),
        ("probs", ctypes.POINTER(ctypes.c_float)),
        ("soft", ctypes.POINTER(ctypes.c_float)),
    ]


class NativeUnavailable(DgError):
    """llama_cpp is not importable, or it lacks the diffusion-gemma patch."""


_lock = threading.Lock()
_module: Any = None
_log_lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=200)
_log_state = {"level": LOG_INFO, "partial": ""}
_log_callback: Any = None  # keeps the ctypes callback alive
_sinks: list[list[str]] = []  # collect_log() lists, each gets every line while open
# What llama.cpp said while its backends looked for devices (kept: every model load clears the log).
# It is where a CUDA build on a machine without a usable GPU says why.
_backend_init_log: list[str] = []


def _on_log(level: int, text: bytes, _user_data: Any) -> None:
    msg = text.decode("utf-8", errors="replace") if text else ""
    if level == LOG_CONT:
        level = _log_state["level"]
    else:
        _log_state["level"] = level
    if os.environ.get("DG_VERBOSE"):
        sys.stderr.write(msg)
    # llama.cpp logs line fragments; keep whole lines
    buf = _log_state["partial"] + msg
    *lines, _log_state["partial"] = buf.split("\n")
    for line in lines:
        if line.strip():
            _log_lines.append((level, line.strip()))
            for sink in _sinks:
                sink.append(line.strip())


# Set by the SIGINT handler `deferred_interrupts` installs. A plain flag, not a threading.Event: the
# default handler may raise KeyboardInterrupt between any two bytecodes of the block's exit, and one
# raised inside an Event's `with lock:` leaves that lock held for good (the next block then hangs).
_interrupt_pending = [False]
# Run after every native call made in `deferred_interrupts()`, in the caller's thread: dgcli.runtime.rpc
# adds one that raises WorkerLost when an RPC worker failed during the call (ggml's client then
# completes the call with neutral values, which must not be used).
call_checks: list[Callable[[], None]] = []


def check_calls() -> None:
    for check in list(call_checks):
        check()


def _record_interrupt(_signum: int, _frame: Any) -> None:
    _interrupt_pending[0] = True


@contextlib.contextmanager
def deferred_interrupts(check: bool = True) -> Iterator[None]:
    """Ctrl-C inside the block is recorded and raised as KeyboardInterrupt when the block ends, after
    `call_checks` (each may raise; check=False: none run, for calls that only free what was made).

    Only where Ctrl-C would raise KeyboardInterrupt anyway (the main thread, Python's default
    handler): a handler the application installed is left alone. Nested blocks are one block.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        try:
            yield
        finally:
            if check:
                check_calls()
        return
    # reset on entry: a Ctrl-C that lands while the last block exited raised KeyboardInterrupt itself
    _interrupt_pending[0] = False
    signal.signal(signal.SIGINT, _record_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupted = _interrupt_pending[0]
        _interrupt_pending[0] = False
        if check:
            check_calls()  # a lost worker first: it, not the Ctrl-C, is why the call returned early
        if interrupted:
            raise KeyboardInterrupt


def clear_log() -> None:
    _log_lines.clear()
    _log_state["partial"] = ""


def last_error(default: str = "unknown error (run with DG_VERBOSE=1 for llama.cpp's log)") -> str:
    """The most telling error line llama.cpp logged since `clear_log()`, without its function prefix."""
    lines = list(_log_lines)
    if _log_state["partial"].strip():
        lines.append((_log_state["level"], _log_state["partial"].strip()))
    errors = [text for level, text in lines if level == LOG_ERROR]
    for text in reversed(errors):
        for marker in ("error loading model: ", "failed to load model: "):
            if marker in text:
                reason = text.split(marker, 1)[1].strip()
                # "check_tensor_dims: tensor 'x' has wrong shape; expected     96,     64, got ..."
                head, sep, tail = reason.partition(": ")
                reason = tail if sep and " " not in head else reason
                return " ".join(reason.split())
    if errors:
        text = errors[-1]
        # "func_name: message" -> "message"
        head, sep, tail = text.partition(": ")
        return tail.strip() if sep and " " not in head else text
    return default


def _declare(lib_mod: Any) -> None:
    raw = lib_mod._lib
    c_float_p = ctypes.POINTER(ctypes.c_float)
    token_p = ctypes.POINTER(ctypes.c_int32)
    signatures = {
        "dg_canvas_length": ([lib_mod.llama_model_p_ctypes], ctypes.c_int32),
        "dg_encode": ([lib_mod.llama_context_p_ctypes, token_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_bool, c_float_p],
                      ctypes.c_int32),
        # (ctx, canvases, n_seqs, n_canvas, self_cond, exact, logits_out)
        "dg_decode_canvases": ([lib_mod.llama_context_p_ctypes, token_p, ctypes.c_int32, ctypes.c_int32,
                                ctypes.POINTER(SelfCond), ctypes.c_bool, c_float_p], ctypes.c_int32),
        # (ctx, canvases, n_seqs, n_canvas, self_cond, temperatures, uniforms, top_k, flags, out)
        "dg_denoise_step": ([lib_mod.llama_context_p_ctypes, token_p, ctypes.c_int32, ctypes.c_int32,
                             ctypes.POINTER(SelfCond), c_float_p, ctypes.POINTER(ctypes.c_double), ctypes.c_int32,
                             ctypes.c_uint32, ctypes.POINTER(StepOutputs)], ctypes.c_int32),
        "dg_self_cond_path": ([lib_mod.llama_model_p_ctypes, ctypes.c_bool], ctypes.c_char_p),
        "dg_self_cond_bytes": ([lib_mod.llama_model_p_ctypes, ctypes.c_bool], ctypes.c_int64),
        "dg_lm_head_path": ([lib_mod.llama_model_p_ctypes], ctypes.c_char_p),
        "dg_dense_repacked_count": ([lib_mod.llama_model_p_ctypes], ctypes.c_int32),
        # (kernel, weight ggml type, n_embd, n_vocab, n_cols, seed, max_rel_error out)
        "dg_lm_head_selftest": ([ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_uint32, ctypes.POINTER(ctypes.c_double)], ctypes.c_int32),
        "dg_expert_gemm_count": ([lib_mod.llama_model_p_ctypes], ctypes.c_int32),
        "dg_expert_kernel": ([], ctypes.c_int32),
        "dg_dense_kernel": ([], ctypes.c_int32),
        "dg_dense_tiled_count": ([lib_mod.llama_model_p_ctypes], ctypes.c_int32),
        "dg_amx_in_use": ([], ctypes.c_int32),
        "dg_avx_vnni_in_use": ([], ctypes.c_int32),
        "dg_plain_cpu_buffer_type": ([], ctypes.c_void_p),
        # (kernel, weight ggml type, n_in, n_out, n_expert, n_used, n_tokens, input_per_slot, nth, seed,
        #  max_rel_error out)
        "dg_experts_selftest": ([ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_bool, ctypes.c_int32, ctypes.c_uint32,
                                 ctypes.POINTER(ctypes.c_double)], ctypes.c_int32),
        "dg_expert_repack_kernel": ([], ctypes.c_int32),
        "dg_expert_buffer_type": ([ctypes.c_int32], ctypes.c_void_p),
        # (kernel, weight ggml type, n_in)
        "dg_expert_repack_takes": ([ctypes.c_int32, ctypes.c_int32, ctypes.c_int64], ctypes.c_bool),
        # (kernel, weight ggml type, n_in, n_out, n_expert)
        "dg_expert_repacked_bytes": ([ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64],
                                     ctypes.c_int64),
        # as dg_experts_selftest
        "dg_experts_repacked_selftest": ([ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_bool, ctypes.c_int32,
                                          ctypes.c_uint32, ctypes.POINTER(ctypes.c_double)], ctypes.c_int32),
        # (kernel, weight ggml type, n_in, n_out, n_expert, n_used, n_tokens, input_per_slot, n_threads, seed,
        #  max_rel_diff out)
        "dg_expert_buffer_selftest": ([ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_bool, ctypes.c_int32, ctypes.c_uint32,
                                       ctypes.POINTER(ctypes.c_double)], ctypes.c_int32),
        # (m, n, k, heads, heads_kv, permuted, n_threads, seed, max_rel_err out)
        "dg_f16_matmul_selftest": ([ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_bool, ctypes.c_int32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_double)],
                                   ctypes.c_int32),
        "dg_f16_gemm_runs": ([ctypes.c_int64, ctypes.c_int64, ctypes.c_int64], ctypes.c_int32),
        "dg_peak_gmacs": ([ctypes.c_int32, ctypes.c_double, ctypes.c_char_p, ctypes.c_int32], ctypes.c_double),
        "dg_profile_new": ([], ctypes.c_void_p),
        "dg_profile_free": ([ctypes.c_void_p], None),
        "dg_profile_reset": ([ctypes.c_void_p], None),
        "dg_profile_enable": ([ctypes.c_void_p, ctypes.c_bool], None),
        "dg_profile_enabled": ([ctypes.c_void_p], ctypes.c_bool),
        "dg_profile_eval": ([ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p], ctypes.c_bool),
        "dg_profile_count": ([ctypes.c_void_p], ctypes.c_int32),
        # (profile, i, name, name_len, op, op_len, src0_type, type_len, ne[16], seconds, cpu_seconds)
        "dg_profile_node": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32, ctypes.c_char_p,
                             ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64),
                             ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)], ctypes.c_int32),
        "dg_sampler_step": ([c_float_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.POINTER(ctypes.c_double),
                             ctypes.POINTER(ctypes.c_double), token_p, token_p, ctypes.c_int32], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        try:
            fn = getattr(raw, name)
        except AttributeError as err:
            raise NativeUnavailable(
                f"the installed llama.cpp library lacks {name}() (not built with the diffusion-gemma patch); {BUILD_HINT}"
            ) from err
        fn.argtypes, fn.restype = argtypes, restype


# NVIDIA's pip wheels (what torch depends on) put the CUDA runtime and cuBLAS in site-packages:
# nvidia/cu13/lib (CUDA 13) or nvidia/<component>/lib (CUDA 12). The sonames libggml-cuda needs.
_CUDA_SONAMES = ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13",
                 "libcudart.so.12", "libcublasLt.so.12", "libcublas.so.12")
_preloaded: list[Any] = []


def cuda_library_dirs() -> list[str]:
    """Folders of NVIDIA's pip wheels on sys.path that hold the CUDA runtime / cuBLAS."""
    out = []
    for base in sys.path:
        nvidia = os.path.join(base or ".", "nvidia")
        if not os.path.isdir(nvidia):
            continue
        for sub in ("cu13", "cu12", "cuda_runtime", "cublas"):
            folder = os.path.join(nvidia, sub, "lib")
            if os.path.isdir(folder) and folder not in out:
                out.append(folder)
    return out


def _preload_cuda_libraries(llama_dir: str) -> None:
    """For a CUDA build, load the CUDA runtime and cuBLAS from NVIDIA's pip wheels when the system
    has none on its library path: libggml-cuda's dependencies then resolve to these (by soname),
    as torch does for its own. A system copy (LD_LIBRARY_PATH, ldconfig, RPATH) is tried first."""
    # libggml-cuda.so, or only its soname libggml-cuda.so.0 (benchmarks/gpu_bundle.py's slim wheel)
    if not any(os.path.exists(os.path.join(llama_dir, name)) for name in ("libggml-cuda.so", "libggml-cuda.so.0")):
        return
    dirs = cuda_library_dirs()
    for soname in _CUDA_SONAMES:
        try:
            _preloaded.append(ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL))
            continue
        except OSError:
            pass
        for folder in dirs:
            path = os.path.join(folder, soname)
            if os.path.exists(path):
                try:
                    _preloaded.append(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
                except OSError:
                    pass
                break


def lib() -> Any:
    """llama-cpp-python's low-level module, initialised, with our dg_* functions declared on `_lib`."""
    global _module, _log_callback
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        try:
            import importlib.util

            spec = importlib.util.find_spec("llama_cpp")
            if spec is not None and spec.submodule_search_locations:
                _preload_cuda_libraries(os.path.join(list(spec.submodule_search_locations)[0], "lib"))
            import llama_cpp.llama_cpp as lib_mod  # noqa: PLC0415 (optional dependency, loaded on first use)
        except (ImportError, OSError, RuntimeError) as err:
            raise NativeUnavailable(f"llama_cpp is not available ({err}); {BUILD_HINT}") from err
        _declare(lib_mod)
        _log_callback = lib_mod.llama_log_callback(_on_log)
        with deferred_interrupts():
            lib_mod.llama_log_set(_log_callback, ctypes.c_void_p(0))
            lib_mod.llama_backend_init()
        _backend_init_log[:] = [text for _level, text in _log_lines]
        _module = lib_mod
    return _module


# ggml_backend_dev_type
DEVICE_TYPE_CPU, DEVICE_TYPE_GPU, DEVICE_TYPE_IGPU = 0, 1, 2


# ggml-metal's registry name: Apple's GPUs, whose memory is the system's
METAL_BACKEND = "MTL"


class GpuDevice:
    """One GPU as llama.cpp's ggml backend registry sees it; `backend` is its registry's name ("CUDA", "MTL", ...)."""

    def __init__(self, name: str, description: str, free: int, total: int, backend: str = ""):
        self.name, self.description, self.free, self.total, self.backend = name, description, free, total, backend

    def __repr__(self) -> str:
        return (f"GpuDevice({self.name!r}, {self.description!r}, free={self.free}, total={self.total}, "
                f"backend={self.backend!r})")


_ggml: Any = None


def library_names(stem: str) -> list[str]:
    """The files a library `stem` ("ggml", "ggml-base", ...) of llama_cpp's wheel has on this platform,
    the one its dependents link first (the soname on Linux, the install name on macOS): a wheel holds
    each name as a separate copy, and opening another one than libllama's loads a second copy of the
    library with its own globals (the backend registry, the abort callback)."""
    if sys.platform == "darwin":
        return [f"lib{stem}.0.dylib", f"lib{stem}.dylib"]
    if sys.platform == "win32":
        return [f"{stem}.dll", f"lib{stem}.dll"]
    return [f"lib{stem}.so.0", f"lib{stem}.so"]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _dladdr_file(address: int) -> str | None:
    """The file of the loaded library holding `address` (dladdr: glibc and macOS's libSystem)."""
    import ctypes.util

    for name in (None, ctypes.util.find_library("c"), ctypes.util.find_library("dl")):
        try:
            dladdr = ctypes.CDLL(name).dladdr
        except (OSError, AttributeError, TypeError):
            continue
        dladdr.argtypes, dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
        info = _DlInfo()
        if dladdr(ctypes.c_void_p(address), ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
        return None
    return None


def loaded_library(stem: str, symbol: str, llama: Any = None) -> str:
    """The file of lib`stem` that libllama loaded: where `symbol` (one of its functions), looked up
    through libllama, lives; else the first of `library_names` in libllama's folder."""
    llama = llama if llama is not None else lib()._lib
    try:
        found = _dladdr_file(ctypes.cast(getattr(llama, symbol), ctypes.c_void_p).value)
    except AttributeError:
        found = None
    if found and os.path.basename(found).startswith(f"lib{stem}."):
        return found
    folder = os.path.dirname(llama._name)
    names = library_names(stem)
    return next((os.path.join(folder, n) for n in names if os.path.exists(os.path.join(folder, n))), names[0])


def _ggml_lib() -> Any:
    """libggml (the backend registry) and libggml-base (the CPU buffer type), the copies libllama loaded."""
    global _ggml
    if _ggml is not None:
        return _ggml
    try:
        reg = ctypes.CDLL(loaded_library("ggml", "ggml_backend_dev_count"))
        cpu = ctypes.CDLL(loaded_library("ggml-base", "ggml_backend_cpu_buffer_type"))
    except OSError as err:
        raise NativeUnavailable(f"cannot open ggml's libraries next to libllama ({err}); {BUILD_HINT}") from err
    reg.ggml_backend_dev_count.argtypes, reg.ggml_backend_dev_count.restype = [], ctypes.c_size_t
    reg.ggml_backend_dev_get.argtypes, reg.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(reg, name).argtypes, getattr(reg, name).restype = [ctypes.c_void_p], ctypes.c_char_p
    reg.ggml_backend_dev_type.argtypes, reg.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
    reg.ggml_backend_reg_count.argtypes, reg.ggml_backend_reg_count.restype = [], ctypes.c_size_t
    reg.ggml_backend_reg_get.argtypes, reg.ggml_backend_reg_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    reg.ggml_backend_reg_name.argtypes, reg.ggml_backend_reg_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    reg.ggml_backend_dev_backend_reg.argtypes, reg.ggml_backend_dev_backend_reg.restype = [ctypes.c_void_p], ctypes.c_void_p
    reg.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    reg.ggml_backend_dev_memory.restype = None
    cpu.ggml_backend_cpu_buffer_type.argtypes, cpu.ggml_backend_cpu_buffer_type.restype = [], ctypes.c_void_p
    _ggml = (reg, cpu)
    return _ggml


def gpu_devices() -> list[GpuDevice]:
    """The GPUs llama.cpp can offload to (empty for a CPU-only build), with free and total memory."""
    reg, _ = _ggml_lib()
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        dev = reg.ggml_backend_dev_get(i)
        if reg.ggml_backend_dev_type(dev) != DEVICE_TYPE_GPU:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        reg.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        backend = reg.ggml_backend_reg_name(reg.ggml_backend_dev_backend_reg(dev)) or b""
        out.append(GpuDevice(reg.ggml_backend_dev_name(dev).decode(), reg.ggml_backend_dev_description(dev).decode(),
                             int(free.value), int(total.value), backend.decode()))
    return out


# registered backends that never hold a local GPU
_NOT_GPU_BACKENDS = {"CPU", "RPC", "BLAS"}


def gpu_backends() -> list[str]:
    """The GPU backends compiled into this llama.cpp (CUDA, Metal, ...), whether or not they found a device."""
    reg, _ = _ggml_lib()
    names = (reg.ggml_backend_reg_name(reg.ggml_backend_reg_get(i)) for i in range(reg.ggml_backend_reg_count()))
    return [n.decode() for n in names if n and n.decode() not in _NOT_GPU_BACKENDS]


def no_gpu_reason() -> str:
    """Why llama.cpp has no GPU to offload to, as one clause."""
    backends = gpu_backends()
    if not backends:
        return "this llama.cpp build has no GPU backend (`python native/build.py --cuda` or `--metal` builds one)"
    # e.g. "ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA runtime version"
    said = [text for text in _backend_init_log if any(b.lower() in text.lower() for b in backends)]
    reason = said[-1].split(": ", 1)[-1] if said else "no device found"
    return f"this llama.cpp build has {'/'.join(backends)} but no GPU to use ({reason})"


def cpu_buffer_type() -> int:
    """ggml_backend_cpu_buffer_type(): the buffer type a tensor override names to keep weights in system
    memory (llama.cpp compares the pointer, so it must be this one)."""
    _, cpu = _ggml_lib()
    return cpu.ggml_backend_cpu_buffer_type()


class TensorBuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override (llama.h); llama-cpp-python leaves the field a void *
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def buft_overrides(patterns: list[str], plain: Sequence[str] = (), own: Sequence[tuple[str, int]] = ()) -> Any:
    """A NULL-terminated llama_model_tensor_buft_override array sending `patterns` to system memory
    (a CPU repack buffer where llama.cpp has one for the tensor), `plain` to plain system memory, in
    the file's layout (dg_plain_cpu_buffer_type), and each (pattern, buffer type) of `own` to that buffer
    type (dg's expert buffer). llama.cpp takes a tensor's first match: `own` first, then `plain`.
    The caller keeps it alive until the model is loaded."""
    array = (TensorBuftOverride * (len(own) + len(plain) + len(patterns) + 1))()
    targets = list(own) + [(p, lib()._lib.dg_plain_cpu_buffer_type()) for p in plain] + \
        [(p, cpu_buffer_type()) for p in patterns]
    for i, (pattern, buft) in enumerate(targets):
        array[i].pattern, array[i].buft = pattern.encode(), buft
    return array


def log_tail() -> list[str]:
    """The last lines llama.cpp logged (up to 200), oldest first."""
    return [text for _level, text in _log_lines]


@contextlib.contextmanager
def collect_log() -> Iterator[list[str]]:
    """Every whole line llama.cpp logs inside the block (the error ring keeps only the last 200)."""
    sink: list[str] = []
    _sinks.append(sink)
    try:
        yield sink
    finally:
        # by identity: list.remove compares by value, and a nested block's sink can equal this one
        _sinks[:] = [s for s in _sinks if s is not sink]


def available() -> tuple[bool, str]:
    """(True, "") when the patched library loads, else (False, reason): for skips and `dg doctor`."""
    try:
        lib()
    except DgError as err:
        return False, str(err)
    return True, ""


# dg_peak_gmacs kinds (native/patch/include/diffusion-gemma.h)
PEAK_INT8, PEAK_BF16, PEAK_F32, PEAK_INT8_AVX2 = 0, 1, 2, 3


def peak_gmacs(kind: int, seconds: float = 0.5) -> tuple[float, str]:
    """This CPU's single-thread multiply-add peak (G MAC/s) for PEAK_INT8 / PEAK_BF16 / PEAK_F32,
    and which instructions were measured."""
    name = ctypes.create_string_buffer(96)
    rate = lib()._lib.dg_peak_gmacs(kind, seconds, name, len(name))
    return float(rate), name.value.decode()


def as_float_p(array: Any) -> Any:
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def as_token_p(array: Any) -> Any:
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
