"""`dg serve`'s HTTP side: an OpenAI-compatible API (Starlette) over the batch scheduler.

    GET  /health                 liveness, slots, queue, batching figures
    GET  /v1/models              the one model served
    POST /v1/chat/completions    chat (the GGUF's chat template), SSE streaming or not
    POST /v1/completions         raw text or token ids, SSE streaming or not

Every error is OpenAI's JSON shape with the matching status (400 bad request, 401 wrong key, 404,
405, 413 body too large, 503 queue full, 500 the server's own failure); the server stays up. A
request's tokenization runs on a worker thread (llama.cpp's tokenizer is read-only, as llama.cpp's
own server uses it); everything that touches the model's context runs on the scheduler's thread,
whose events reach each request through call_soon_threadsafe. A client that disconnects, mid-stream
or while waiting, cancels its request: its slot goes to the next one.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from dgcli.engine.diffusion import DiffusionEngine, prompt_token_ids
from dgcli.engine.types import CanvasEvent, StepEvent
from dgcli.errors import DgError
from dgcli.server.api import (
    FINISH_REASONS,
    ApiError,
    CompletionRequest,
    chunk_body,
    completion_body,
    created_now,
    dg_stats,
    error_body,
    new_id,
    parse_request,
    step_payload,
    usage,
)
from dgcli.server.scheduler import (
    BatchScheduler,
    GenerationRequest,
    QueueFull,
    RequestDone,
    RequestFailed,
    RequestTooLong,
    SchedulerClosed,
)
from dgcli.server.text import AnswerStream

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass
class ServeConfig:
    model_name: str
    default_max_tokens: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    created: int = field(default_factory=created_now)


class DgService:
    """What the routes share: the scheduler, its engine, the settings, the request log."""

    def __init__(self, scheduler: BatchScheduler, config: ServeConfig, log: Callable[[str], None] | None = None):
        self.scheduler, self.config = scheduler, config
        self.engine: DiffusionEngine = scheduler.engine
        self.model = self.engine.model
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._pieces: dict[int, str] = {}  # used on the scheduler's thread only

    @property
    def max_tokens_limit(self) -> int:
        """The largest max_tokens whose canvases fit the KV cache next to a one-token prompt."""
        canvas = self.model.canvas_length
        return max(1, (self.scheduler.kv_capacity - 1) // canvas * canvas)

    @property
    def has_chat_template(self) -> bool:
        """False for a GGUF without tokenizer.chat_template (a model with no such attribute brings chat_tokens)."""
        return getattr(self.model, "chat_template", True) is not None

    def default_max_tokens(self, n_prompt: int) -> int:
        """The configured default, in whole canvases that fit after the prompt (at least one canvas:
        a prompt too long even for that gets the context error)."""
        canvas = self.model.canvas_length
        room = (self.scheduler.kv_capacity - n_prompt) // canvas * canvas
        return max(canvas, min(self.config.default_max_tokens, room))

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        """Token ids of the request's prompt (chat template for chat). Runs on a worker thread."""
        if req.kind == "chat":
            # control-token text in the messages stays text (the chat template's own markers only)
            ids = self.model.chat_tokens(req.messages)
        else:
            # a raw prompt is the caller's whole text, template markers included (as llama-server)
            ids = prompt_token_ids(self.model, req.prompt, chat=False, parse_special=True)
        if not ids:
            raise DgError("empty prompt: nothing to condition on")
        return ids

    def piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self.model.detokenize([token])
        return self._pieces[token]


class RequestRun:
    """One HTTP request's generation: the scheduler's events, turned into deltas on the engine
    thread (AnswerStream) and handed to the event loop through an asyncio.Queue."""

    def __init__(self, service: DgService, req: CompletionRequest, prompt_ids: list[int]):
        self.service, self.req = service, req
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rid, self.created = new_id(req.kind), created_now()
        self.model_name = service.config.model_name
        self.answer = AnswerStream(service.model.detokenize, stop=req.stop, thinking=req.kind == "chat")
        self.request = GenerationRequest(prompt_ids=prompt_ids, params=req.params, max_new_tokens=req.max_new_tokens,
                                         seed=req.seed, sink=self._sink, want_steps=req.dg_steps, id=self.rid)
        self.finished = False

    # ---- the scheduler's thread

    def _sink(self, event: Any) -> Any:
        if isinstance(event, StepEvent):
            self._put(("step", step_payload(event, self.service.piece)))
        elif isinstance(event, CanvasEvent):
            reasoning, content = self.answer.feed(event.token_ids)
            self._put(("canvas", reasoning, content, event.to_json()))
            if self.answer.stopped:
                return False  # a stop string: no further canvases
        elif isinstance(event, RequestDone):
            reasoning, content = self.answer.finish()
            self._put(("done", reasoning, content, event))
        elif isinstance(event, RequestFailed):
            self._put(("failed", event))
        return None

    def _put(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is gone (shutdown): nobody is waiting for this request any more

    # ---- the event loop

    def cancel(self) -> None:
        if not self.finished:
            self.service.scheduler.cancel(self.request)

    def finish_reason(self, done: RequestDone) -> str:
        if done.stopped_by_client or self.answer.stopped:
            return "stop"
        return FINISH_REASONS.get(done.result.stop_reason, "stop")

    def log_done(self, done: RequestDone, finish: str) -> None:
        r = done.result
        canvases = len(r.steps_per_canvas)
        sent = usage(r, self.answer.stop_tokens)["completion_tokens"]  # what the client's usage says
        cut = f" ({sent} through the stop string)" if sent != r.n_new_tokens else ""
        self.service.log(f"{self.rid}  {r.n_prompt_tokens}+{r.n_new_tokens} tokens{cut}  {canvases} "
                         f"canvas{'es' if canvases != 1 else ''} {r.decoder_forwards} steps  {r.total_s:.2f}s "
                         f"(queued {done.queued_s:.2f}s)  {finish}")

    async def outcome(self) -> RequestDone:
        """Wait for the end (non-streaming); a failure becomes an ApiError."""
        while True:
            item = await self.queue.get()
            if item[0] == "done":
                self.finished = True
                return item[3]
            if item[0] == "failed":
                self.finished = True
                raise failure_error(item[1])

    def response_body(self, done: RequestDone) -> dict[str, Any]:
        finish = self.finish_reason(done)
        self.log_done(done, finish)
        return completion_body(self.req.kind, self.rid, self.created, self.model_name, self.answer.reasoning,
                               self.answer.content, finish, done.result, done.queued_s, self.answer.stop_tokens)

    async def sse(self) -> AsyncIterator[str]:
        kind, rid, created, name = self.req.kind, self.rid, self.created, self.model_name

        def chunk(**kw: Any) -> str:
            return sse_data(chunk_body(kind, rid, created, name, **kw))

        try:
            if kind == "chat":
                yield chunk(role=True)
            while True:
                item = await self.queue.get()
                tag = item[0]
                if tag == "step":
                    yield chunk(extra={"dg_step": item[1]})
                elif tag == "canvas":
                    _, reasoning, content, canvas = item
                    extra = {"dg_canvas": canvas} if self.req.dg_steps else None
                    if reasoning or content or extra:
                        yield chunk(reasoning=reasoning, content=content, extra=extra)
                elif tag == "done":
                    _, reasoning, content, done = item
                    self.finished = True
                    if reasoning or content:
                        yield chunk(reasoning=reasoning, content=content)
                    finish = self.finish_reason(done)
                    self.log_done(done, finish)
                    yield chunk(finish=finish)
                    if self.req.include_usage:
                        yield chunk(no_choices=True, extra={"usage": usage(done.result, self.answer.stop_tokens),
                                                            "dg": dg_stats(done.result, done.queued_s)})
                    yield "data: [DONE]\n\n"
                    return
                elif tag == "failed":
                    self.finished = True
                    yield sse_data(failure_error(item[1]).body())
                    return
        finally:
            self.cancel()  # the client went away (or we failed): free the slot


def failure_error(failed: RequestFailed) -> ApiError:
    if failed.shutting_down:  # as a request that arrives once the server is stopping (SchedulerClosed)
        return ApiError(503, failed.message, type="server_error", code="shutting_down")
    if failed.internal:
        return ApiError(500, failed.message, type="server_error")
    return ApiError(400, failed.message)


def sse_data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """SSE that also listens for the client's disconnect the whole time (Starlette only notices a
    disconnect on its next write when the server speaks ASGI 2.4, and a canvas can take a while)."""

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client is gone
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # e.g. 100000 nested arrays: a client error, not a 500 with a traceback in the log
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError:  # an integer past Python's 4300-digit limit for reading one
        raise ApiError(400, "the request body holds a number too long to read") from None


def create_app(service: DgService) -> Starlette:
    config = service.config

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", type="authentication_error",
                           code="invalid_api_key")

    async def health(request: Request) -> Response:
        s = service.scheduler
        return JSONResponse({
            "status": "ok", "model": config.model_name,
            "slots": {"total": s.slots, "busy": s.n_active},
            "queue": {"waiting": s.n_waiting, "limit": s.max_queue},
            "context_per_request": s.kv_capacity, "canvas_length": service.model.canvas_length,
            "requests": s.stats.to_json(),
        })

    def model_card() -> dict[str, Any]:
        return {"id": config.model_name, "object": "model", "created": config.created, "owned_by": "dg",
                "dg": {"canvas_length": service.model.canvas_length, "slots": service.scheduler.slots,
                       "context_per_request": service.scheduler.kv_capacity,
                       "max_tokens_limit": service.max_tokens_limit}}

    async def models(request: Request) -> Response:
        check_key(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request: Request) -> Response:
        check_key(request)
        if request.path_params["model"] != config.model_name:
            raise ApiError(404, f"model {request.path_params['model']!r} is not served here "
                                f"(this server serves {config.model_name!r})", code="model_not_found")
        return JSONResponse(model_card())

    async def generate(request: Request, kind: str) -> Response:
        check_key(request)
        if kind == "chat" and not service.has_chat_template:
            # not the engine's advice to pass --raw: a client has no flags, but it has /v1/completions
            raise ApiError(400, f"{config.model_name} has no chat template (tokenizer.chat_template): this server "
                                "answers /v1/completions only (the prompt text as it is)", param="messages",
                           code="no_chat_template")
        body = await read_json(request, config.max_body_bytes)
        req = parse_request(body, kind, service.engine.default_params, config.default_max_tokens,
                            service.max_tokens_limit, service.model.canvas_length)
        try:
            prompt_ids = await anyio.to_thread.run_sync(service.prompt_ids, req)
        except DgError as err:
            raise ApiError(400, str(err), param="messages" if kind == "chat" else "prompt") from None
        if not req.max_tokens_given:
            req.max_new_tokens = service.default_max_tokens(len(prompt_ids))
        run = RequestRun(service, req, prompt_ids)
        try:
            service.scheduler.submit(run.request)
        except RequestTooLong as err:
            raise ApiError(400, str(err), param="messages" if kind == "chat" else "prompt",
                           code="context_length_exceeded") from None
        except QueueFull as err:
            raise ApiError(503, str(err), type="server_overloaded", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except SchedulerClosed as err:
            raise ApiError(503, str(err), type="server_error", code="shutting_down") from None
        except DgError as err:
            raise ApiError(400, str(err)) from None
        if req.stream:
            return EventStreamResponse(run.sse())
        # not streaming: the answer, unless the client leaves first (then the request is cancelled)
        done: RequestDone | None = None
        error: ApiError | None = None
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                await until_disconnect(request)
                run.cancel()
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                done = await run.outcome()
            except ApiError as err:
                error = err
            group.cancel_scope.cancel()
        if error is not None:
            raise error
        if done is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(run.response_body(done))

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        messages = {404: f"no route {request.url.path} (see GET /v1/models, POST /v1/chat/completions)",
                    405: f"{request.method} is not allowed on {request.url.path}"}
        return JSONResponse(error_body(messages.get(exc.status_code, str(exc.detail)),
                                       code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def internal_error(request: Request, exc: Exception) -> Response:
        service.log(f"error: internal error on {request.method} {request.url.path}: {type(exc).__name__}: {exc}")
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", type="server_error"),
                            status_code=500)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", one_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, ApiError: api_error,
                                                        Exception: internal_error})

