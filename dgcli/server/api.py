"""What a request to `dg serve` may carry, validated: pure functions over the parsed JSON body.

- the OpenAI fields dg honours: `messages` (chat, tool messages included) or `prompt` (completions:
  one or several prompts, text or token ids), `model` (the one served; another is a 404),
  `max_tokens` / `max_completion_tokens`, `seed`, `stream`, `stream_options.include_usage`,
  `stop` (a string or up to 4), `n` (choices per prompt), `tools` / `tool_choice`
  (dgcli/server/tools.py), `response_format` (dgcli/server/structured.py; llama-server's
  `json_schema` field too);
- the diffusion sampler's parameters as extra fields (the CLI's flags): `steps` (or
  `max_denoising_steps`), `t_min`, `t_max`, `entropy_bound`, `stability_threshold`,
  `confidence_threshold`; unset ones take the GGUF's defaults;
- `dg_steps: true` (with `stream: true`): one extra chunk per denoising step carrying the canvas
  (`dg_step`) and one per committed canvas (`dg_canvas`);
- `temperature` (OpenAI's range, 0 to 2) tunes only the grammar-constrained autoregressive decoder
  (structured output, forced tool calls; unset: greedy); `top_p` and the penalties are checked and
  ignored: the diffusion sampler has its own temperature schedule (t_min/t_max).
Every malformed or unsupported field is an ApiError 400 naming it (`param`).
"""

from __future__ import annotations

import math
from typing import Any

from dgcli.engine.rng import SEED_LIMIT
from dgcli.errors import InvalidParameter
from dgcli.params import DiffusionParams
from dgcli.server.request import CompletionRequest, bad, get_field, number_in, unicode_text
from dgcli.server.structured import parse_response_format
from dgcli.server.tools import parse_message_tool_calls, parse_tool_choice, parse_tools

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_CHOICES = 16  # n x prompts in one request
MAX_MESSAGES = 4096

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
# OpenAI's ranges for the fields dg checks but does not use (or uses only in the AR decoder)
OPENAI_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
                  "frequency_penalty": (-2.0, 2.0)}
UNSUPPORTED_FIELDS = {
    "functions": "the deprecated 'functions' (send 'tools')", "function_call": "the deprecated 'function_call' "
    "(send 'tool_choice')", "audio": "audio output", "prediction": "predicted outputs",
    "suffix": "suffix (fill-in-the-middle)", "grammar": "raw grammars (send response_format with a json_schema)",
}
MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def parse_request(body: Any, kind: str, defaults: DiffusionParams, default_max_tokens: int,
                  max_tokens_limit: int, canvas_length: int | None = None) -> CompletionRequest:
    """Validate a request body of /v1/chat/completions (kind "chat") or /v1/completions ("completion");
    canvas_length: the served model's, which bounds the steps a canvas may take."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    req = CompletionRequest(kind=kind)
    for name, what in UNSUPPORTED_FIELDS.items():
        if body.get(name) not in (None, [], {}):
            raise bad(f"'{name}' is not supported: dg serve does not do {what}", param=name)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad("'logprobs' is not supported by dg serve: a canvas's tokens are not drawn one by one "
                  "from a distribution", param="logprobs")
    if kind == "completion" and body.get("echo"):
        raise bad("'echo' is not supported by dg serve", param="echo")
    req.n = parse_count(body, "n")
    best_of = parse_count(body, "best_of")
    if best_of != req.n and body.get("best_of") is not None:
        raise bad("'best_of' must equal n: dg serve returns every choice it makes", param="best_of")

    if kind == "chat":
        req.messages = parse_messages(body.get("messages"))
        req.tools = parse_tools(body.get("tools"))
        req.tool_choice = parse_tool_choice(body.get("tool_choice"), req.tools)
        req.parallel_tool_calls = get_field(body, "parallel_tool_calls", (bool,), "true or false") is not False
    else:
        req.prompts = parse_prompts(body.get("prompt"))
        for name in ("tools", "tool_choice"):
            if body.get(name) is not None:
                raise bad(f"'{name}' belongs to /v1/chat/completions", param=name)
    if req.n_choices > MAX_CHOICES:
        raise bad(f"n x prompts = {req.n_choices} exceeds dg serve's limit of {MAX_CHOICES} choices per request",
                  param="n")
    req.response_format = parse_response_format(body.get("response_format"))
    if body.get("json_schema") is not None:  # llama-server's shorthand for a json_schema response_format
        if req.response_format is not None:
            raise bad("send either 'json_schema' or 'response_format'", param="json_schema")
        req.response_format = parse_response_format({"type": "json_schema", "json_schema": {
            "schema": body["json_schema"]}}, "json_schema")
    req.model = get_field(body, "model", (str,), "a string")
    parse_openai_numbers(body, req)
    req.stream = bool(get_field(body, "stream", (bool,), "true or false"))
    options = get_field(body, "stream_options", (dict,), "an object")
    if options is not None:
        if not req.stream:
            raise bad("'stream_options' is only allowed with stream: true", param="stream_options")
        req.include_usage = bool(get_field(options, "include_usage", (bool,), "true or false",
                                           "stream_options.include_usage"))
    req.dg_steps = bool(get_field(body, "dg_steps", (bool,), "true or false"))
    if req.dg_steps and not req.stream:
        raise bad("'dg_steps' streams the canvas per step: it needs stream: true", param="dg_steps")
    parse_max_tokens(body, req, default_max_tokens, max_tokens_limit)
    seed = get_field(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < SEED_LIMIT:  # the engine's range: checked only once the request ran
        raise bad(f"'seed' must be an integer in [0, {SEED_LIMIT - 1}]", param="seed")
    req.seed = seed
    req.stop = parse_stop(body.get("stop"))
    req.params = parse_sampler(body, defaults, canvas_length)
    return req


def parse_count(body: dict, name: str) -> int:
    value = get_field(body, name, (int,), f"an integer from 1 to {MAX_CHOICES}")
    if value is None:
        return 1
    if not 1 <= value <= MAX_CHOICES:
        raise bad(f"'{name}' must be an integer from 1 to {MAX_CHOICES}", param=name)
    return value


def parse_openai_numbers(body: dict, req: CompletionRequest) -> None:
    for name, (low, high) in OPENAI_NUMBERS.items():
        value = body.get(name)
        if value is not None and not number_in(value, low, high):
            raise bad(f"'{name}' must be a number from {low:g} to {high:g}", param=name)
    if body.get("temperature") is not None:
        req.temperature = float(body["temperature"])
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise bad("'logit_bias' must be an object", param="logit_bias")


def parse_max_tokens(body: dict, req: CompletionRequest, default: int, limit: int) -> None:
    # a null field is an unset one: max_completion_tokens null beside max_tokens 5 leaves max_tokens in charge
    names = [n for n in ("max_completion_tokens", "max_output_tokens", "max_tokens") if body.get(n) is not None]
    name = names[0] if names else "max_tokens"
    req.max_tokens_param = name
    max_tokens = body.get(name)
    if max_tokens is None:
        req.max_new_tokens = default
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad(f"'{name}' must be an integer >= 1", param=name)
    elif max_tokens > limit:
        raise bad(f"'{name}' = {max_tokens if max_tokens < 10**12 else 'a huge number'} exceeds this server's "
                  f"limit of {limit}", param=name, code="context_length_exceeded")
    else:
        req.max_new_tokens, req.max_tokens_given = max_tokens, True


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> what the chat template takes: {"role", "content"} (text), assistant
    tool_calls with their arguments as objects, tool results with their call's id and name."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content} objects", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise bad(f"'messages' holds more than {MAX_MESSAGES} messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"'{where}' must be an object with 'role' and 'content'", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            shown = role if isinstance(role, str) and len(role) <= 40 else type(role).__name__
            raise bad(f"'{where}.role' must be one of system, developer, user, assistant, tool (got {shown!r})",
                      param=f"{where}.role")
        entry: dict[str, Any] = {"role": MESSAGE_ROLES[role], "content": message_text(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls") is not None:
            entry["tool_calls"] = parse_message_tool_calls(message["tool_calls"], where)
        if role == "tool":
            call_id = get_field(message, "tool_call_id", (str,), "a string", f"{where}.tool_call_id")
            if call_id is None:
                raise bad(f"'{where}.tool_call_id' is missing: a tool message answers a tool call",
                          param=f"{where}.tool_call_id")
            entry["tool_call_id"] = unicode_text(call_id, f"{where}.tool_call_id")
        name = get_field(message, "name", (str,), "a string", f"{where}.name")
        if name is not None:
            entry["name"] = unicode_text(name, f"{where}.name")
        out.append(entry)
    return out


TEXT_PART_TYPES = ("text", "input_text", "output_text")


def message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return unicode_text(content, f"{where}.content")
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES \
                    or not isinstance(part.get("text"), str):
                raise bad(f"'{where}.content[{j}]' is not a text part: dg serve takes text only",
                          param=f"{where}.content")
            texts.append(unicode_text(part["text"], f"{where}.content"))
        return "".join(texts)
    raise bad(f"'{where}.content' must be a string or an array of text parts", param=f"{where}.content")


def is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """A prompt (text or token ids) or a batch of them (strings, or lists of token ids)."""
    if isinstance(prompt, str) or is_token_list(prompt):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_token_list(p) for p in prompt):
        batch = list(prompt)
    else:
        raise bad("'prompt' must be a non-empty string, an array of token ids, or an array of either",
                  param="prompt")
    out: list[str | list[int]] = []
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p.strip():
                raise bad(f"'{where}' is empty", param="prompt")
            out.append(unicode_text(p, where))
        else:
            out.append(list(p))
    return out


def parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise bad(f"'stop' must be a string or an array of at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"each 'stop' string must be at most {MAX_STOP_CHARS} characters", param="stop")
    return [unicode_text(s, "stop") for s in stops if s]


def parse_sampler(body: dict, defaults: DiffusionParams, canvas_length: int | None = None) -> DiffusionParams:
    values: dict[str, Any] = {}
    for name, target in SAMPLER_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        integral = target in INTEGER_SAMPLER_FIELDS
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and not isinstance(value, int)):
            raise bad(f"'{name}' must be {'an integer' if integral else 'a number'}", param=name)
        if not number_in(value, -math.inf, math.inf):  # nan, or an integer of hundreds of digits
            raise bad(f"'{name}' must be {'an integer' if integral else 'a number'} of a sensible size", param=name)
        if target in values and values[target] != value:
            raise bad(f"'{name}' contradicts another field setting {target}", param=name)
        values[target] = value
    try:
        # with the canvas, as the engine validates them once the request runs (too late for a 400)
        return defaults.replace(**values).validate(canvas_length)
    except InvalidParameter as err:
        field_name = next((n for n, t in SAMPLER_FIELDS.items() if t == err.name and n in body), err.name)
        value = err.value if not isinstance(err.value, int) or abs(err.value) < 10**12 else "a huge number"
        raise bad(f"invalid {field_name}={value!r}: must be {err.allowed}", param=field_name) from None
