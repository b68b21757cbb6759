"""The shapes that cross the engine boundary: parameters, per-step events, results, errors.

The CLI, the tests and the benchmarks only ever see these; both engines (diffusion and
autoregressive) produce the same result type so that `compare` and `bench` treat them alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np


class DgError(Exception):
    """An error a user can act on. The CLI prints `str(err)` on one line and exits non-zero."""


class InvalidParameter(DgError, ValueError):
    """A sampler or generation parameter outside its allowed range."""

    def __init__(self, name: str, value: Any, allowed: str):
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"invalid {name}={value!r}: must be {allowed}")


class ModelLoadError(DgError):
    """A file that is missing, not a GGUF, truncated, malformed, or of the wrong architecture."""


class ContextFull(DgError):
    """The KV cache has no room for what a forward would add (the engines stop with "context_full")."""


def check_utf8(text: str, what: str) -> None:
    """Text no tokenizer takes: bytes that are not UTF-8 (command-line arguments, lines typed or piped)
    arrive as lone surrogates, and JSON's \\uXXXX escapes can spell one. The error names the byte
    where the UTF-8 text stops."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        offset = len(text[:err.start].encode("utf-8"))
        raise DgError(f"{what} is not UTF-8 text (byte {offset})") from None


# The reference's defaults (DiffusionGemmaGenerationConfig._get_default_generation_params).
DEFAULT_MAX_DENOISING_STEPS = 48
DEFAULT_T_MIN = 0.4
DEFAULT_T_MAX = 0.8
DEFAULT_ENTROPY_BOUND = 0.1
DEFAULT_STABILITY_THRESHOLD = 1
DEFAULT_CONFIDENCE_THRESHOLD = 0.005

# What is meaningful, so that a flag or a GGUF key cannot make a run go on for ever: a canvas up to
# 4x the published 256 tokens; up to 4 denoising steps per canvas position (every step accepts at
# least one; the reference's 48 on 256 positions is 0.19 per position), never fewer than the
# reference's 48; a stability threshold within the steps (beyond them the stop can never fire).
MAX_CANVAS_LENGTH = 1024
MAX_STEPS_PER_CANVAS_POSITION = 4
# The sampler computes in float32 (as the reference): a temperature outside [1e-30, 1e30] becomes 0 or
# inf there (1e-320 and 1e308 are finite doubles), and a bound beyond 1e30 overflows its cast.
# t_max >= 1e-30 keeps the schedule's smallest temperature, t_max / max_steps at t_min = 0, > 0.
MIN_T_MAX = 1e-30
MAX_SAMPLER_FLOAT = 1e30


def max_denoising_steps_for(canvas_length: int | None) -> int:
    """The largest meaningful max_denoising_steps for a canvas of `canvas_length` tokens."""
    canvas = canvas_length if canvas_length else MAX_CANVAS_LENGTH
    return max(MAX_STEPS_PER_CANVAS_POSITION * canvas, DEFAULT_MAX_DENOISING_STEPS)


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and math.isfinite(value)


# The published files' sampler keys (unprefixed, optional) -> DiffusionParams field.
DIFFUSION_PARAM_KEYS = {
    "diffusion.eb_max_steps": "max_denoising_steps",
    "diffusion.eb_t_min": "t_min",
    "diffusion.eb_t_max": "t_max",
    "diffusion.eb_entropy_bound": "entropy_bound",
    "diffusion.eb_stability_threshold": "stability_threshold",
    "diffusion.eb_confidence_threshold": "confidence_threshold",
}

# The GGUF keys a dg-written file filled with the reference's defaults because the checkpoint had no
# value (a string array; absent when every value came from the checkpoint). The published converter
# leaves such keys out, and every loader falls back to the same defaults; `dg info` says which they are.
REFERENCE_DEFAULTS_KEY = "dg.reference_defaults"


@dataclass(frozen=True)
class DiffusionParams:
    """The block-diffusion sampler's knobs (GGUF `diffusion.eb_*` keys give a model's defaults)."""

    max_denoising_steps: int = DEFAULT_MAX_DENOISING_STEPS
    t_min: float = DEFAULT_T_MIN
    t_max: float = DEFAULT_T_MAX
    entropy_bound: float = DEFAULT_ENTROPY_BOUND
    stability_threshold: int = DEFAULT_STABILITY_THRESHOLD
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD

    def validate(self, canvas_length: int | None = None) -> "DiffusionParams":
        """Raise InvalidParameter naming the first bad value and its allowed range. The step
        bound depends on the canvas (`max_denoising_steps_for`); without one, the largest canvas's."""
        max_steps = max_denoising_steps_for(canvas_length)
        if not is_int(self.max_denoising_steps) or not 1 <= self.max_denoising_steps <= max_steps:
            where = f"a {canvas_length}-token canvas" if canvas_length else "any canvas"
            raise InvalidParameter("max_denoising_steps", self.max_denoising_steps,
                                   f"an integer between 1 and {max_steps} (the most that is meaningful for {where})")
        if not is_real(self.t_min) or not 0 <= self.t_min <= MAX_SAMPLER_FLOAT:
            raise InvalidParameter("t_min", self.t_min, f"a number >= 0 and at most {MAX_SAMPLER_FLOAT:g}")
        if not is_real(self.t_max) or not MIN_T_MAX <= self.t_max <= MAX_SAMPLER_FLOAT:
            raise InvalidParameter("t_max", self.t_max,
                                   f"a number between {MIN_T_MAX:g} and {MAX_SAMPLER_FLOAT:g}")
        # equal ends are a constant temperature (--temp); the reference refuses them, for no reason
        # its schedule needs (t_min + (t_max - t_min) * n / N is then t_min at every step)
        if self.t_max < self.t_min:
            raise InvalidParameter("t_max", self.t_max, f"at least t_min ({self.t_min})")
        if not is_real(self.entropy_bound) or not 0 < self.entropy_bound <= MAX_SAMPLER_FLOAT:
            raise InvalidParameter("entropy_bound", self.entropy_bound,
                                   f"a number > 0 and at most {MAX_SAMPLER_FLOAT:g}")
        if not is_int(self.stability_threshold) or not 0 <= self.stability_threshold <= self.max_denoising_steps:
            raise InvalidParameter("stability_threshold", self.stability_threshold,
                                   f"an integer between 0 and max_denoising_steps ({self.max_denoising_steps})")
        if not is_real(self.confidence_threshold) or not 0 < self.confidence_threshold <= MAX_SAMPLER_FLOAT:
            raise InvalidParameter("confidence_threshold", self.confidence_threshold,
                                   f"a number > 0 and at most {MAX_SAMPLER_FLOAT:g}")
        return self

    def replace(self, **overrides: Any) -> "DiffusionParams":
        """A copy with the given fields replaced; None values are ignored (CLI flags left unset)."""
        values = asdict(self)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return DiffusionParams(**values)


@dataclass
class StepEvent:
    """One denoising step of the diffusion engine."""

    canvas_index: int  # 0-based canvas within this generation
    step: int  # 1-based step within the canvas
    max_steps: int
    temperature: float
    argmax_canvas: np.ndarray  # int32 [canvas_length]: the canvas as it would be committed now
    accepted_mask: np.ndarray  # bool [canvas_length]: positions accepted (kept) this step
    n_accepted: int
    mean_entropy: float
    forward_s: float  # decoder forward (native)
    sampling_s: float  # sampling + host work for this step
    stopped: bool  # the adaptive stop fired on this step
    # largest softmax mass any position's top-k left out of this step's self-conditioning input
    # (0.0: dense, or a canvas's first step): the size of the sparse approximation
    sc_dropped_mass: float = 0.0

    kind = "step"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "canvas": self.canvas_index,
            "step": self.step,
            "max_steps": self.max_steps,
            "temperature": self.temperature,
            "argmax_canvas": [int(t) for t in self.argmax_canvas],
            "accepted": [bool(a) for a in self.accepted_mask],
            "n_accepted": self.n_accepted,
            "mean_entropy": self.mean_entropy,
            "forward_s": self.forward_s,
            "sampling_s": self.sampling_s,
            "stopped": self.stopped,
            "sc_dropped_mass": self.sc_dropped_mass,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "StepEvent":
        """The event back from `to_json()` (e.g. a `dg serve` stream's dg_step), for the live view."""
        return cls(canvas_index=int(doc["canvas"]), step=int(doc["step"]), max_steps=int(doc["max_steps"]),
                   temperature=float(doc["temperature"]),
                   argmax_canvas=np.asarray(doc["argmax_canvas"], dtype=np.int32),
                   accepted_mask=np.asarray(doc["accepted"], dtype=bool), n_accepted=int(doc["n_accepted"]),
                   mean_entropy=float(doc["mean_entropy"]), forward_s=float(doc["forward_s"]),
                   sampling_s=float(doc["sampling_s"]), stopped=bool(doc["stopped"]),
                   sc_dropped_mass=float(doc.get("sc_dropped_mass", 0.0)))


@dataclass
class TokenEvent:
    """One decoded token of the autoregressive engine."""

    index: int  # 0-based index of the new token
    token_id: int
    piece: str
    forward_s: float
    sampling_s: float

    kind = "token"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "index": self.index,
            "token_id": self.token_id,
            "piece": self.piece,
            "forward_s": self.forward_s,
            "sampling_s": self.sampling_s,
        }


@dataclass
class CanvasEvent:
    """A canvas was committed (diffusion) — emitted after its last StepEvent."""

    canvas_index: int
    token_ids: list[int]  # committed tokens of this canvas, after end-token trimming
    steps: int
    commit_s: float  # encoder pass that appended the canvas to the KV cache

    kind = "canvas"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "canvas": self.canvas_index, "token_ids": self.token_ids,
                "steps": self.steps, "commit_s": self.commit_s}


def answer_token_ids(tokens: Sequence[int], end_token_ids: Sequence[int], pad_token_id: int | None,
                     limit: int | None = None) -> list[int]:
    """THE definition of the tokens of an answer, used for every figure a user reads (new tokens,
    tok/s, tokens per forward, speedup) by generate, compare, bench, chat and --json:
    the tokens before the first end token, pad tokens dropped, at most `limit` of them."""
    ends = set(int(t) for t in end_token_ids)
    out: list[int] = []
    for token in tokens:
        token = int(token)
        if token in ends or (limit is not None and len(out) >= limit):
            break
        if token != pad_token_id:
            out.append(token)
    return out


@dataclass
class GenerationResult:
    """What one generation produced. Same shape for both engines.

    `token_ids` are the answer's tokens (`answer_token_ids`: no end token, no pads, at most
    max_new_tokens); every rate below counts them and nothing else."""

    mode: str  # "diffusion" | "autoregressive"
    text: str
    token_ids: list[int]  # the answer's tokens (answer_token_ids)
    n_prompt_tokens: int
    steps_per_canvas: list[int] = field(default_factory=list)  # diffusion only
    decoder_forwards: int = 0  # forwards that produced new tokens (AR: one per token)
    tokens_per_forward: float = 0.0  # answer tokens / decoder forwards
    prefill_s: float = 0.0
    total_s: float = 0.0  # wall time of the generation, without the time spent in the caller's on_event
    forward_s: float = 0.0  # sum of forward time over steps/tokens
    # how many forwards forward_s times (None: decoder_forwards); AR: the decode calls, which are one fewer
    # than its tokens when the last token needed no forward after it (max_new_tokens reached): the first
    # token's logits came from the prefill
    timed_forwards: int | None = None
    sampling_s: float = 0.0  # sum of sampling/host time over steps/tokens
    # "end_token" | "pad_canvas" (a canvas of padding only: ends as an end token would) | "length" | "interrupted"
    # | "stop" (the caller asked for no further canvas: a stop string in dg serve)
    # | "context_full" (no room in the KV cache for another canvas or token)
    stop_reason: str = "length"
    interrupted: bool = False
    seed: int | None = None  # the seed the run used (picked at random when none was given)
    display_s: float = 0.0  # time spent in the caller's on_event (drawing, pacing): not in total_s
    n_cached_prompt_tokens: int = 0  # prompt tokens found in the KV cache already (chat turns), not prefilled
    # answer tokens whose logits came from the prefill (AR: the first token, when it is an answer token): made
    # before the time tok/s divides by, so not counted in it
    prefill_answer_tokens: int = 0
    # diffusion: the self-conditioning form the steps fed back, "dense" (the reference's) or "top-K"
    self_conditioning: str | None = None
    # diffusion: every finalized canvas as the reference returns it (end token and padding kept)
    canvas_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def n_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def generation_s(self) -> float:
        """Wall time after the prefill: what tok/s divides by."""
        return max(self.total_s - self.prefill_s, 0.0)

    @property
    def mean_forward_s(self) -> float | None:
        """The mean decoder forward (a canvas forward, or one AR decode); None when none was timed."""
        timed = self.decoder_forwards if self.timed_forwards is None else self.timed_forwards
        return self.forward_s / timed if timed > 0 else None

    @property
    def tokens_per_second(self) -> float | None:
        """Answer tokens made after the prefill over the time after the prefill; None when every answer token
        came from the prefill (AR at -n 1: no decode step made one, so there is no rate to show)."""
        made = self.n_new_tokens - self.prefill_answer_tokens
        if self.n_new_tokens and made <= 0:
            return None
        gen_s = self.generation_s
        return made / gen_s if gen_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["canvas_token_ids"]  # the trace holds the canvases
        out["n_new_tokens"] = self.n_new_tokens
        out["tokens_per_second"] = self.tokens_per_second
        return out
