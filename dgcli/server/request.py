"""A request to `dg serve` as its parsers build it: the validated shape (CompletionRequest and its
parts), OpenAI's error (ApiError) and the field readers every parser of a body uses (api.py for the
body, tools.py for tools and tool_choice, structured.py for response_format).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dgcli.errors import DgError, check_utf8
from dgcli.params import DiffusionParams


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


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class ResponseFormat:
    """response_format: "json_object", or "json_schema" with its schema (structured.py)."""

    type: str
    schema: dict[str, Any] | None = None
    name: str = ""


@dataclass
class ToolChoice:
    mode: str = "auto"  # "none" | "auto" | "required" | "function" (then `name`)
    name: str | None = None


@dataclass
class CompletionRequest:
    """A validated request of any endpoint."""

    kind: str  # "chat" | "completion" | "responses"
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat: as the chat template takes them
    prompts: list[str | list[int]] = field(default_factory=list)  # completion: text, or token ids, each
    model: str | None = None
    params: DiffusionParams = field(default_factory=DiffusionParams)
    max_new_tokens: int = 256
    max_tokens_given: bool = False  # False: the server's default, shortened to what the context holds
    max_tokens_param: str = "max_tokens"
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    dg_steps: bool = False
    n: int = 1
    temperature: float | None = None  # the grammar-constrained decoder's only
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @property
    def prompt(self) -> str | list[int]:
        return self.prompts[0]

    @property
    def n_choices(self) -> int:
        return self.n * max(1, len(self.prompts))


def get_field(body: dict, name: str, kinds: tuple[type, ...], what: str, where: str | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(f"'{where or name}' must be {what}", param=where or name)
    return value


def number_in(value: Any, low: float, high: float) -> bool:
    """A JSON number within [low, high]; an integer too long for a float is not (a 400, never a 500)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        as_float = float(value)
    except OverflowError:
        return False
    return math.isfinite(as_float) and low <= as_float <= high


def unicode_text(text: str, param: str) -> str:
    try:
        check_utf8(text, f"'{param}'")
    except DgError as err:
        raise bad(str(err), param=param) from None
    return text
