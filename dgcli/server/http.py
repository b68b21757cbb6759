"""The HTTP pieces every endpoint of `dg serve` shares (app.py's routes, responses.py): server-sent
events that watch for the client's disconnect, an ApiError as OpenAI's JSON, a request body read
within a limit, and waiting on a job unless the client leaves first.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from dgcli.server.request import ApiError
from dgcli.server.run import Job


class EventStreamResponse(StreamingResponse):
    """SSE that also listens for the client's disconnect the whole time (Starlette only notices a
    disconnect on its next write when the server speaks ASGI 2.4, and a canvas can take a while)."""

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

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


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and len(declared) < 20 and int(declared) > limit:
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


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_unless_gone(request: Request, job: Job) -> Any:
    """The job's outcomes (non-streaming), an ApiError for a failure, or None when the client left first
    (the job is cancelled then)."""
    box: list[Any] = []
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            await until_disconnect(request)
            job.cancel()
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            box.append(await job.outcome())
        except ApiError as err:
            box.append(err.with_traceback(None))
        group.cancel_scope.cancel()
    return box[0] if box else None
