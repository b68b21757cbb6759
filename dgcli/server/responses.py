"""OpenAI's Responses API (`POST /v1/responses`) in `dg serve`, for text in and text out.

`input` (a string, or messages whose content is text: input_text / output_text parts) and
`instructions` (a system message) go through the chat template as /v1/chat/completions does; the
answer is one `message` output item of `output_text` (and a `reasoning` item when the model
thought aloud). `max_output_tokens`, `text.format` (json_object / json_schema: structured output),
`stream`, and dg's own sampler fields are honoured; tools, stored conversations
(`previous_response_id`) and non-text input are a 400 naming the field.

Streamed, the events are OpenAI's: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta ... ,
response.output_text.done, response.content_part.done, response.output_item.done,
response.completed (or `error`), each with a sequence_number.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dgcli.params import DiffusionParams
from dgcli.server.api import message_text, parse_request
from dgcli.server.bodies import ChoiceOutcome, dg_field, system_fingerprint
from dgcli.server.http import EventStreamResponse, error_response, wait_unless_gone
from dgcli.server.request import ApiError, CompletionRequest, bad
from dgcli.server.run import Delta, Failed, Finished, Job, failure_error
from dgcli.server.structured import parse_response_format

if TYPE_CHECKING:
    from dgcli.server.app import Endpoints

UNSUPPORTED = {"previous_response_id": "stored conversations", "conversation": "stored conversations",
               "tools": "tools on /v1/responses (use /v1/chat/completions)", "background": "background responses",
               "prompt": "stored prompts", "include": "extra output (include)"}
INPUT_ROLES = ("user", "system", "developer", "assistant")


def parse_responses_request(body: Any, defaults: DiffusionParams, default_max_tokens: int, max_tokens_limit: int,
                            canvas_length: int | None) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, False):
            raise bad(f"'{name}' is not supported: dg serve does not do {what}", param=name)
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": message_text(instructions, "instructions")})
    messages += _input_messages(body.get("input"))
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "text", "max_output_tokens",
                                                        "store", "metadata", "reasoning", "truncation", "user",
                                                        "service_tier", "parallel_tool_calls", "tool_choice")}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_output_tokens"] = body["max_output_tokens"]
    req = parse_request(chat, "chat", defaults, default_max_tokens, max_tokens_limit, canvas_length)
    req.kind = "responses"
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad("'text' must be an object", param="text")
        req.response_format = parse_response_format(text.get("format"), "text.format")
    return req


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value.strip():
            raise bad("'input' is empty", param="input")
        return [{"role": "user", "content": message_text(value, "input")}]
    if not isinstance(value, list) or not value:
        raise bad("'input' must be a string or a non-empty array of messages", param="input")
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise bad(f"'{where}' must be a message (got {str(kind)[:40]!r}): dg serve takes text messages only",
                      param=where)
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(INPUT_ROLES)}", param=f"{where}.role")
        out.append({"role": role, "content": item.get("content")})
    return out


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class ResponseShape:
    """The response object and its output items, as they stand."""

    def __init__(self, job: Job, req: CompletionRequest):
        self.job, self.req = job, req
        self.message_id = "msg_" + uuid.uuid4().hex[:24]
        self.reasoning_id = "rs_" + uuid.uuid4().hex[:24]

    def body(self, status: str, outcome: ChoiceOutcome | None = None, text: str = "") -> dict[str, Any]:
        req, job = self.req, self.job
        fmt = {"type": "text"} if req.response_format is None else (
            {"type": "json_object"} if req.response_format.type == "json_object" else
            {"type": "json_schema", "name": req.response_format.name or "schema",
             "schema": req.response_format.schema, "strict": True})
        body: dict[str, Any] = {
            "id": job.rid, "object": "response", "created_at": job.created, "status": status, "error": None,
            "incomplete_details": None, "instructions": None, "max_output_tokens": req.max_new_tokens,
            "model": job.model_name, "output": [], "parallel_tool_calls": False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": req.temperature,
            "text": {"format": fmt}, "tool_choice": "none", "tools": [], "top_p": None, "truncation": "disabled",
            "usage": None, "metadata": {}, "system_fingerprint": system_fingerprint()}
        if outcome is not None:
            if outcome.reasoning:
                body["output"].append(self.reasoning_item(outcome.reasoning))
            body["output"].append(self.message_item("completed", outcome.content))
            n_out = outcome.n_completion
            body["usage"] = {"input_tokens": job.n_prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": job.n_prompt_tokens + n_out}
            body["dg"] = dg_field([outcome])
            if outcome.finish == "length":
                body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return body

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [{"type": "summary_text", "text": text}]}

    def message_item(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self.text_part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def respond(endpoints: "Endpoints", request: Request, req: CompletionRequest) -> Response:

    job = await endpoints.start(req)
    shape = ResponseShape(job, req)
    if req.stream:
        return EventStreamResponse(stream(job, shape))
    try:
        outcome = await wait_unless_gone(request, job)
    finally:
        job.release()
    if isinstance(outcome, ApiError):
        return error_response(outcome)
    if outcome is None:
        return Response(status_code=499)
    return JSONResponse(shape.body("completed", outcome[0]))


async def stream(job: Job, shape: ResponseShape) -> AsyncIterator[str]:
    sequence = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> str:
        return _sse({"type": kind, "sequence_number": next(sequence), **fields})

    item = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}
    text: list[str] = []
    try:
        yield event("response.created", response=shape.body("in_progress"))
        yield event("response.in_progress", response=shape.body("in_progress"))
        yield event("response.output_item.added", output_index=0, item=shape.message_item("in_progress", None))
        yield event("response.content_part.added", part=shape.text_part(""), **item)
        async for update in job.events():
            if isinstance(update, Delta) and update.content:
                text.append(update.content)
                yield event("response.output_text.delta", delta=update.content, logprobs=[], **item)
            elif isinstance(update, Failed):
                err = failure_error(update.event)
                yield event("error", code=err.code or err.type, message=err.message, param=err.param)
                return
            elif isinstance(update, Finished):
                whole = "".join(text)
                yield event("response.output_text.done", text=whole, logprobs=[], **item)
                yield event("response.content_part.done", part=shape.text_part(whole), **item)
                yield event("response.output_item.done", output_index=0,
                            item=shape.message_item("completed", whole))
                final = shape.body("completed", update.outcome)
                done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield event(done, response=final)
    finally:
        job.release()
