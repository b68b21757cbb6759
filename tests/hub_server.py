"""A fake Hugging Face Hub on 127.0.0.1 for `dg pull` tests (never the real network)."""

from __future__ import annotations

import hashlib
import http.server
import socket
import threading

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves files as `/{repo}/resolve/{rev}/{file}` with the headers huggingface-hub reads.

    `cut_first_get_at`: the first full GET of a file sends only that many bytes then drops the
    connection (a network failure mid-download), so the client has to resume with a Range request.
    """

    def __init__(self):
        self.files: dict[tuple[str, str], bytes] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut_first_get_at: int | None = None
        self._cut_done = False
        hub_ref = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _lookup(self):
                parts = self.path.split("?")[0].lstrip("/").split("/")
                # org/name/resolve/rev/filename
                if len(parts) < 5 or parts[2] != "resolve":
                    return None, None
                repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
                if not any(r == repo for r, _ in hub_ref.files):
                    return "RepoNotFound", None
                data = hub_ref.files.get((repo, filename))
                return ("EntryNotFound", None) if data is None else (None, data)

            def _headers(self, data: bytes, status: int, length: int, extra=()):
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Content-Length", str(length))
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()

            def _error(self, code: str):
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self):
                hub_ref.requests.append(("HEAD", self.path, self.headers.get("Range")))
                err, data = self._lookup()
                if err or data is None:
                    return self._error(err or "RepoNotFound")
                self._headers(data, 200, len(data))

            def do_GET(self):
                rng = self.headers.get("Range")
                hub_ref.requests.append(("GET", self.path, rng))
                err, data = self._lookup()
                if err or data is None:
                    return self._error(err or "RepoNotFound")
                if rng:
                    start = int(rng.split("=")[1].split("-")[0])
                    body = data[start:]
                    self._headers(data, 206, len(body),
                                  [("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")])
                    self.wfile.write(body)
                    return
                if hub_ref.cut_first_get_at is not None and not hub_ref._cut_done:
                    hub_ref._cut_done = True
                    self._headers(data, 200, len(data))
                    self.wfile.write(data[: hub_ref.cut_first_get_at])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._headers(data, 200, len(data))
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def gets(self):
        return [r for r in self.requests if r[0] == "GET"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block exits: connections are refused
