"""How dg prints sizes: decimal units (1 GB = 10**9 bytes), as the Hub shows file sizes, for every
size it prints (files, downloads, memory, buffers)."""

from __future__ import annotations


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
