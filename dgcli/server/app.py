"""`dg serve`'s HTTP side: an OpenAI-compatible API (Starlette) over the batch scheduler.

    GET  /                       a page that shows the canvas denoise live (static/, no build step)
    GET  /health                 liveness, slots, queue, batching figures
    GET  /v1/models              the one model served; /v1/models/{id} it, or 404 model_not_found
    POST /v1/chat/completions    chat (the GGUF's chat template; tools), SSE streaming or not
    POST /v1/completions         raw text or token ids, one prompt or several, SSE streaming or not
    POST /v1/responses           OpenAI's Responses API, text in and out (responses.py)

Every error is OpenAI's JSON shape with the matching status (400 bad request, 401 wrong key, 403
a Host or Origin refused, 404, 405, 413 body too large, 415 not JSON, 503 queue full or shutting
down, 500 the server's own failure); the server stays up. Before the routes, guard.py checks Host,
Origin and Content-Type and adds x-request-id; net.py bounds the connections. A request's
tokenization runs on a worker thread (llama.cpp's tokenizer is read-only, as llama.cpp's own server
uses it); everything that touches the model's context runs on the scheduler's thread, whose events
reach each request through call_soon_threadsafe. A client that disconnects, mid-stream or while
waiting, cancels its request: its slots go to the next one.
"""

from __future__ import annotations

import hmac
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from dgcli.engine.diffusion import DiffusionEngine, prompt_token_ids
from dgcli.errors import DgError
from dgcli.server.api import parse_request
from dgcli.server.bodies import created_now, system_fingerprint
from dgcli.server.guard import CorsPolicy, HostCheck, HttpGuard
from dgcli.server.http import EventStreamResponse, error_response, read_json, wait_unless_gone
from dgcli.server.request import ApiError, CompletionRequest, error_body
from dgcli.server.responses import parse_responses_request, respond
from dgcli.server.run import Job
from dgcli.server.scheduler import BatchScheduler, QueueFull, RequestTooLong, SchedulerClosed
from dgcli.server.structured import check_grammar, grammar_for
from dgcli.server.tools import MarkerText, parses_tool_calls, template_tools

DEFAULT_MAX_BODY_BYTES = 4 << 20
STATIC = Path(__file__).with_name("static")
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
                "style.css": "text/css; charset=utf-8"}


@dataclass
class ServeConfig:
    model_name: str
    default_max_tokens: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    created: int = field(default_factory=created_now)
    bound_host: str = "127.0.0.1"  # the Host header must name it (guard.py)
    allowed_hosts: Sequence[str] = ()
    cors_origins: Sequence[str] = ()


class DgService:
    """What the routes share: the scheduler, its engine, the settings, the request log."""

    def __init__(self, scheduler: BatchScheduler, config: ServeConfig, log: Callable[[str], None] | None = None):
        self.scheduler, self.config = scheduler, config
        self.engine: DiffusionEngine = scheduler.engine
        self.model = self.engine.model
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._pieces: dict[int, str] = {}  # used on the scheduler's thread only
        self._marker_text: MarkerText | None = None
        self._renders_tools: bool | None = None

    @property
    def max_tokens_limit(self) -> int:
        """The largest max_tokens whose canvases fit the KV cache next to a one-token prompt."""
        canvas = self.model.canvas_length
        return max(1, (self.scheduler.kv_capacity - 1) // canvas * canvas)

    @property
    def has_chat_template(self) -> bool:
        """False for a GGUF without tokenizer.chat_template (a model with no such attribute brings chat_tokens)."""
        return getattr(self.model, "chat_template", True) is not None

    def renders_tools(self) -> bool:
        """Whether the GGUF's chat template writes tools into the prompt (a scripted model: assumed)."""
        if self._renders_tools is None:
            template = getattr(self.model, "chat_template", None)
            self._renders_tools = template.renders_tools() if template is not None else True
        return self._renders_tools

    def default_max_tokens(self, n_prompt: int, constrained: bool) -> int:
        """The configured default, in whole canvases that fit after the prompt (at least one canvas:
        a prompt too long even for that gets the context error); a constrained decode's tokens."""
        canvas = self.model.canvas_length
        room = self.scheduler.kv_capacity - n_prompt
        if constrained:
            return max(1, min(self.config.default_max_tokens, room - canvas))
        return max(canvas, min(self.config.default_max_tokens, room // canvas * canvas))

    def prepare(self, req: CompletionRequest) -> tuple[list[list[int]], str | None]:
        """Each prompt's token ids (chat: the template over the messages and tools) and the grammar
        the answer must follow, if any. Runs on a worker thread."""
        grammar = grammar_for(req)
        if grammar is not None:
            check_grammar(self.model, grammar)
        if req.kind == "completion":
            # a raw prompt is the caller's whole text, template markers included (as llama-server)
            prompts = [prompt_token_ids(self.model, p, chat=False, parse_special=True) for p in req.prompts]
            return prompts, grammar
        tools = template_tools(req)
        if tools and not self.renders_tools():
            raise ApiError(400, f"the chat template of {self.config.model_name} does not render tools, so the "
                                "model would never see them; send tool_choice \"none\" or no tools",
                           param="tools", code="tools_not_supported")
        # control-token text in the messages stays text (the chat template's own markers only)
        ids = self.model.chat_tokens(req.messages, tools=tools) if tools else self.model.chat_tokens(req.messages)
        if not ids:
            raise DgError("empty prompt: nothing to condition on")
        return [ids], grammar

    def detokenizer(self, req: CompletionRequest) -> Callable[[Sequence[int]], str]:
        """The model's detokenize; with tool calls to read, the markers' text kept (tools.MarkerText)."""
        if not parses_tool_calls(req):
            return self.model.detokenize
        if self._marker_text is None:
            self._marker_text = MarkerText(self.model)
        return self._marker_text

    def piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self.model.detokenize([token])
        return self._pieces[token]


class Endpoints:
    """The routes over one DgService."""

    def __init__(self, service: DgService):
        self.service, self.config = service, service.config

    def check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # header values arrive as latin-1: their bytes, compared with the key's (ASCII, serve.py checks)
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", type="authentication_error",
                           code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            shown = name if len(name) <= 80 else name[:80] + "..."
            raise ApiError(404, f"model {shown!r} is not served here (this server serves "
                                f"{self.config.model_name!r}; see GET /v1/models)", param="model",
                           code="model_not_found")

    async def health(self, request: Request) -> Response:
        s, service = self.service.scheduler, self.service
        return JSONResponse({
            "status": "ok", "model": self.config.model_name, "system_fingerprint": system_fingerprint(),
            "slots": {"total": s.slots, "busy": s.n_active},
            "queue": {"waiting": s.n_waiting, "limit": s.max_queue},
            "context_per_request": s.kv_capacity, "canvas_length": service.model.canvas_length,
            "end_token_ids": [int(t) for t in service.model.end_token_ids],
            "pad_token_id": getattr(service.model, "pad_token_id", None),
            "auth": self.config.api_key is not None,
            "requests": s.stats.to_json(),
        })

    def model_card(self) -> dict[str, Any]:
        s = self.service.scheduler
        return {"id": self.config.model_name, "object": "model", "created": self.config.created, "owned_by": "dg",
                "dg": {"canvas_length": self.service.model.canvas_length, "slots": s.slots,
                       "context_per_request": s.kv_capacity, "max_tokens_limit": self.service.max_tokens_limit,
                       "system_fingerprint": system_fingerprint()}}

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def one_model(self, request: Request) -> Response:
        self.check_key(request)
        self.check_model(request.path_params["model"])
        return JSONResponse(self.model_card())

    async def page(self, request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        if name not in STATIC_FILES:
            raise HTTPException(404)
        return FileResponse(STATIC / name, media_type=STATIC_FILES[name], headers={
            "Cache-Control": "no-cache", "Content-Security-Policy": "default-src 'self'; style-src 'self'; "
            "script-src 'self'; connect-src 'self'; img-src 'self' data:", "X-Content-Type-Options": "nosniff"})

    async def parse(self, request: Request, kind: str) -> CompletionRequest:
        """The request's body, validated (kind: "chat", "completion" or "responses")."""
        self.check_key(request)
        if kind != "completion" and not self.service.has_chat_template:
            # not the engine's advice to pass --raw: a client has no flags, but it has /v1/completions
            raise ApiError(400, f"{self.config.model_name} has no chat template (tokenizer.chat_template): this "
                                "server answers /v1/completions only (the prompt text as it is)", param="messages",
                           code="no_chat_template")
        body = await read_json(request, self.config.max_body_bytes)
        service = self.service
        if kind == "responses":
            req = parse_responses_request(body, service.engine.default_params, self.config.default_max_tokens,
                                          service.max_tokens_limit, service.model.canvas_length)
        else:
            req = parse_request(body, kind, service.engine.default_params, self.config.default_max_tokens,
                                service.max_tokens_limit, service.model.canvas_length)
        self.check_model(req.model)
        return req

    async def start(self, req: CompletionRequest) -> Job:
        """Tokenize, build the grammar if any, and queue every choice: the running Job."""
        service = self.service
        param = "prompt" if req.kind == "completion" else "messages" if req.kind == "chat" else "input"
        try:
            prompts, grammar = await anyio.to_thread.run_sync(service.prepare, req)
        except DgError as err:
            raise ApiError(400, str(err), param=param) from None
        if not req.max_tokens_given:
            req.max_new_tokens = min(service.default_max_tokens(len(ids), grammar is not None) for ids in prompts)
        job = Job(service, req, prompts, grammar)
        try:
            service.scheduler.submit_group(job.requests)
        except RequestTooLong as err:
            job.release(rejected=True)
            raise ApiError(400, str(err), param=param, code="context_length_exceeded") from None
        except QueueFull as err:
            job.release(rejected=True)
            raise ApiError(503, str(err), type="server_overloaded", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except SchedulerClosed as err:
            job.release(rejected=True)
            raise ApiError(503, str(err), type="server_error", code="shutting_down") from None
        except DgError as err:
            job.release(rejected=True)
            raise ApiError(400, str(err)) from None
        return job

    async def generate(self, request: Request, kind: str) -> Response:
        req = await self.parse(request, kind)
        job = await self.start(req)
        if req.stream:
            return EventStreamResponse(job.sse())
        try:
            outcome = await wait_unless_gone(request, job)
        finally:
            job.release()
        if isinstance(outcome, ApiError):
            return error_response(outcome)
        if outcome is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(job.body(outcome))

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    async def responses(self, request: Request) -> Response:
        req = await self.parse(request, "responses")
        return await respond(self, request, req)


def create_app(service: DgService) -> Any:
    """The Starlette app behind guard.HttpGuard."""
    endpoints = Endpoints(service)

    def guarded(handler: Callable) -> Callable:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as err:  # answered here: no traceback kept alive by a handler further out
                return error_response(err.with_traceback(None))
            except ClientDisconnect:
                return Response(status_code=499)
        return run

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        messages = {404: f"no route {request.url.path[:120]} (see GET /v1/models, POST /v1/chat/completions)",
                    405: f"{request.method} is not allowed on {request.url.path[:120]}"}
        return JSONResponse(error_body(messages.get(exc.status_code, str(exc.detail)),
                                       code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def internal_error(request: Request, exc: Exception) -> Response:
        service.log(f"error: internal error on {request.method} {request.url.path[:120]}: "
                    f"{type(exc).__name__}: {exc}")
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", type="server_error"),
                            status_code=500)

    e = endpoints
    routes = [
        Route("/", guarded(e.page), methods=["GET"]),
        Route("/static/{name}", guarded(e.page), methods=["GET"]),
        Route("/health", guarded(e.health), methods=["GET"]),
        Route("/v1/models", guarded(e.models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(e.one_model), methods=["GET"]),
        Route("/v1/chat/completions", guarded(e.chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(e.completions), methods=["POST"]),
        Route("/v1/responses", guarded(e.responses), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})
    config = service.config
    return HttpGuard(app, HostCheck(config.bound_host, config.allowed_hosts), CorsPolicy(config.cors_origins),
                     service.log)
