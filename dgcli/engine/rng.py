"""The random draws of one generation, as a stream with the reference's three kinds of call.

Keeping every draw behind one object is what makes a generation replayable: a replay test hands
the same seeded stream to our engine and (through patched `torch.randint` / `torch.multinomial`)
to the Transformers reference, and both consume it in the same order:

    canvas_init(n, high)   once per canvas         (reference: `EntropyBoundSampler.initialize_canvas`)
    multinomial(probs)     once per denoising step (reference: `torch.multinomial` in `_denoising_step`)
    renoise(n, high)       once per denoising step (reference: `renoise_canvas` draws a whole canvas)

A multinomial draw is defined as inverse-CDF sampling on one uniform per row, so that the same
uniforms give the same tokens whether the probabilities live in torch, numpy or native memory.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from dgcli.errors import InvalidParameter

# Seeds are 32-bit, as llama.cpp's: a picked seed fits every tool a user may replay it with.
SEED_LIMIT = 1 << 32


def resolve_seed(seed: Any) -> int:
    """The seed a run uses: `seed` itself (an integer in [0, 2**32)), or a fresh random one for None,
    so that every run can be reproduced from the seed it reports."""
    if seed is None:
        return secrets.randbelow(SEED_LIMIT)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
        raise InvalidParameter("seed", seed, f"an integer in [0, {SEED_LIMIT - 1}] (or none: a random one)")
    return int(seed)


def inverse_cdf_sample(weights: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """One index per row of `weights` (unnormalised, >= 0): the first i with cumsum(w)[i] > u * sum(w).

    Rows are walked one at a time so that a [256, 262144] input needs one row of float64 scratch,
    not a second full-size buffer.
    """
    weights = np.asarray(weights)
    if weights.ndim != 2:
        raise ValueError(f"weights must be 2-D [rows, vocab], got shape {weights.shape}")
    rows, width = weights.shape
    uniforms = np.asarray(uniforms, dtype=np.float64).reshape(-1)
    if uniforms.shape[0] != rows:
        raise ValueError(f"need one uniform per row: {rows} rows, {uniforms.shape[0]} uniforms")
    out = np.empty(rows, dtype=np.int64)
    for row in range(rows):
        cdf = np.cumsum(weights[row], dtype=np.float64)
        target = uniforms[row] * cdf[-1]
        # side="right": the first index whose cdf is strictly greater, so zero-weight entries are never chosen
        out[row] = min(int(np.searchsorted(cdf, target, side="right")), width - 1)
    return out


class RngStream:
    """A seeded source of the sampler's random draws (numpy PCG64)."""

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self._generator = np.random.default_rng(None if seed is None else resolve_seed(seed))
        self.calls: list[str] = []  # call order, kept so tests can compare it with the reference's

    def canvas_init(self, n: int, high: int) -> np.ndarray:
        """`n` token ids uniform in [0, high): a fresh canvas."""
        self.calls.append("canvas_init")
        return self._uniform_ints(n, high)

    def multinomial_uniforms(self, n: int) -> np.ndarray:
        """The `n` uniforms in [0, 1) behind one multinomial draw (the native sampler consumes these)."""
        self.calls.append("multinomial")
        return self._generator.random(n, dtype=np.float64)

    def multinomial(self, probs: np.ndarray) -> np.ndarray:
        """One sample per row of `probs` [rows, vocab], by inverse CDF on this stream's uniforms."""
        probs = np.asarray(probs)
        return inverse_cdf_sample(probs, self.multinomial_uniforms(probs.shape[0]))

    def renoise(self, n: int, high: int) -> np.ndarray:
        """`n` token ids uniform in [0, high): the replacement canvas for non-accepted positions."""
        self.calls.append("renoise")
        return self._uniform_ints(n, high)

    def _uniform_ints(self, n: int, high: int) -> np.ndarray:
        return self._generator.integers(0, high, size=n, dtype=np.int64)
