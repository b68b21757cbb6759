"""What every HTTP request to `dg serve` passes before the routes (an ASGI middleware):

- `x-request-id` on every response: the client's own (letters, digits, `._:-`, at most 128) or a
  new one; the log's lines for the request carry it;
- the Host header must name this server: an IP literal it listens on (any, when it listens on
  every interface), a loopback name when it listens on loopback, or a name given with
  `--allowed-host`. A web page that rebinds its own DNS name to 127.0.0.1 (DNS rebinding) sends
  its own name and is refused (403), so it cannot read the answers;
- a request that carries an `Origin` (a browser's) must come from this server's own page or an
  origin given with `--cors`; with `--cors ORIGIN` the browser's preflight (OPTIONS) is answered and
  the responses carry Access-Control-Allow-Origin for it; without, no CORS headers at all;
- a POST must say `Content-Type: application/json` (415 otherwise): the types a web page may send
  without a preflight (text/plain, forms) are refused, so a page cannot drive the server (CSRF).
"""

from __future__ import annotations

import ipaddress
import json
import re
import uuid
from typing import Any, Callable, Iterable

from dgcli.server.request import error_body

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
HEADER_TOKEN_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~\-]+$")
JSON_TYPE_RE = re.compile(r"^(application/json|application/[a-z0-9.+\-]+\+json)$")
PREFLIGHT_MAX_AGE_S = 600
LOOPBACK_NAMES = ("localhost",)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def split_host(host: str) -> str:
    """The name or address of a Host header, without its port, lower-cased; IPv6 without brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else ""  # unbalanced: names nothing
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostCheck:
    """Which Host headers name this server, from the address it listens on."""

    def __init__(self, bound: str, allowed: Iterable[str] = ()):
        self.names = {name.strip().lower().rstrip(".") for name in allowed if name.strip()}
        address = _ip(bound)
        self.any_ip = address is not None and address.is_unspecified
        self.loopback = (address is not None and address.is_loopback) or bound.lower() in LOOPBACK_NAMES
        self.bound = address

    def allows(self, host_header: str | None) -> bool:
        if host_header is None:  # HTTP/1.0: no browser sends that
            return True
        host = split_host(host_header).rstrip(".")
        if host in self.names:
            return True
        address = _ip(host)
        if address is None:
            return self.loopback and host in LOOPBACK_NAMES
        if self.any_ip or address == self.bound:
            return True
        return self.loopback and address.is_loopback


class CorsPolicy:
    def __init__(self, origins: Iterable[str] = ()):
        self.origins = {o.strip().rstrip("/").lower() for o in origins if o.strip()}

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin.rstrip("/").lower() in self.origins


def _headers(scope: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


class HttpGuard:
    """The checks above, around an ASGI app."""

    def __init__(self, app: Any, hosts: HostCheck, cors: CorsPolicy, log: Callable[[str], None]):
        self.app, self.hosts, self.cors, self.log = app, hosts, cors, log

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        given = headers.get("x-request-id", "")
        request_id = given if REQUEST_ID_RE.match(given) else "req_" + uuid.uuid4().hex[:24]
        scope.setdefault("state", {})["request_id"] = request_id
        origin = headers.get("origin")
        cors_origin = origin if origin is not None and self.cors.enabled and self.cors.allows(origin) else None
        extra = [(b"x-request-id", request_id.encode())]
        if cors_origin is not None:
            extra += [(b"access-control-allow-origin", cors_origin.encode("latin-1")), (b"vary", b"Origin"),
                      (b"access-control-expose-headers", b"x-request-id, retry-after")]

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + extra)
            await send(message)

        refusal = self.refusal(scope, headers, origin, cors_origin)
        if refusal is not None:
            status, message, code = refusal
            self.log(f"{request_id}  refused {scope['method']} {scope['path'][:80]} from "
                     f"{_client(scope)}: {message}")
            await _json(send_with_headers, status, error_body(message, code=code))
            return
        if scope["method"] == "OPTIONS" and cors_origin is not None \
                and "access-control-request-method" in headers:
            await self.preflight(send_with_headers, headers)
            return
        await self.app(scope, receive, send_with_headers)

    def refusal(self, scope: dict, headers: dict[str, str], origin: str | None,
                cors_origin: str | None) -> tuple[int, str, str] | None:
        host = headers.get("host")
        if not self.hosts.allows(host):
            shown = (host or "")[:80]
            return 403, (f"Host {shown!r} does not name this server (start it with --allowed-host NAME to "
                         "accept a name)"), "host_not_allowed"
        if origin is not None and cors_origin is None and not _same_origin(origin, host):
            return 403, (f"requests from the web page at {origin[:80]!r} are not allowed (start the server "
                         "with --cors ORIGIN to allow them)"), "origin_not_allowed"
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if not JSON_TYPE_RE.match(kind):
                shown = kind[:60] or "none"
                return 415, (f"the request body must be JSON sent as Content-Type: application/json (got {shown}; "
                             "curl: -H 'Content-Type: application/json')"), "unsupported_content_type"
        return None

    async def preflight(self, send: Any, headers: dict[str, str]) -> None:
        requested = [h.strip() for h in headers.get("access-control-request-headers", "").split(",") if h.strip()]
        allowed = ", ".join(h for h in requested if HEADER_TOKEN_RE.match(h)) or "authorization, content-type"
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", allowed.encode("latin-1")),
            (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode())]})
        await send({"type": "http.response.body", "body": b""})


def _same_origin(origin: str, host: str | None) -> bool:
    """The server's own page: its Origin is http://HOST (the Host header it was loaded from)."""
    return host is not None and origin.lower().rstrip("/") in (f"http://{host.lower()}", f"https://{host.lower()}")


def _client(scope: dict) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


async def _json(send: Any, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
