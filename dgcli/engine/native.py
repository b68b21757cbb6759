"""ctypes access to our patched llama.cpp: llama-cpp-python's low-level API plus our dg_* functions.

`lib()` returns llama-cpp-python's `llama_cpp.llama_cpp` module with the dg_* functions of
native/patch/include/diffusion-gemma.h (and the sampler's dg_sampler_step) declared on its `_lib`.
Importing this module never fails; `lib()` raises NativeUnavailable (a DgError) with the reason
when the library is missing or was built without our patch.

llama.cpp's log goes to a ring buffer instead of stderr (DG_VERBOSE=1 echoes it), so normal runs
are quiet and a failure can quote llama.cpp's own reason (`last_error()`).
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
from typing import Any

from dgcli.engine.types import DgError

BUILD_HINT = "build it with `python native/build.py`"

# ggml_log_level
LOG_NONE, LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_CONT = 0, 1, 2, 3, 4, 5

GGML_TYPE_F32 = 0


class NativeUnavailable(DgError):
    """llama_cpp is not importable, or it lacks the diffusion-gemma patch."""


_lock = threading.Lock()
_module: Any = None
_log_lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=200)
_log_state = {"level": LOG_INFO, "partial": ""}
_log_callback: Any = None  # keeps the ctypes callback alive


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
        # (ctx, canvases, n_seqs, n_canvas, sc_ids, sc_probs, sc_k, exact, logits_out)
        "dg_decode_canvases": ([lib_mod.llama_context_p_ctypes, token_p, ctypes.c_int32, ctypes.c_int32, token_p,
                                c_float_p, ctypes.c_int32, ctypes.c_bool, c_float_p], ctypes.c_int32),
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


def lib() -> Any:
    """llama-cpp-python's low-level module, initialised, with our dg_* functions declared on `_lib`."""
    global _module, _log_callback
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        try:
            import llama_cpp.llama_cpp as lib_mod  # noqa: PLC0415 (optional dependency, loaded on first use)
        except (ImportError, OSError) as err:
            raise NativeUnavailable(f"llama_cpp is not available ({err}); {BUILD_HINT}") from err
        _declare(lib_mod)
        _log_callback = lib_mod.llama_log_callback(_on_log)
        lib_mod.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lib_mod.llama_backend_init()
        _module = lib_mod
    return _module


def available() -> tuple[bool, str]:
    """(True, "") when the patched library loads, else (False, reason): for skips and `dg doctor`."""
    try:
        lib()
    except DgError as err:
        return False, str(err)
    return True, ""


def as_float_p(array: Any) -> Any:
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def as_token_p(array: Any) -> Any:
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
