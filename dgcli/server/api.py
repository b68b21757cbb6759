"""The OpenAI API's shapes for `dg serve`: request validation, response bodies, stream chunks, errors.

Pure functions over dicts (no HTTP here; dgcli/server/app.py serves them). What a request may carry:

- the OpenAI fields dg honours: `messages` (chat) or `prompt` (completions), `model` (echoed; one
  model is served), `max_tokens` / `max_completion_tokens`, `seed`, `stream`,
  `stream_options.include_usage`, `stop` (a string or up to 4), `n` (1 only);
- the diffusion sampler's parameters as extra fields (the CLI's flags): `steps` (or
  `max_denoising_steps`), `t_min`, `t_max`, `entropy_bound`, `stability_threshold`,
  `confidence_threshold`; unset ones take the GGUF's defaults;
- `dg_steps: true` (with `stream: true`): one extra chunk per denoising step carrying the canvas
  (`dg_step`, see step_chunk) and one per committed canvas (`dg_canvas`);
- fields that only tune an autoregressive sampler (`temperature`, `top_p`, penalties, `logit_bias`)
  are accepted and ignored: the diffusion sampler has its own temperature schedule (t_min/t_max).
Anything dg cannot do (tools, logprobs, images, n > 1) is a 400 naming the field.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dgcli.engine.rng import SEED_LIMIT
from dgcli.engine.types import GenerationResult, StepEvent
from dgcli.errors import DgError, InvalidParameter, check_utf8
from dgcli.params import DiffusionParams

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256

# extra request field -> DiffusionParams field
SAMPLER_FIELDS = {
    "steps": "max_denoising_steps",
    "max_denoising_steps": "max_denoising_steps",
    "t_min": "t_min",
    "t_max": "t_max",
    "entropy_bound": "entropy_bound",
    "stability_threshold": "stability_threshold",
    "confidence_threshold": "confidence_threshold",
}
INTEGER_SAMPLER_FIELDS = {"max_denoising_steps", "stability_threshold"}
UNSUPPORTED_FIELDS = {
    "tools": "tool calls", "tool_choice": "tool calls", "functions": "function calls",
    "function_call": "function calls", "audio": "audio output", "prediction": "predicted outputs",
    "suffix": "suffix (fill-in-the-middle)",
}
MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": " ".join(str(message).split()), "type": type, "param": param, "code": code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class CompletionRequest:
    """A validated request of either endpoint."""

    kind: str  # "chat" | "completion"
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    prompt: str | list[int] = ""  # completion: text, or token ids
    model: str | None = None
    params: DiffusionParams = field(default_factory=DiffusionParams)
    max_new_tokens: int = 256
    max_tokens_given: bool = False  # False: the server's default, shortened to what the context holds
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    dg_steps: bool = False


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _bad(f"'{name}' must be {what}", param=name)
    return value


def parse_request(body: Any, kind: str, defaults: DiffusionParams, default_max_tokens: int,
                  max_tokens_limit: int, canvas_length: int | None = None) -> CompletionRequest:
    """Validate a request body of /v1/chat/completions (kind "chat") or /v1/completions ("completion");
    canvas_length: the served model's, which bounds the steps a canvas may take."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    req = CompletionRequest(kind=kind)
    for name, what in UNSUPPORTED_FIELDS.items():
        if body.get(name) not in (None, [], {}):
            raise _bad(f"'{name}' is not supported: dg serve does not do {what}", param=name)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise _bad("'logprobs' is not supported by dg serve", param="logprobs")
    if kind == "completion" and body.get("echo"):
        raise _bad("'echo' is not supported by dg serve", param="echo")
    for name in ("n", "best_of"):
        n = _get(body, name, (int,), "an integer")
        if n is not None and n != 1:
            raise _bad(f"'{name}' must be 1: dg serve returns one choice per request", param=name)
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise _bad("only response_format {\"type\": \"text\"} is supported", param="response_format")

    if kind == "chat":
        req.messages = parse_messages(body.get("messages"))
    else:
        req.prompt = parse_prompt(body.get("prompt"))
    req.model = _get(body, "model", (str,), "a string")
    req.stream = bool(_get(body, "stream", (bool,), "true or false"))
    options = _get(body, "stream_options", (dict,), "an object")
    if options is not None:
        if not req.stream:
            raise _bad("'stream_options' is only allowed with stream: true", param="stream_options")
        req.include_usage = bool(_get(options, "include_usage", (bool,), "true or false"))
    req.dg_steps = bool(_get(body, "dg_steps", (bool,), "true or false"))
    if req.dg_steps and not req.stream:
        raise _bad("'dg_steps' streams the canvas per step: it needs stream: true", param="dg_steps")

    # a null field is an unset one: max_completion_tokens null beside max_tokens 5 leaves max_tokens in charge
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        req.max_new_tokens = default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad(f"'{name}' must be an integer >= 1", param=name)
    elif max_tokens > max_tokens_limit:
        raise _bad(f"'{name}' = {max_tokens} exceeds this server's limit of {max_tokens_limit}", param=name,
                   code="context_length_exceeded")
    else:
        req.max_new_tokens, req.max_tokens_given = max_tokens, True

    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < SEED_LIMIT:  # the engine's range: checked only once the request ran
        raise _bad(f"'seed' must be an integer in [0, {SEED_LIMIT - 1}]", param="seed")
    req.seed = seed
    req.stop = parse_stop(body.get("stop"))
    req.params = parse_sampler(body, defaults, canvas_length)
    return req


def parse_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"'{where}' must be an object with 'role' and 'content'", param=where)
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise _bad(f"'{where}.role' must be one of system, developer, user, assistant (got {role!r}); "
                       "tool messages are not supported", param=f"{where}.role")
        out.append({"role": MESSAGE_ROLES[role], "content": _message_text(message.get("content"), where)})
    return out


def _unicode(text: str, param: str) -> str:
    try:
        check_utf8(text, f"'{param}'")
    except DgError as err:
        raise _bad(str(err), param=param) from None
    return text


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _unicode(content, f"{where}.content")
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"'{where}.content[{j}]' is not a text part: dg serve takes text only",
                           param=f"{where}.content")
            texts.append(_unicode(part["text"], f"{where}.content"))
        return "".join(texts)
    raise _bad(f"'{where}.content' must be a string or an array of text parts", param=f"{where}.content")


def parse_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _bad("'prompt' is empty", param="prompt")
        return _unicode(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("'prompt' must be one prompt: dg serve takes one prompt per request", param="prompt")
    raise _bad("'prompt' must be a non-empty string or an array of token ids", param="prompt")


def parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' must be a string or an array of at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"each 'stop' string must be at most {MAX_STOP_CHARS} characters", param="stop")
    return [s for s in stops if s]


def parse_sampler(body: dict, defaults: DiffusionParams, canvas_length: int | None = None) -> DiffusionParams:
    values: dict[str, Any] = {}
    for name, target in SAMPLER_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        integral = target in INTEGER_SAMPLER_FIELDS
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and not isinstance(value, int)) \
                or not math.isfinite(value):
            raise _bad(f"'{name}' must be {'an integer' if integral else 'a number'}", param=name)
        if target in values and values[target] != value:
            raise _bad(f"'{name}' contradicts another field setting {target}", param=name)
        values[target] = value
    try:
        # with the canvas, as the engine validates them once the request runs (too late for a 400)
        return defaults.replace(**values).validate(canvas_length)
    except InvalidParameter as err:
        field_name = next((n for n, t in SAMPLER_FIELDS.items() if t == err.name and n in body), err.name)
        raise _bad(f"invalid {field_name}={err.value!r}: must be {err.allowed}", param=field_name) from None


# ---- responses ----------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


FINISH_REASONS = {"end_token": "stop", "stop": "stop", "length": "length", "interrupted": "stop"}


def usage(result: GenerationResult, completion_tokens: int | None = None) -> dict[str, int]:
    """Answer tokens as the CLI counts them (GenerationResult.n_new_tokens: before the end token), or
    `completion_tokens` when a stop string cut the answer (AnswerStream.stop_tokens)."""
    completion = result.n_new_tokens if completion_tokens is None else min(completion_tokens, result.n_new_tokens)
    return {"prompt_tokens": result.n_prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.n_prompt_tokens + completion}


def dg_stats(result: GenerationResult, queued_s: float) -> dict[str, Any]:
    """dg's own figures for a request (an extra top-level field; clients ignore it)."""
    return {"steps_per_canvas": result.steps_per_canvas, "decoder_forwards": result.decoder_forwards,
            "tokens_per_forward": round(result.tokens_per_forward, 4), "queued_s": round(queued_s, 4),
            "total_s": round(result.total_s, 4), "prefill_s": round(result.prefill_s, 4)}


def completion_body(kind: str, rid: str, created: int, model: str, reasoning: str, content: str, finish: str,
                    result: GenerationResult, queued_s: float, completion_tokens: int | None = None) -> dict[str, Any]:
    if kind == "chat":
        message = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(result, completion_tokens), "dg": dg_stats(result, queued_s)}


def chunk_body(kind: str, rid: str, created: int, model: str, *, reasoning: str = "", content: str = "",
               role: bool = False, finish: str | None = None, extra: dict[str, Any] | None = None,
               no_choices: bool = False) -> dict[str, Any]:
    """One streamed chunk. Chat: a delta (role / reasoning_content / content); completions: text."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
    if no_choices:
        body["choices"] = []
    elif kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        body["choices"] = [{"index": 0, "text": content, "logprobs": None, "finish_reason": finish}]
    if extra:
        body.update(extra)
    return body


def step_payload(event: StepEvent, piece: Any) -> dict[str, Any]:
    """`dg_step`: one denoising step of the canvas, enough to draw the CLI's live view remotely.
    StepEvent.to_json() (canvas, step, max_steps, temperature, argmax_canvas, accepted, n_accepted,
    mean_entropy, forward_s, sampling_s, stopped, sc_dropped_mass) plus `pieces`: each canvas
    token's text, so a client needs no tokenizer."""
    payload = event.to_json()
    payload["pieces"] = [piece(int(t)) for t in np.asarray(event.argmax_canvas)]
    return payload


def created_now() -> int:
    return int(time.time())
