"""The OpenAI shapes `dg serve` answers with: completion bodies, stream chunks, usage, ids.

Every response carries `system_fingerprint` ("b" and the native build's key, then dg's version: a
change of either may change answers; llama-server's fingerprint is "b" and its build number),
`timings` (llama-server's figures: prompt and generated tokens, milliseconds, tokens per second)
and `dg`, dg's own figures (steps per canvas, decoder forwards, queue and total time, and which
decoder ran: "diffusion" or "autoregressive+grammar").
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from dgcli.engine.types import GenerationResult, StepEvent

FINISH_REASONS = {"end_token": "stop", "stop": "stop", "length": "length", "interrupted": "stop",
                  "pad_canvas": "stop", "context_full": "length", "grammar_dead_end": "stop"}
OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk"), "completion": ("text_completion", "text_completion")}


@functools.lru_cache(maxsize=1)
def system_fingerprint() -> str:
    """dg's version and the key of the native build (native/build.py writes it beside llama_cpp)."""
    try:
        version = metadata.version("dgcli")
    except metadata.PackageNotFoundError:
        version = "unknown"
    key = "unknown"
    try:
        import importlib.util  # noqa: PLC0415

        spec = importlib.util.find_spec("llama_cpp")
        for location in (spec.submodule_search_locations or []) if spec else []:
            marker = Path(location) / ".dg-build-key"
            if marker.is_file():
                key = marker.read_text(encoding="utf-8").strip()[:40] or key
                break
    except (ImportError, OSError, ValueError):
        pass
    return f"b{key}-dg{version}"


def new_id(kind: str) -> str:
    prefix = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_"}[kind]
    return prefix + uuid.uuid4().hex[:24]


def created_now() -> int:
    return int(time.time())


@dataclass
class ChoiceOutcome:
    """One finished choice, as the response bodies need it."""

    index: int
    result: GenerationResult
    queued_s: float
    finish: str
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    completion_tokens: int | None = None  # counted through a stop string; None: the whole answer
    decoder: str = "diffusion"

    @property
    def n_completion(self) -> int:
        n = self.result.n_new_tokens
        return n if self.completion_tokens is None else min(self.completion_tokens, n)


def usage(outcomes: list[ChoiceOutcome], prompt_tokens: int) -> dict[str, Any]:
    """Answer tokens as the CLI counts them (GenerationResult.n_new_tokens: before the end token), or
    through the stop string that cut an answer; prompt tokens once per prompt."""
    completion = sum(o.n_completion for o in outcomes)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def dg_stats(outcome: ChoiceOutcome) -> dict[str, Any]:
    r = outcome.result
    return {"decoder": outcome.decoder, "steps_per_canvas": r.steps_per_canvas,
            "decoder_forwards": r.decoder_forwards, "tokens_per_forward": round(r.tokens_per_forward, 4),
            "queued_s": round(outcome.queued_s, 4), "total_s": round(r.total_s, 4),
            "prefill_s": round(r.prefill_s, 4)}


def dg_field(outcomes: list[ChoiceOutcome]) -> dict[str, Any]:
    """The first choice's figures at the top (the single-choice shape); every choice's under "choices"."""
    top = dg_stats(outcomes[0])
    if len(outcomes) > 1:
        top["choices"] = [dg_stats(o) for o in outcomes]
    return top


def timings(outcomes: list[ChoiceOutcome], prompt_tokens: int) -> dict[str, Any]:
    """llama-server's `timings`: the prompt's prefill and the generation after it, over every choice."""
    prompt_ms = 1000 * max(o.result.prefill_s for o in outcomes)
    predicted_ms = 1000 * max(max(o.result.total_s - o.result.prefill_s, 0.0) for o in outcomes)
    predicted = sum(o.n_completion for o in outcomes)
    return {"prompt_n": prompt_tokens, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / prompt_tokens, 3) if prompt_tokens else 0.0,
            "prompt_per_second": round(1000 * prompt_tokens / prompt_ms, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": predicted, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / predicted, 3) if predicted else 0.0,
            "predicted_per_second": round(1000 * predicted / predicted_ms, 3) if predicted_ms > 0 else 0.0}


def finish_reason(stop_reason: str, stopped_by_stop_string: bool, has_tool_calls: bool) -> str:
    if has_tool_calls:
        return "tool_calls"
    if stopped_by_stop_string:
        return "stop"
    return FINISH_REASONS.get(stop_reason, "stop")


def completion_body(kind: str, rid: str, created: int, model: str, outcomes: list[ChoiceOutcome],
                    prompt_tokens: int) -> dict[str, Any]:
    choices = []
    for o in sorted(outcomes, key=lambda o: o.index):
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": o.content if o.content or not o.tool_calls
                                       else None, "reasoning_content": o.reasoning or None}
            if o.tool_calls:
                message["tool_calls"] = o.tool_calls
            choices.append({"index": o.index, "message": message, "logprobs": None, "finish_reason": o.finish})
        else:
            choices.append({"index": o.index, "text": o.content, "logprobs": None, "finish_reason": o.finish})
    return {"id": rid, "object": OBJECTS[kind][0], "created": created, "model": model,
            "system_fingerprint": system_fingerprint(), "choices": choices,
            "usage": usage(outcomes, prompt_tokens), "timings": timings(outcomes, prompt_tokens),
            "dg": dg_field(outcomes)}


def chunk_body(kind: str, rid: str, created: int, model: str, *, index: int = 0, reasoning: str = "",
               content: str = "", role: bool = False, tool_calls: list[dict[str, Any]] | None = None,
               finish: str | None = None, extra: dict[str, Any] | None = None,
               no_choices: bool = False) -> dict[str, Any]:
    """One streamed chunk. Chat: a delta (role / reasoning_content / content / tool_calls); completions: text."""
    body: dict[str, Any] = {"id": rid, "object": OBJECTS[kind][1], "created": created, "model": model,
                            "system_fingerprint": system_fingerprint()}
    if no_choices:
        body["choices"] = []
    elif kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = None
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        body["choices"] = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        body["choices"] = [{"index": index, "text": content, "logprobs": None, "finish_reason": finish}]
    if extra:
        body.update(extra)
    return body


def step_payload(event: StepEvent, piece: Any, choice: int = 0) -> dict[str, Any]:
    """`dg_step`: one denoising step of the canvas, enough to draw the CLI's live view remotely.
    StepEvent.to_json() (canvas, step, max_steps, temperature, argmax_canvas, accepted, n_accepted,
    mean_entropy, forward_s, sampling_s, stopped, sc_dropped_mass) plus `pieces`: each canvas
    token's text, so a client needs no tokenizer; `choice`: which choice's canvas it is."""
    payload = event.to_json()
    payload["pieces"] = [piece(int(t)) for t in np.asarray(event.argmax_canvas)]
    payload["choice"] = choice
    return payload
