"""This machine's CPU, as Linux reports it: what decides which of dg's kernels can run."""

from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")
