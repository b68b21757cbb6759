"""A decoder forward's checked inputs (DecoderInputs) and what one denoising step returns per canvas
position (StepStats): the shapes between runtime/model.py and the sampler of the generation loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dgcli.errors import InvalidParameter
from dgcli.runtime import native


def check_tokens(tokens: Any, vocab_size: int, what: str) -> np.ndarray:
    """`tokens` as a contiguous int32 array, refused unless a non-empty 1-D sequence of ids in the vocabulary."""
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError):
        raise InvalidParameter(what, tokens, "a sequence of token ids") from None
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidParameter(what, f"array of shape {arr.shape} and dtype {arr.dtype}",
                               "a non-empty 1-D sequence of integer token ids")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        raise InvalidParameter(what, int(arr[bad][0]), f"token ids in [0, {vocab_size})")
    return np.ascontiguousarray(arr, dtype=np.int32)


def dense_self_cond_probs(sc_logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis in float32, as the reference forms its self-conditioning input."""
    sc = np.asarray(sc_logits, dtype=np.float32)
    # exp(x - max) <= 1 cannot overflow
    probs = np.exp(sc - sc.max(axis=-1, keepdims=True), dtype=np.float32)
    probs /= probs.sum(axis=-1, keepdims=True, dtype=np.float32)
    return probs


@dataclass
class DecoderInputs:
    """A decoder forward's checked inputs: canvases (flat int32) and the self-conditioning top-k."""

    tokens: np.ndarray
    n: int
    length: int
    per_sequence: bool  # canvas s after sequence s's own cache (else all after sequence 0's)
    sc_ids: np.ndarray | None = None  # int32 [n, C, k]
    sc_probs: np.ndarray | None = None  # float32 [n, C, k]

    def self_cond_args(self) -> tuple[Any, Any, int]:
        """(sc_ids, sc_probs, sc_k) as the dg_* functions take them."""
        if self.sc_ids is None:
            return None, None, 0
        return native.as_token_p(self.sc_ids), native.as_float_p(self.sc_probs), int(self.sc_ids.shape[-1])


@dataclass
class StepStats:
    """Per-position results of one step's logits pass."""

    entropy: np.ndarray  # float64 [C]: entropy of softmax(logits / t)
    argmax: np.ndarray  # int64 [C]: argmax of logits / t
    sampled: np.ndarray  # int64 [C]: multinomial sample from softmax(logits / t)
    # float32 [C, V]: logits / t (the dense self-conditioning input of the next step); None when the
    # step ran inside the decoder graph without being asked for it
    processed: np.ndarray | None
    # with top_k > 0: the next step's self-conditioning input in top-k form (see dgcli.engine.sampler.top_k_softmax)
    topk_ids: np.ndarray | None = None  # int32 [C, k]: most probable first
    topk_probs: np.ndarray | None = None  # float32 [C, k]: softmax(processed) at those ids
    dropped_mass: np.ndarray | None = None  # float64 [C]: 1 - sum(topk_probs), the mass left out
