"""The self-conditioning input of a decoder forward: its forms, the engine's default, checks, batching.

The reference feeds each denoising step the previous step's temperature-processed logits and forms
`soft = softmax(processed) @ E * sqrt(n_embd)` (zeros on a canvas's first step). dg hands the graph
one of three forms (`struct dg_self_cond`, native/patch/include/diffusion-gemma.h):

- dense probabilities [n, C, V] (`sc_logits`, softmax taken here, or `sc_probs`): the graph forms
  the reference's product, one [V x n_embd] x [V x C] matmul against a transposed copy of E. What the
  host samplers' steps pass (their processed logits are on the host anyway).
- the soft embedding itself [n, C, n_embd] (`sc_soft`): a dense one-graph step computes the next
  step's soft embedding inside its own graph (`denoise_step(next_soft=True)`), so the engine's loop
  never moves a [C, V] matrix; this form hands it back.
- top-k (ids, probs) [n, C, k] (`sc_topk`): the k most probable tokens and their probabilities; the
  graph gathers k rows of E per position, and the tail mass is dropped (not renormalised).

A row of zeros (probabilities or soft embedding) is exactly "no signal" (rms_norm(0) = 0 and the MLP
of 0 is 0), so a canvas on its first step shares a forward with self-conditioned ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dgcli.errors import DgError, InvalidParameter
from dgcli.runtime import native

# The engine's default self-conditioning width (`self_cond_top_k=None`): 0 is the dense form, the
# reference's computation, at every vocabulary size; a width k > 0 keeps the k most probable tokens.
# Dense costs one more LM-head-sized product per step (docs/design.md, "Self-conditioning": the
# measurements behind the choice).
DEFAULT_SC_TOP_K = 0


def resolve_self_cond_top_k(value: Any, vocab_size: int, exact: bool = False) -> int:
    """The top-k width for a `self_cond_top_k` setting; 0 means dense (the reference's form).
    None: the default (DEFAULT_SC_TOP_K; dense in exact mode, which is the reference's computation).
    0 or "dense": dense. k >= vocab_size is dense too (nothing would be dropped)."""
    if value is None:
        return 0 if exact else min(DEFAULT_SC_TOP_K, vocab_size)
    if isinstance(value, str) and value.strip().lower() == "dense":
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidParameter("self_cond_top_k", value, 'an integer >= 0 (0 = dense), "dense" or None (auto)')
    return 0 if value >= vocab_size else int(value)


def self_cond_form(top_k: int) -> str:
    """How results name a self-conditioning width: "dense" or "top-k" with its k."""
    return f"top-{top_k}" if top_k else "dense"


def dense_self_cond_probs(sc_logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis in float32, as the reference forms its self-conditioning input."""
    sc = np.asarray(sc_logits, dtype=np.float32)
    # exp(x - max) <= 1 cannot overflow
    probs = np.exp(sc - sc.max(axis=-1, keepdims=True), dtype=np.float32)
    probs /= probs.sum(axis=-1, keepdims=True, dtype=np.float32)
    return probs


@dataclass
class SelfCond:
    """One generation's next self-conditioning input (None where a canvas starts: no signal)."""

    logits: np.ndarray | None = None  # float32 [C, V]: the host sampler's processed logits (dense)
    soft: np.ndarray | None = None  # float32 [C, n_embd]: the soft embedding a dense graph step made
    ids: np.ndarray | None = None  # int32 [C, k]
    probs: np.ndarray | None = None  # float32 [C, k]
    dropped_mass: float = 0.0  # largest probability mass left out of a position's top-k

    @property
    def form(self) -> str:
        return "topk" if self.ids is not None else "soft" if self.soft is not None else "dense"


def batched_self_cond(self_conds: Sequence[SelfCond | None]) -> dict[str, Any]:
    """Several canvases' inputs as the keyword arguments of one forward (decode_canvases /
    denoise_step): {} when none has one; else one form for all, a canvas on its first step (None)
    getting rows of zeros, which add exactly nothing."""
    present = [sc for sc in self_conds if sc is not None]
    if not present:
        return {}
    form = present[0].form
    if any(sc.form != form for sc in present):
        raise DgError("canvases in one forward need the same self-conditioning form (dense or the same top-k)")
    n = len(self_conds)
    if form == "topk":
        shape = present[0].ids.shape
        if any(sc.ids.shape != shape for sc in present):
            raise DgError("canvases in one forward need the same self-conditioning form (dense or the same top-k)")
        ids = np.zeros((n, *shape), dtype=np.int32)
        probs = np.zeros((n, *shape), dtype=np.float32)
        for row, sc in enumerate(self_conds):
            if sc is not None:
                ids[row], probs[row] = sc.ids, sc.probs
        return {"sc_topk": (ids, probs)}
    if form == "soft":
        soft = np.zeros((n, *present[0].soft.shape), dtype=np.float32)
        for row, sc in enumerate(self_conds):
            if sc is not None:
                soft[row] = sc.soft
        return {"sc_soft": soft}
    dense = np.zeros((n, *present[0].logits.shape), dtype=np.float32)
    for row, sc in enumerate(self_conds):
        if sc is not None:
            dense[row] = dense_self_cond_probs(sc.logits)
    return {"sc_probs": dense}


@dataclass
class DecoderSelfCond:
    """A forward's checked self-conditioning input, as contiguous arrays for `struct dg_self_cond`."""

    ids: np.ndarray | None = None  # int32 [n, C, k]
    probs: np.ndarray | None = None  # float32 [n, C, k] (top-k) or [n, C, V] (dense)
    soft: np.ndarray | None = None  # float32 [n, C, n_embd]

    def struct(self) -> Any:
        """A `native.SelfCond` over these arrays (which must outlive the call), or None (no input)."""
        if self.ids is None and self.probs is None and self.soft is None:
            return None
        sc = native.SelfCond()
        if self.ids is not None:
            sc.topk_ids, sc.topk_probs, sc.k = native.as_token_p(self.ids), native.as_float_p(self.probs), self.ids.shape[-1]
        elif self.probs is not None:
            sc.probs = native.as_float_p(self.probs)
        else:
            sc.soft = native.as_float_p(self.soft)
        return sc


def check_decoder_self_cond(n: int, length: int, vocab_size: int, n_embd: int, sc_logits: Any = None,
                            sc_topk: Any = None, sc_probs: Any = None, sc_soft: Any = None) -> DecoderSelfCond:
    """At most one form, each checked against the forward's n canvases of `length` tokens."""
    given = [name for name, v in (("sc_logits", sc_logits), ("sc_topk", sc_topk), ("sc_probs", sc_probs),
                                  ("sc_soft", sc_soft)) if v is not None]
    if len(given) > 1:
        raise DgError(f"pass one self-conditioning input, not {' and '.join(given)}")
    if sc_topk is not None:
        return DecoderSelfCond(*_check_topk(sc_topk, n, length, vocab_size))
    if sc_soft is not None:
        return DecoderSelfCond(soft=_check_rows("sc_soft", sc_soft, (n, length, n_embd), "soft embeddings"))
    if sc_logits is not None:
        logits = _check_rows("sc_logits", sc_logits, (n, length, vocab_size), "logits")
        return DecoderSelfCond(probs=dense_self_cond_probs(logits))
    if sc_probs is not None:
        probs = _check_rows("sc_probs", sc_probs, (n, length, vocab_size), "probabilities")
        if (probs < 0).any():
            raise InvalidParameter("sc_probs", "negative values", "probabilities")
        return DecoderSelfCond(probs=probs)
    return DecoderSelfCond()


def _check_rows(name: str, value: Any, shape: tuple[int, int, int], what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.shape != shape:
        raise InvalidParameter(name, f"array of shape {arr.shape}",
                               f"shape {shape[1:]} (one row of {what} per canvas position)")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise InvalidParameter(name, "non-finite values", f"finite {what}")
    return arr


def _check_topk(sc_topk: Any, n: int, length: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(sc_topk, (tuple, list)) or len(sc_topk) != 2:
        raise InvalidParameter("sc_topk", type(sc_topk).__name__, "a pair (ids, probs)")
    ids, probs = (np.asarray(a) for a in sc_topk)
    if ids.ndim != 3 or ids.shape[:2] != (n, length) or ids.shape != probs.shape \
            or not 1 <= ids.shape[2] <= vocab_size:
        raise InvalidParameter("sc_topk", f"arrays of shapes {ids.shape} and {probs.shape}",
                               f"two [{length}, k] arrays with 1 <= k <= {vocab_size}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidParameter("sc_topk ids", f"dtype {ids.dtype}", "integer token ids")
    # the k x C values are few: checking them costs nothing next to the forward
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidParameter("sc_topk ids", "an id outside the vocabulary", f"ids in [0, {vocab_size})")
    probs = np.ascontiguousarray(probs, dtype=np.float32)
    if not np.isfinite(probs).all() or (probs < 0).any():
        raise InvalidParameter("sc_topk probs", "negative or non-finite values", "probabilities")
    return np.ascontiguousarray(ids, dtype=np.int32), probs
