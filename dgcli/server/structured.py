"""Structured output in `dg serve`: `response_format` json_object / json_schema, and tool calls that
must happen (`tool_choice` "required" or a named function).

A canvas is denoised all at once and cannot follow a grammar left to right, so these requests are
decoded autoregressively on the same weights (the encoder's causal path), each token one that
llama.cpp's grammar sampler allows (dgcli/engine/grammar.py): the answer is JSON conforming to the
schema (or one call of an allowed tool, its arguments conforming to the tool's parameters) unless
max_tokens cuts it (finish_reason "length", as OpenAI). The response's `dg.decoder` says which
decoder ran.
"""

from __future__ import annotations

from typing import Any

from dgcli.engine.grammar import JSON_OBJECT_SCHEMA, GrammarError, json_schema_grammar, tool_call_grammar
from dgcli.server.request import ApiError, CompletionRequest, ResponseFormat, bad
from dgcli.server.tools import CALL_PREFIX, TOOL_CALL_CLOSE, TOOL_CALL_OPEN

DIFFUSION = "diffusion"
CONSTRAINED = "autoregressive+grammar"


def parse_response_format(value: Any, param: str = "response_format") -> ResponseFormat | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")  # llama-server's extension: a schema beside json_object
        if schema is None:
            return ResponseFormat("json_object", JSON_OBJECT_SCHEMA)
        return ResponseFormat("json_schema", _schema(schema, param), "")
    if kind == "json_schema":
        spec = value.get("json_schema", value)  # /v1/responses puts name and schema beside type
        if not isinstance(spec, dict):
            raise bad(f"'{param}' must be an object with a 'schema'", param=param)
        name = spec.get("name") if isinstance(spec.get("name"), str) else ""
        return ResponseFormat("json_schema", _schema(spec.get("schema", {}), param), name)
    raise bad(f"'{param}' must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
              "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}", param=param)


def _schema(schema: Any, param: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise bad(f"'{param}' needs its schema as a JSON object", param=param)
    try:
        json_schema_grammar(schema)  # refused now rather than once the request runs
    except GrammarError as err:
        raise bad(f"'{param}': {err}", param=param) from None
    return schema


def grammar_for(req: CompletionRequest) -> str | None:
    """The grammar the request's answer must follow, or None (the diffusion decoder runs)."""
    forced = req.tool_choice.mode in ("required", "function") and bool(req.tools)
    if req.response_format is not None:
        if forced:
            raise bad("a forced tool call (tool_choice) and response_format cannot both shape the answer",
                      param="response_format")
        try:
            return json_schema_grammar(req.response_format.schema or JSON_OBJECT_SCHEMA)
        except GrammarError as err:
            raise bad(f"'response_format': {err}", param="response_format") from None
    if forced:
        tools = [t["function"] for t in req.tools
                 if req.tool_choice.mode == "required" or t["function"]["name"] == req.tool_choice.name]
        try:
            return tool_call_grammar([(t["name"], t["parameters"]) for t in tools], TOOL_CALL_OPEN, CALL_PREFIX,
                                     TOOL_CALL_CLOSE)
        except GrammarError as err:
            raise bad(f"'tools': {err}", param="tools") from None
    return None


def check_grammar(model: Any, grammar: str) -> None:
    """llama.cpp parses the grammar (on a worker thread: the vocabulary is only read); ApiError if not."""
    from dgcli.engine.grammar import GrammarSampler  # noqa: PLC0415

    if not hasattr(model, "_vocab"):
        return  # a scripted model (tests): the scheduler's sampler will say
    try:
        GrammarSampler(model, grammar).close()
    except GrammarError as err:
        raise ApiError(400, str(err), param="response_format") from None
