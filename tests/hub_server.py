"""A fake Hugging Face Hub on 127.0.0.1 for `dg pull` tests (never the real network)."""

from __future__ import annotations

import hashlib
import http.server
import json
import signal
import socket
import sys
import threading
import time
import urllib.parse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class _QuietServer(http.server.ThreadingHTTPServer):
    """Says nothing when a client drops the connection: the tests' clients do so on purpose (a listing
    refused past its size limit, a download interrupted); any other error is printed as usual."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class FakeHub:
    """Serves files as `/{repo}/resolve/{rev}/{file}` with the headers huggingface-hub reads, and the
    metadata API's `POST /api/models/{repo}/paths-info/{rev}` (size, git blob id, LFS sha256).

    `cut_first_get_at`: the first full GET of a file sends only that many bytes then drops the
    connection (a network failure mid-download), so the client has to resume with a Range request.
    A hostile or broken hub: `etag`, `commit` and `api_sha256` replace what would be sent for every
    file, `served` replaces the bytes of a GET (not the metadata), `lfs=False` describes files as
    small git files (no LFS), `seconds_per_chunk` slows each 64 kB of a GET down.

    `interrupt_first_get_at`: the first full GET sends that many bytes, gives the client a second
    to read them, then sends SIGINT to the main thread (a Ctrl-C mid-download) and stops.

    The model API's `GET /api/models/{repo}/revision/{rev}` lists a repo's files (`siblings` with
    size and LFS sha256) and its commit; `listing` replaces that answer with any JSON value (a broken
    or hostile hub). Revisions: `main` and the commit (`COMMIT`, or `commit` when set) exist, any
    other is RevisionNotFound. `ignore_range` answers Range requests with the whole file (200).
    """

    def __init__(self):
        self.files: dict[tuple[str, str], bytes] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut_first_get_at: int | None = None
        self.interrupt_first_get_at: int | None = None
        main_thread = threading.main_thread().ident
        self._cut_done = False
        self.etag: str | None = None
        self.commit: str | None = None
        self.api_sha256: str | None = None
        self.served: bytes | None = None
        self.lfs = True
        self.seconds_per_chunk = 0.0
        self.listing = None
        self.ignore_range = False
        hub_ref = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _lookup(self):
                parts = urllib.parse.unquote(self.path.split("?")[0]).lstrip("/").split("/")
                # org/name/resolve/rev/filename
                if len(parts) < 5 or parts[2] != "resolve":
                    return None, None
                repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
                if not any(r == repo for r, _ in hub_ref.files):
                    return "RepoNotFound", None
                if parts[3] not in ("main", hub_ref.commit_id()):
                    return "RevisionNotFound", None
                data = hub_ref.files.get((repo, filename))
                return ("EntryNotFound", None) if data is None else (None, data)

            def _headers(self, data: bytes, status: int, length: int, extra=()):
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT if hub_ref.commit is None else hub_ref.commit)
                etag = hashlib.sha256(data).hexdigest() if hub_ref.etag is None else hub_ref.etag
                self.send_header("ETag", f'"{etag}"')
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

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                hub_ref.requests.append(("POST", self.path, None))
                parts = self.path.split("?")[0].lstrip("/").split("/")
                # api/models/org/name/paths-info/rev
                if len(parts) != 6 or parts[:2] != ["api", "models"] or parts[4] != "paths-info":
                    return self._error("EntryNotFound")
                repo = "/".join(parts[2:4])
                if not any(r == repo for r, _ in hub_ref.files):
                    return self._error("RepoNotFound")
                listed = []
                for path in urllib.parse.parse_qs(body).get("paths", []):
                    data = hub_ref.files.get((repo, path))
                    if data is None:
                        continue
                    entry = {"type": "file", "path": path, "size": len(data),
                             "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
                    if hub_ref.lfs:
                        sha = hashlib.sha256(data).hexdigest() if hub_ref.api_sha256 is None else hub_ref.api_sha256
                        entry["lfs"] = {"oid": sha,
                                        "size": len(data), "pointerSize": 134}
                    listed.append(entry)
                payload = json.dumps(listed).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _send(self, body: bytes):
                if not hub_ref.seconds_per_chunk:
                    self.wfile.write(body)
                    return
                for at in range(0, len(body), 1 << 16):
                    self.wfile.write(body[at:at + (1 << 16)])
                    self.wfile.flush()
                    time.sleep(hub_ref.seconds_per_chunk)

            def _model_info(self, parts: list[str]):
                # api/models/org/name[/revision/rev]
                repo = "/".join(parts[2:4])
                if not any(r == repo for r, _ in hub_ref.files):
                    return self._error("RepoNotFound")
                if len(parts) == 6 and parts[5] not in ("main", hub_ref.commit_id()):
                    return self._error("RevisionNotFound")
                siblings = []
                for (r, path), data in sorted(hub_ref.files.items()):
                    if r != repo:
                        continue
                    entry = {"rfilename": path, "size": len(data),
                             "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
                    if hub_ref.lfs:
                        entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                    siblings.append(entry)
                doc = {"id": repo, "sha": hub_ref.commit_id(), "siblings": siblings}
                payload = json.dumps(doc if hub_ref.listing is None else hub_ref.listing).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                rng = self.headers.get("Range")
                hub_ref.requests.append(("GET", self.path, rng))
                parts = urllib.parse.unquote(self.path.split("?")[0]).lstrip("/").split("/")
                if parts[:2] == ["api", "models"] and (len(parts) == 4 or (len(parts) == 6 and parts[4] == "revision")):
                    return self._model_info(parts)
                err, data = self._lookup()
                if err or data is None:
                    return self._error(err or "RepoNotFound")
                headers_for = data
                if hub_ref.served is not None:
                    data = hub_ref.served
                if rng and not hub_ref.ignore_range:
                    first, _, last = rng.split("=")[1].partition("-")
                    start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
                    body = data[start:end]
                    self._headers(headers_for, 206, len(body),
                                  [("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")])
                    self._send(body)
                    return
                if hub_ref.interrupt_first_get_at is not None and not hub_ref._cut_done:
                    hub_ref._cut_done = True
                    self._headers(headers_for, 200, len(data))
                    self.wfile.write(data[: hub_ref.interrupt_first_get_at])
                    self.wfile.flush()
                    time.sleep(1.0)  # the client reads what was sent, then waits for more
                    signal.pthread_kill(main_thread, signal.SIGINT)
                    self.close_connection = True
                    return
                if hub_ref.cut_first_get_at is not None and not hub_ref._cut_done:
                    hub_ref._cut_done = True
                    self._headers(headers_for, 200, len(data))
                    self.wfile.write(data[: hub_ref.cut_first_get_at])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._headers(headers_for, 200, len(data))
                self._send(data)

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def commit_id(self) -> str:
        return COMMIT if self.commit is None else self.commit

    def gets(self):
        """GET requests for files (huggingface-hub also GETs an API page or two of its own)."""
        return [r for r in self.requests if r[0] == "GET" and "/resolve/" in r[1]]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block exits: connections are refused
