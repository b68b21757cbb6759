"""This machine's CPU, as the OS reports it: what decides which of dg's kernels can run, and how many
threads a forward gets."""

from __future__ import annotations

import functools
import os
import platform
import sys
from typing import Any

from dgcli.errors import InvalidParameter

# Below this size a forward's ops are shorter than handing work to another thread, and with a
# busy-waiting thread pool a second thread that shares a core with anything else stalls every op
# (docs/performance.md: the demo model with one thread and with two).
SINGLE_THREAD_BELOW_BYTES = 64 << 20

# ggml's thread pool holds at most GGML_MAX_N_THREADS workers
MAX_THREADS = 512


def check_threads(n_threads: Any) -> None:
    """None (choose) or 1..MAX_THREADS: larger values would wrap in the C int of llama.cpp's params."""
    if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int)
                                  or not 1 <= n_threads <= MAX_THREADS):
        raise InvalidParameter("threads", n_threads, f"an integer from 1 to {MAX_THREADS}")


def default_threads(path: str | os.PathLike) -> int:
    """llama.cpp threads when the caller does not choose: 1 for tiny models, else compute_threads()."""
    try:
        if os.path.getsize(path) < SINGLE_THREAD_BELOW_BYTES:
            return 1
    except OSError:
        pass
    return min(MAX_THREADS, compute_threads())


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of /proc/cpuinfo (empty where there is none: macOS, or not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def sysctl_int(name: str) -> int | None:
    """A numeric sysctl value by name (macOS and the BSDs: sysctlbyname); None where there is none."""
    import ctypes
    import ctypes.util

    try:
        sysctlbyname = ctypes.CDLL(ctypes.util.find_library("c")).sysctlbyname
    except (OSError, AttributeError, TypeError):
        return None
    value, size = ctypes.c_int64(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int64))
    if sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return None
    return value.value if size.value in (4, 8) else None  # little-endian: a 4-byte value fills the low half


def compute_threads() -> int:
    """Threads for a forward when the user does not choose: every logical CPU; on a Mac its performance
    cores only (hw.perflevel0, as llama.cpp's own default), since ggml's threads meet after every op and
    the slowest core paces them all."""
    if sys.platform == "darwin":
        for key in ("hw.perflevel0.physicalcpu", "hw.physicalcpu"):
            n = sysctl_int(key)
            if n and n > 0:
                return n
    return max(1, os.cpu_count() or 1)
