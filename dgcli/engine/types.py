"""The shapes that cross the engine boundary: per-step events and results (the parameters are
dgcli.params.DiffusionParams, the errors dgcli.errors).

The CLI, the tests and the benchmarks only ever see these; both engines (diffusion and
autoregressive) produce the same result type so that `compare` and `bench` treat them alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np


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
    # | "worker_lost" (WORKER_LOST: an RPC worker holding layers failed; interrupted is True too)
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
