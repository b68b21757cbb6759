"""The block-diffusion sampler's rules, one function each, as in Transformers' DiffusionGemma generate.

Per denoising step (reference: `DiffusionGemmaGenerationMixin._denoising_step`):

1. `schedule_temperature`: t = t_min + (t_max - t_min) * cur_step / max_steps, cur_step counting down.
2. `process_logits` (the heavy part, over [canvas_length, vocab] logits): processed = logits / t, and per
   position the entropy of softmax(processed), its argmax, and one multinomial sample. Two
   implementations that must agree: `NumpyStepSampler` (the readable reference and fallback) and
   `NativeStepSampler` (one multithreaded C++ pass per row, `dg_sampler_step`).
3. `entropy_bound_accept_mask`: sort entropies ascending, accept the prefix with cumsum(H) - H <= bound.
4. `renoise_canvas`: accepted positions take the sampled token, the others a fresh uniform token.
5. `StableAndConfidentStop`: stop when the argmax canvas equals each of the last `stability_threshold`
   ones AND mean entropy < confidence_threshold.

Per canvas (reference: `_finalize_canvas`, `_compute_tokens_per_forward`): `finalize_canvas` pads
everything after the first end token, `count_valid_tokens` counts the non-pad tokens.

The reference computes in float32 torch; where a comparison could flip on rounding (temperature,
cumulative entropy, mean entropy) we round to float32 the same way.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Protocol, Sequence

import numpy as np

from dgcli.engine.rng import inverse_cdf_sample
from dgcli.errors import DgError
from dgcli.runtime.forward import StepStats


def schedule_temperature(cur_step: int, max_steps: int, t_min: float, t_max: float) -> np.float32:
    """The linear schedule, in float32 as the reference evaluates it (`cur_step` is an int32 tensor there)."""
    fraction = np.float32(cur_step) / np.float32(max_steps)
    return np.float32(np.float32(t_min) + np.float32(t_max - t_min) * fraction)


class StepSampler(Protocol):
    name: str

    def process_logits(self, logits: np.ndarray, temperature: np.float32, uniforms: np.ndarray,
                       top_k: int = 0) -> StepStats:
        """May overwrite `logits` with logits / temperature and return it as `processed`.
        top_k > 0 also fills the top-k fields of StepStats."""
        ...


def _as_float32_matrix(logits: np.ndarray) -> np.ndarray:
    if not isinstance(logits, np.ndarray) or logits.ndim != 2:
        raise DgError(f"decoder logits must be a 2-D array [canvas, vocab], got {type(logits).__name__}")
    if logits.dtype != np.float32 or not logits.flags.c_contiguous or not logits.flags.writeable:
        logits = np.ascontiguousarray(logits, dtype=np.float32).copy()
    return logits


def _check_top_k(top_k: int, vocab: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 0 <= top_k <= vocab:
        raise DgError(f"top_k must be an integer in [0, {vocab}], got {top_k!r}")
    return int(top_k)


def top_k_softmax(weights: np.ndarray, total: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids int32 [C, k], probs float32 [C, k], dropped float64 [C]) from the rows' unnormalised
    softmax weights exp(x - max) and their sums: the k most probable ids per row, most probable
    first (ties: lower id first), p = w / total, dropped = 1 - sum(p). The native pass does the same."""
    rows, vocab = weights.shape
    if top_k < vocab:
        part = np.argpartition(-weights, top_k - 1, axis=1)[:, :top_k]
    else:
        part = np.broadcast_to(np.arange(vocab), (rows, vocab))
    w = np.take_along_axis(weights, part, axis=1)
    # lexsort's last key is primary: larger weight first, then the lower id
    order = np.lexsort((part, -w), axis=1)
    ids = np.take_along_axis(part, order, axis=1).astype(np.int32)
    p = np.take_along_axis(w, order, axis=1).astype(np.float64) / total[:, None]
    dropped = np.maximum(1.0 - p.sum(axis=1), 0.0)
    return ids, p.astype(np.float32), dropped


class NumpyStepSampler:
    """The reference implementation of the per-step logits pass (and the fallback without the native library)."""

    name = "numpy"

    def process_logits(self, logits: np.ndarray, temperature: np.float32, uniforms: np.ndarray,
                       top_k: int = 0) -> StepStats:
        processed = _as_float32_matrix(logits)
        np.divide(processed, np.float32(temperature), out=processed)
        argmax = processed.argmax(axis=1).astype(np.int64)
        row_max = processed[np.arange(processed.shape[0]), argmax][:, None]
        shifted = processed - row_max  # <= 0; the largest term is exp(0) = 1, so no overflow
        weights = np.exp(shifted)
        total = weights.sum(axis=1, dtype=np.float64)
        # H = log Z - E[x - max] with Z = sum exp(x - max)
        weighted = np.einsum("ij,ij->i", weights, shifted, dtype=np.float64)
        entropy = np.log(total) - weighted / total
        sampled = inverse_cdf_sample(weights, uniforms)
        stats = StepStats(entropy=np.maximum(entropy, 0.0), argmax=argmax, sampled=sampled, processed=processed)
        if _check_top_k(top_k, processed.shape[1]):
            stats.topk_ids, stats.topk_probs, stats.dropped_mass = top_k_softmax(weights, total, top_k)
        return stats


# ---- native fast path -------------------------------------------------------------------------

_NATIVE_SYMBOL = "dg_sampler_step_topk"


def _bind_native(lib: ctypes.CDLL):
    fn = getattr(lib, _NATIVE_SYMBOL)
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.POINTER(ctypes.c_float),  # logits [rows, vocab], overwritten with logits / temperature
        ctypes.c_int32,  # rows
        ctypes.c_int32,  # vocab
        ctypes.c_float,  # temperature
        ctypes.POINTER(ctypes.c_double),  # uniforms [rows]
        ctypes.POINTER(ctypes.c_double),  # entropy out [rows]
        ctypes.POINTER(ctypes.c_int32),  # argmax out [rows]
        ctypes.POINTER(ctypes.c_int32),  # sampled out [rows]
        ctypes.c_int32,  # top_k (0: none)
        ctypes.POINTER(ctypes.c_int32),  # top-k ids out [rows, top_k]
        ctypes.POINTER(ctypes.c_float),  # top-k probabilities out [rows, top_k]
        ctypes.POINTER(ctypes.c_double),  # dropped mass out [rows]
        ctypes.c_int32,  # threads (<= 0: all hardware threads)
    ]
    return fn


def _find_native_library() -> ctypes.CDLL | None:
    """Our patched libllama (it carries dg_sampler_step_topk), or a library named by $DG_SAMPLER_LIB."""
    explicit = os.environ.get("DG_SAMPLER_LIB")
    if explicit:
        try:
            return ctypes.CDLL(explicit)
        except OSError:
            return None
    try:
        from llama_cpp import llama_cpp as _llama  # type: ignore
    except Exception:  # not installed, or the shared library failed to load
        return None
    lib = getattr(_llama, "_lib", None)
    if lib is None or not hasattr(lib, _NATIVE_SYMBOL):
        return None
    return lib


class NativeStepSampler:
    """The per-step logits pass in C++ (`dg_sampler_step`): one multithreaded pass per row, in place."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL, n_threads: int | None = None):
        self._fn = _bind_native(lib)
        self.n_threads = int(n_threads) if n_threads else 0

    def process_logits(self, logits: np.ndarray, temperature: np.float32, uniforms: np.ndarray,
                       top_k: int = 0) -> StepStats:
        processed = _as_float32_matrix(logits)
        rows, vocab = processed.shape
        top_k = _check_top_k(top_k, vocab)
        uniforms = np.ascontiguousarray(uniforms, dtype=np.float64)
        if uniforms.shape != (rows,):
            raise DgError(f"native sampler: need {rows} uniforms, got {uniforms.shape}")
        entropy = np.empty(rows, dtype=np.float64)
        argmax = np.empty(rows, dtype=np.int32)
        sampled = np.empty(rows, dtype=np.int32)
        topk_ids = np.empty((rows, top_k), dtype=np.int32)
        topk_probs = np.empty((rows, top_k), dtype=np.float32)
        dropped = np.empty(rows, dtype=np.float64)
        status = self._fn(
            processed.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            rows,
            vocab,
            float(temperature),
            uniforms.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
            entropy.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
            argmax.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            sampled.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            top_k,
            topk_ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            topk_probs.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            dropped.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
            self.n_threads,
        )
        if status != 0:
            raise DgError(f"native sampler failed (status {status}): non-finite logits or bad arguments")
        stats = StepStats(entropy=entropy, argmax=argmax.astype(np.int64), sampled=sampled.astype(np.int64),
                          processed=processed)
        if top_k:
            stats.topk_ids, stats.topk_probs, stats.dropped_mass = topk_ids, topk_probs, dropped
        return stats


_native_lock = threading.Lock()
_native_cache: dict[str, ctypes.CDLL | None] = {}


def native_library() -> ctypes.CDLL | None:
    with _native_lock:
        key = os.environ.get("DG_SAMPLER_LIB", "")
        if key not in _native_cache:
            _native_cache[key] = _find_native_library()
        return _native_cache[key]


def make_step_sampler(kind: str = "auto", n_threads: int | None = None) -> StepSampler:
    """'auto' (native when the library has it, else numpy), 'native' (error if missing) or 'numpy'."""
    if kind not in ("auto", "native", "numpy"):
        raise DgError(f"invalid sampler backend {kind!r}: must be 'auto', 'native' or 'numpy'")
    if kind == "numpy":
        return NumpyStepSampler()
    lib = native_library()
    if lib is None:
        if kind == "native":
            raise DgError("native sampler unavailable: build the patched llama.cpp (python native/build.py)")
        return NumpyStepSampler()
    return NativeStepSampler(lib, n_threads=n_threads)


# ---- the rules on [C] vectors -------------------------------------------------------------------


def entropy_bound_accept_mask(entropy: np.ndarray, entropy_bound: float) -> np.ndarray:
    """Accept the lowest-entropy prefix with cumsum(H) - H <= bound (EntropyBoundSampler.accept_canvas).

    The first sorted position always passes (0 <= bound), so at least one token is accepted per step.
    """
    entropy32 = np.asarray(entropy, dtype=np.float32)
    order = np.argsort(entropy32, kind="stable")
    sorted_entropy = entropy32[order]
    mutual_information_bound = np.cumsum(sorted_entropy, dtype=np.float32) - sorted_entropy
    sorted_accept = mutual_information_bound <= np.float32(entropy_bound)
    mask = np.zeros(entropy32.shape[0], dtype=bool)
    mask[order] = sorted_accept
    return mask


def renoise_canvas(sampled: np.ndarray, accepted_mask: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Accepted positions keep the sampled token; every other position gets the fresh noise token."""
    return np.where(accepted_mask, sampled, noise).astype(np.int64)


def mean_entropy(entropy: np.ndarray) -> float:
    return float(np.mean(np.asarray(entropy, dtype=np.float32), dtype=np.float32))


class StableAndConfidentStop:
    """Adaptive stop: argmax canvas unchanged over the last `stability_threshold` steps and confident.

    The reference keeps the last `stability_threshold` argmax canvases and compares the current one
    with each. "Equal to each of the last T" is "equal to the previous one, which began a run of at
    least T equal canvases", so only the previous canvas and the length of its run are kept: one
    O(canvas) comparison per step, whatever the threshold."""

    def __init__(self, stability_threshold: int, confidence_threshold: float):
        self.stability_threshold = stability_threshold
        self.confidence_threshold = confidence_threshold
        self._previous: np.ndarray | None = None
        self._run = 0  # consecutive steps, ending at the previous one, with that same argmax canvas

    def reset(self) -> None:
        self._previous = None
        self._run = 0

    def __call__(self, argmax_canvas: np.ndarray, entropy: np.ndarray) -> bool:
        current = np.asarray(argmax_canvas)
        same = self._previous is not None and np.array_equal(self._previous, current)
        stable = self.stability_threshold == 0 or (same and self._run >= self.stability_threshold)
        self._run = self._run + 1 if same else 1
        self._previous = current.copy()
        confident = np.float32(mean_entropy(entropy)) < np.float32(self.confidence_threshold)
        return bool(stable and confident)


# ---- per canvas ---------------------------------------------------------------------------------


def first_end_index(tokens: Sequence[int] | np.ndarray, end_token_ids: Sequence[int]) -> int | None:
    hits = np.flatnonzero(np.isin(np.asarray(tokens), np.asarray(list(end_token_ids), dtype=np.int64)))
    return int(hits[0]) if hits.size else None


def finalize_canvas(canvas: np.ndarray, end_token_ids: Sequence[int], pad_token_id: int | None
                    ) -> tuple[np.ndarray, bool]:
    """The reference's `_finalize_canvas` for one sequence: (canvas with tokens after the first end
    token replaced by pad, whether an end token occurred). The end token itself is kept; without a
    pad id nothing is replaced (the reference then keeps the tokens after the end token)."""
    canvas = np.asarray(canvas, dtype=np.int64).copy()
    end_at = first_end_index(canvas, end_token_ids) if end_token_ids else None
    finished = end_at is not None
    if finished and pad_token_id is not None:
        canvas[end_at + 1:] = pad_token_id
    return canvas, finished


def count_valid_tokens(new_tokens: np.ndarray, pad_token_id: int | None) -> int:
    """The reference's numerator of tokens_per_forward: new tokens that are not the pad id
    (this excludes the padding after the end token, and any generated token equal to pad)."""
    new_tokens = np.asarray(new_tokens)
    if pad_token_id is None:
        return int(new_tokens.shape[0])
    return int((new_tokens != pad_token_id).sum())
