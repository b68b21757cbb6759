"""Tool calls in `dg serve`: OpenAI's `tools`, `tool_choice` and tool messages in, the model's
tool-call text out as OpenAI `tool_calls`.

The tools and the conversation (assistant tool calls, `role: "tool"` results) go to the GGUF's own
chat template, which renders them in the model's format. Gemma 4 declares each tool in a
`<|tool> ... <tool|>` block and calls one as

    <|tool_call>call:NAME{key:value,...}<tool_call|>

where strings are quoted with the `<|"|>` token, keys are bare, and values nest as JSON's do; a
tool's result is then rendered as `<|tool_response>response:NAME{...}<tool_response|>`, and a
model that writes `<|tool_response>` itself is waiting for one, so generation stops there. The
arguments are read back into a JSON object string (`arguments`), and JSON arguments (what the
grammar of a forced call writes, structured.py) are taken as they are.

The markers are control tokens, which detokenizing drops: `MarkerText` puts their text back.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable, Sequence

from dgcli.server.request import ToolChoice, bad, get_field, unicode_text

TOOL_CALL_OPEN = "<|tool_call>"
TOOL_CALL_CLOSE = "<tool_call|>"
CALL_PREFIX = "call:"
TOOL_RESPONSE_OPEN = "<|tool_response>"
STRING_QUOTE = '<|"|>'
MARKERS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, "<tool_response|>", STRING_QUOTE)

MAX_TOOLS = 128
MAX_TOOLS_JSON_CHARS = 256 << 10
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


# ---- requests ----------------------------------------------------------------------------------------


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI function tools -> [{"type": "function", "function": {name, description, parameters}}]."""
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"'tools' must be an array of at most {MAX_TOOLS} tools", param="tools")
    if len(json.dumps(tools)) > MAX_TOOLS_JSON_CHARS:
        raise bad(f"'tools' is longer than {MAX_TOOLS_JSON_CHARS} characters of JSON", param="tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}: dg serve calls functions "
                      "only", param=where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
            raise bad(f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' or '-'",
                      param=f"{where}.function.name")
        if name in names:
            raise bad(f"two tools are named {name!r}", param=f"{where}.function.name")
        names.add(name)
        description = get_field(function, "description", (str,), "a string", f"{where}.function.description")
        parameters = get_field(function, "parameters", (dict,), "a JSON schema object",
                               f"{where}.function.parameters")
        entry: dict[str, Any] = {"name": name, "description": unicode_text(description or "",
                                                                          f"{where}.function.description")}
        entry["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": entry})
    return out


def parse_tool_choice(choice: Any, tools: Sequence[dict]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise bad(f"tool_choice {choice!r} needs 'tools'", param="tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t["function"]["name"] == name for t in tools):
            shown = name if isinstance(name, str) and len(name) <= 64 else type(name).__name__
            raise bad(f"tool_choice names {shown!r}, which is not in 'tools'", param="tool_choice")
        return ToolChoice("function", name)
    raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
              "{\"name\": ...}}", param="tool_choice")


def parse_message_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, with arguments as objects (the form chat templates expect)."""
    if not isinstance(calls, list):
        raise bad(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"'{at}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                      param=at)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else unicode_text(arguments, f"{at}.function.arguments")
        elif arguments is None:
            arguments = {}
        elif not isinstance(arguments, dict):
            raise bad(f"'{at}.function.arguments' must be a JSON string", param=f"{at}.function.arguments")
        entry = {"type": "function", "function": {"name": unicode_text(function["name"], f"{at}.function.name"),
                                                  "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def template_tools(req: Any) -> list[dict[str, Any]] | None:
    """The tools the chat template renders: none with tool_choice "none" (the model is not to call one)."""
    return req.tools if req.tools and req.tool_choice.mode != "none" else None


def parses_tool_calls(req: Any) -> bool:
    return bool(req.tools) and req.tool_choice.mode != "none"


# ---- the model's text --------------------------------------------------------------------------------


class MarkerText:
    """Detokenizing that keeps the text of the tool-call markers (control tokens, which the model's
    detokenize drops): their ids are found by tokenizing each marker."""

    def __init__(self, model: Any):
        self.model = model
        self.marker_ids: dict[int, str] = {}
        tokenize = getattr(model, "tokenize", None)
        for marker in MARKERS if callable(tokenize) else ():
            try:
                ids = tokenize(marker, add_bos=False, special=True)
            except Exception:  # noqa: BLE001 (a model without such a token: its text stays text)
                continue
            if len(ids) == 1 and model.detokenize(ids) != marker:
                self.marker_ids[int(ids[0])] = marker

    def __call__(self, ids: Sequence[int]) -> str:
        if not self.marker_ids or not any(int(t) in self.marker_ids for t in ids):
            return self.model.detokenize(ids)
        parts, run = [], []
        for t in ids:
            if int(t) in self.marker_ids:
                if run:
                    parts.append(self.model.detokenize(run))
                    run = []
                parts.append(self.marker_ids[int(t)])
            else:
                run.append(t)
        if run:
            parts.append(self.model.detokenize(run))
        return "".join(parts)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _GemmaReader:
    """Gemma 4's argument notation: {key:value,...}, <|"|>strings<|"|>, JSON numbers, true/false/null,
    [arrays]; a bare word (a model's shortcut) is read as a string."""

    NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self) -> None:
        raise ValueError(f"unexpected text at {self.pos}")

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1

    def value(self, depth: int = 0) -> Any:
        if depth > 64:
            self.fail()
        self.skip()
        text = self.text
        if text.startswith(STRING_QUOTE, self.pos):
            end = text.find(STRING_QUOTE, self.pos + len(STRING_QUOTE))
            if end < 0:
                self.fail()
            value, self.pos = text[self.pos + len(STRING_QUOTE):end], end + len(STRING_QUOTE)
            return value
        if text.startswith("{", self.pos):
            return self.mapping(depth)
        if text.startswith("[", self.pos):
            return self.sequence(depth)
        if text.startswith('"', self.pos):  # a JSON string
            value, self.pos = json.JSONDecoder().raw_decode(text, self.pos)
            return value
        match = self.NUMBER.match(text, self.pos)
        end = self.pos
        while end < len(text) and text[end] not in ",}]":
            end += 1
        word = text[self.pos:end].strip()
        if match and match.end() - self.pos == len(text[self.pos:end].rstrip()):
            self.pos = match.end()
            return json.loads(match.group(0))
        self.pos = end
        return {"true": True, "false": False, "null": None}.get(word, word)

    def mapping(self, depth: int) -> dict[str, Any]:
        self.pos += 1
        out: dict[str, Any] = {}
        self.skip()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return out
        while True:
            self.skip()
            if self.text.startswith(STRING_QUOTE, self.pos) or self.text.startswith('"', self.pos):
                key = self.value(depth + 1)
                self.skip()
                if not self.text.startswith(":", self.pos):
                    self.fail()
            else:
                colon = self.text.find(":", self.pos)
                if colon < 0:
                    self.fail()
                key, self.pos = self.text[self.pos:colon].strip(), colon
            self.pos += 1
            out[str(key)] = self.value(depth + 1)
            self.skip()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif self.text.startswith("}", self.pos):
                self.pos += 1
                return out
            else:
                self.fail()

    def sequence(self, depth: int) -> list[Any]:
        self.pos += 1
        out: list[Any] = []
        self.skip()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return out
        while True:
            out.append(self.value(depth + 1))
            self.skip()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif self.text.startswith("]", self.pos):
                self.pos += 1
                return out
            else:
                self.fail()


def parse_call(body: str) -> tuple[str, str] | None:
    """`call:NAME{ARGS}` (the text between the markers) -> (name, arguments as a JSON object string),
    or None when it is not a call."""
    body = body.strip()
    if body.startswith(CALL_PREFIX):
        body = body[len(CALL_PREFIX):]
    brace = body.find("{")
    name = (body[:brace] if brace >= 0 else body).strip()
    if not TOOL_NAME_RE.match(name):
        return None
    args_text = body[brace:].strip() if brace >= 0 else "{}"
    try:
        arguments = json.loads(args_text)
    except (ValueError, RecursionError):
        reader = _GemmaReader(args_text)
        try:
            arguments = reader.value()
            reader.skip()
            if reader.pos != len(args_text):
                return None
        except (ValueError, RecursionError, IndexError):
            return None
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class ToolCallStream:
    """Splits an answer's content deltas into text and tool calls: text before a `<|tool_call>` goes
    on as content; a call is held until its `<tool_call|>` and then given whole. A call that does
    not parse, or never closes, stays text."""

    def __init__(self, names: Sequence[str] = ()):
        self.names = set(names)
        self.buffer = ""
        self.calls: list[dict[str, Any]] = []

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        text, calls = [], []
        while self.buffer:
            start = self.buffer.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, TOOL_CALL_OPEN)
                text.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            text.append(self.buffer[:start])
            self.buffer = self.buffer[start:]
            end = self.buffer.find(TOOL_CALL_CLOSE)
            if end < 0:
                if final:
                    text.append(self._as_call_or_text(self.buffer[len(TOOL_CALL_OPEN):], self.buffer, calls))
                    self.buffer = ""
                break
            whole = self.buffer[:end + len(TOOL_CALL_CLOSE)]
            text.append(self._as_call_or_text(self.buffer[len(TOOL_CALL_OPEN):end], whole, calls))
            self.buffer = self.buffer[len(whole):]
        return "".join(text), calls

    def _as_call_or_text(self, body: str, whole: str, calls: list) -> str:
        parsed = parse_call(body)
        if parsed is None or (self.names and parsed[0] not in self.names):
            return whole
        call = {"index": len(self.calls), "id": new_call_id(), "type": "function",
                "function": {"name": parsed[0], "arguments": parsed[1]}}
        self.calls.append(call)
        calls.append(call)
        return ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may be completed later)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def message_calls(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls as a non-streamed message carries them (no index)."""
    return [{k: v for k, v in call.items() if k != "index"} for call in calls]


def choice_detokenizer(model: Any, req: Any) -> Callable[[Sequence[int]], str]:
    return MarkerText(model) if parses_tool_calls(req) else model.detokenize
