"""How dg prints sizes: decimal units (1 GB = 10**9 bytes), as the Hub shows file sizes, for every
size it prints (files, downloads, memory, buffers); how it prints a figure (a rate, a ratio), and a
count with its noun."""

from __future__ import annotations

import math


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def format_figure(value: float, digits: int = 2, significant: int = 2) -> str:
    """`value` with `digits` decimals, or more when those would leave fewer than `significant`
    significant digits of a non-zero value: a real model's 0.04 tok/s on a CPU is "0.040", never
    "0.0", and a speedup of 0.004x is "0.0040x", never "0.00x"."""
    if value and math.isfinite(value) and abs(value) < 10.0 ** (significant - 1 - digits):
        digits = significant - 1 - math.floor(math.log10(abs(value)))
        if digits > 12:
            return f"{value:.2g}"
    return f"{value:.{digits}f}"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"
