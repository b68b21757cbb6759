"""A decoder forward's checked inputs (DecoderInputs) and what one denoising step returns per canvas
position (StepStats): the shapes between runtime/model.py and the sampler of the generation loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dgcli.errors import InvalidParameter
from dgcli.runtime.self_cond import DecoderSelfCond


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


@dataclass
class DecoderInputs:
    """A decoder forward's checked inputs: canvases (flat int32) and the self-conditioning input."""

    tokens: np.ndarray
    n: int
    length: int
    per_sequence: bool  # canvas s after sequence s's own cache (else all after sequence 0's)
    self_cond: DecoderSelfCond


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
    # the next step's dense self-conditioning input as the graph step forms it (next_soft):
    # softmax(processed) @ E * sqrt(n_embd), float32 [C, n_embd]
    soft: np.ndarray | None = None
