"""`dg serve`'s connections: uvicorn's HTTP/1.1 protocol (h11) with limits a hostile peer cannot
get around, and the uvicorn server it runs in.

- a connection has `header_timeout_s` to send a request's headers (from its start, or from its
  first byte after a response), and `body_timeout_s` to send the body once the headers are in;
  past either it gets 408 and is closed. An idle keep-alive connection is closed after
  uvicorn's `timeout_keep_alive`;
- at most `max_connections` at once (never more than the file descriptors allow: the soft limit
  is raised to the hard one at start). A new connection beyond that closes the oldest one that has
  no request in progress (idle, or still sending headers); if every one has, the new one gets 503;
- a client that half-closes its side after sending a whole request (shutdown(SHUT_WR)) still gets
  its answer; a closed side before the request is whole ends the connection;
- each refusal is one line in the log; asyncio's own errors (an accept() that fails) are one
  line each, at most once a second, never a traceback;
- SIGHUP stops the server as gracefully as SIGTERM and Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import Server

# connections asyncio accepts in one go: each takes a file descriptor before the idle connection it
# evicts has given its own back (a close, like a connection's start, runs a loop iteration or two
# later), so a few batches' worth are kept free
ACCEPT_BATCH = 32
# asyncio sets the listen queue to the accept batch; a burst longer than the queue would have its
# connections (and a /health among them) retried by their clients a second later
LISTEN_QUEUE = 4096
# file descriptors kept for everything but client connections (the model, pipes, the listener, logs),
# and for batches of accepts
RESERVED_FDS = 64 + 4 * ACCEPT_BATCH


@dataclass
class ConnectionLimits:
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard one (to wanted + the reserve at most); return
    how many connections fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < target:
        new = target if hard == resource.RLIM_INFINITY else min(hard, target)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - RESERVED_FDS))


class ConnectionGuard:
    """What the connections of one server share: the cap, their order of arrival, the log."""

    def __init__(self, limits: ConnectionLimits, log: Callable[[str], None]):
        self.limits, self.log = limits, log
        self.open: dict[Any, None] = {}  # insertion order: the oldest first
        self.refused = 0

    def admit(self, protocol: Any) -> bool:
        if len(self.open) >= self.limits.max_connections:
            victim = next((p for p in self.open if p.idle and not p.transport.is_closing()), None)
            if victim is None:
                self.refused += 1
                protocol.refuse(503, "Service Unavailable",
                                f"{self.limits.max_connections} connections are open, each with a request in "
                                "progress")
                return False
            victim.refuse(503, "Service Unavailable",
                          f"idle, closed to make room ({self.limits.max_connections} connections open)")
            self.forget(victim)
        self.open[protocol] = None
        return True

    def forget(self, protocol: Any) -> None:
        self.open.pop(protocol, None)


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's h11 protocol class with this guard's limits."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._timer: asyncio.TimerHandle | None = None
            self._seen_cycle: Any = None
            self._received = 0  # bytes of the request under way (before its headers are whole)
            self._half_closed = False
            if guard.admit(self):
                self._arm(guard.limits.header_timeout_s, "headers")

        @property
        def idle(self) -> bool:
            """No request in progress: waiting for one, or for the rest of its headers."""
            return self.cycle is None or self.cycle.response_complete

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired, what)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self, what: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if what == "headers" and self.idle:
                if self._received == 0:  # a browser's spare connection, or keep-alive: nothing to report
                    self.transport.close()
                    return
                self.refuse(408, "Request Timeout",
                            f"no complete request headers within {guard.limits.header_timeout_s:g} s")
            elif what == "body" and self.cycle is not None and self.cycle.more_body:
                self.refuse(408, "Request Timeout",
                            f"the request body was not complete within {guard.limits.body_timeout_s:g} s")

        def refuse(self, status: int, reason: str, why: str) -> None:
            """Answer `status` (when no response has started) and close; one line in the log."""
            peer = "%s:%d" % self.client if self.client else "a client"
            guard.log(f"dg serve: closed the connection from {peer}: {why}")
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(f"HTTP/1.1 {status} {reason}\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
                                     .encode())
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.idle:
                self._received += len(data)
                if self._timer is None:  # the first bytes after a response: the next request's headers
                    self._arm(guard.limits.header_timeout_s, "headers")
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not self._seen_cycle:  # a request's headers are in
                self._seen_cycle, self._received = cycle, 0
                if cycle.more_body:
                    self._arm(guard.limits.body_timeout_s, "body")
                else:
                    self._disarm()
            elif cycle is not None and not cycle.more_body and not cycle.response_complete:
                self._disarm()

        def on_response_complete(self) -> None:
            self._disarm()
            super().on_response_complete()
            if self._half_closed and not self.transport.is_closing():
                self.transport.close()

        def eof_received(self) -> bool | None:  # type: ignore[override]
            """The client closed its side: answer a whole request still, else close."""
            cycle = self.cycle
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                self._half_closed = True
                return True  # keep the transport open for the answer
            return None

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            guard.forget(self)
            super().connection_lost(exc)

    return GuardedH11Protocol


class LoopErrors:
    """asyncio's exception handler: one log line per kind of error, at most once a second."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.last: dict[str, float] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = str(context.get("message", "error"))
        exc = context.get("exception")
        detail = f"{type(exc).__name__}: {exc}" if exc is not None else ""
        now = time.monotonic()
        if now - self.last.get(message, -1e9) >= 1.0:
            self.last[message] = now
            self.log(f"dg serve: {message}{': ' + detail if detail else ''}")


class DgServer(Server):
    """uvicorn's server with asyncio's errors logged as single lines, SIGHUP handled as SIGTERM, and
    `on_exit` called (before uvicorn's graceful shutdown) on the first signal."""

    def __init__(self, config: Any, log: Callable[[str], None], on_exit: Callable[[], None] | None = None):
        super().__init__(config)
        self.log, self.on_exit = log, on_exit

    async def startup(self, sockets: Any = None) -> None:
        asyncio.get_running_loop().set_exception_handler(LoopErrors(self.log))
        await super().startup(sockets=sockets)
        for sock in sockets or []:
            sock.listen(LISTEN_QUEUE)  # after asyncio set it to its accept batch

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.on_exit is not None:
            self.on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        previous = signal.signal(signal.SIGHUP, self.handle_exit)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)
        if signal.SIGHUP in self._captured_signals:
            signal.raise_signal(signal.SIGHUP)  # what the handler found does it now (serve.py: a log line, exit)


def run_server(app: Any, listener: Any, limits: ConnectionLimits, log: Callable[[str], None],
               on_exit: Callable[[], None] | None = None) -> None:
    """Serve `app` on the bound socket until a signal stops it (uvicorn's graceful shutdown)."""
    import uvicorn  # noqa: PLC0415

    limits.max_connections = raise_fd_limit(limits.max_connections)
    guard = ConnectionGuard(limits, log)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                            timeout_keep_alive=limits.keep_alive_s, http=guarded_protocol(guard),
                            server_header=False, backlog=ACCEPT_BATCH)
    DgServer(config, log, on_exit).run(sockets=[listener])
