"""This machine's CPU, as the OS reports it: what decides which of dg's kernels can run, and how many
threads a forward gets."""

from __future__ import annotations

import functools
import os
import platform
import sys


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
