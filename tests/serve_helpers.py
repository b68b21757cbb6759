"""`dg serve` for tests: a real process on 127.0.0.1 (dgcli.server.process.ServeProcess), or the app
in-process on a thread (for scripted models); a stdlib JSON client. Every wait here is bounded."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from dgcli.server.process import START_TIMEOUT_S, STOP_TIMEOUT_S, ServeProcess  # noqa: F401 (re-exported)


class InProcessServer:
    """The Starlette app of dgcli.server.app on uvicorn, on a thread, for a given DgService, with
    dg serve's connection limits (dgcli.server.net; `limits` to shorten them)."""

    def __init__(self, service: Any, limits: Any = None):
        import uvicorn

        from dgcli.server.app import create_app
        from dgcli.server.net import ConnectionGuard, ConnectionLimits, DgServer, guarded_protocol

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = self.root + "/v1"
        self.limits = limits or ConnectionLimits()
        self.guard = ConnectionGuard(self.limits, service.log)
        config = uvicorn.Config(create_app(service), log_level="warning", lifespan="off",
                                timeout_keep_alive=self.limits.keep_alive_s, http=guarded_protocol(self.guard))
        self.server = DgServer(config, service.log)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            assert time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(STOP_TIMEOUT_S)
        self.sock.close()


def fetch_json(method: str, url: str, body: Any = None, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 60) -> tuple[int, Any]:
    """(status, parsed JSON body) with the stdlib client; error statuses are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        payload = err.read()
        try:
            return err.code, json.loads(payload)
        except json.JSONDecodeError:
            return err.code, payload.decode("utf-8", "replace")


def wait_until(predicate, timeout: float = 60, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
