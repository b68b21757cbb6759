"""dg pull against a fake Hugging Face Hub on 127.0.0.1 (never the real network)."""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import socket
import threading
from collections import namedtuple
from pathlib import Path

import pytest

from dgcli import hub
from dgcli.engine.types import DgError

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


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    server = FakeHub()
    server.thread.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    yield server
    server.server.shutdown()
    server.server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block exits: connections are refused


PAYLOAD = bytes(range(256)) * 4096  # 1 MiB, position-dependent so a bad resume shows


def test_download_fetches_file_into_cache_and_reports_progress(fake_hub):
    fake_hub.files[("org/model-GGUF", "m-Q4_K_M.gguf")] = PAYLOAD
    seen = []
    path = hub.download("org/model-GGUF", "m-Q4_K_M.gguf", on_progress=lambda done, total: seen.append((done, total)))
    assert path.read_bytes() == PAYLOAD
    assert Path(path).is_relative_to(hub.cache_dir())
    assert seen[-1] == (len(PAYLOAD), len(PAYLOAD))
    assert hub.cached_path("org/model-GGUF", "m-Q4_K_M.gguf") == path
    # Second call: served from the cache, no new GET.
    n_gets = len(fake_hub.gets())
    assert hub.download("org/model-GGUF", "m-Q4_K_M.gguf") == path
    assert len(fake_hub.gets()) == n_gets


def test_dropped_connection_resumes_with_range_request(fake_hub):
    from huggingface_hub import constants

    # huggingface-hub writes in DOWNLOAD_CHUNK_SIZE pieces: drop the connection after the first one.
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    payload = PAYLOAD * (chunk // len(PAYLOAD) + 2)
    fake_hub.files[("org/model-GGUF", "m.gguf")] = payload
    fake_hub.cut_first_get_at = chunk + 1000
    path = hub.download("org/model-GGUF", "m.gguf")
    assert path.read_bytes() == payload
    assert [r for _, _, r in fake_hub.gets()] == [None, f"bytes={chunk}-"]


def test_partial_left_in_cache_is_never_loaded_and_is_replaced(fake_hub):
    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    etag = hashlib.sha256(PAYLOAD).hexdigest()
    blobs = hub.cache_dir() / ("models--" + repo.replace("/", "--")) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{etag}.incomplete").write_bytes(PAYLOAD[: len(PAYLOAD) // 2])
    assert hub.cached_path(repo, name) is None  # a partial is not a model
    path = hub.download(repo, name)
    assert path.read_bytes() == PAYLOAD
    assert hub.incomplete_files(repo) == []


def test_interrupted_download_is_never_loaded_and_the_next_pull_continues_it(fake_hub, monkeypatch):
    from huggingface_hub import file_download

    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    real_get = file_download.http_get

    def interrupted_get(url, temp_file, **kwargs):
        temp_file.write(PAYLOAD[:1000])
        raise KeyboardInterrupt  # Ctrl-C mid-transfer

    monkeypatch.setattr(file_download, "http_get", interrupted_get)
    with pytest.raises(KeyboardInterrupt):
        hub.download(repo, name)
    assert hub.cached_path(repo, name) is None  # a partial is not a model
    [partial] = hub.partial_files(repo)
    assert partial.stat().st_size == 1000

    monkeypatch.setattr(file_download, "http_get", real_get)
    seen = []
    path = hub.download(repo, name, on_progress=lambda done, total: seen.append((done, total)))
    assert path.read_bytes() == PAYLOAD
    assert fake_hub.gets()[-1][2] == "bytes=1000-"  # continued, not restarted
    assert seen[0][0] == 1000 and seen[-1] == (len(PAYLOAD), len(PAYLOAD))
    assert hub.partial_files(repo) == [] and hub.cached_path(repo, name) == path


def test_corrupt_partial_is_caught_by_the_checksum_and_removed(fake_hub):
    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    etag = hashlib.sha256(PAYLOAD).hexdigest()
    blobs = hub.cache_dir() / ("models--" + repo.replace("/", "--")) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{etag}{hub.PARTIAL_SUFFIX}").write_bytes(b"\xff" * 1000)  # not the file's first bytes
    with pytest.raises(DgError, match="checksum mismatch"):
        hub.download(repo, name)
    assert hub.partial_files(repo) == [] and hub.cached_path(repo, name) is None
    assert hub.download(repo, name).read_bytes() == PAYLOAD  # the next pull starts clean


def test_missing_repo_and_missing_file_are_one_line_errors(fake_hub):
    fake_hub.files[("org/model-GGUF", "m.gguf")] = b"GGUF"
    with pytest.raises(DgError, match=r"repository not found on the Hub: org/nope"):
        hub.download("org/nope", "m.gguf")
    with pytest.raises(DgError, match=r"file other.gguf not found in org/model-GGUF"):
        hub.download("org/model-GGUF", "other.gguf")
    assert not fake_hub.gets()


def test_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DgError, match=r"cannot reach the Hugging Face Hub") as err:
        hub.download("org/model-GGUF", "m.gguf")
    assert "\n" not in str(err.value)


def test_not_enough_disk_space_stops_before_downloading(fake_hub, monkeypatch):
    fake_hub.files[("org/model-GGUF", "m.gguf")] = PAYLOAD
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DgError, match=r"not enough disk space for m.gguf: needs 1.0 MB"):
        hub.download("org/model-GGUF", "m.gguf")
    assert not fake_hub.gets()
    assert hub.cached_path("org/model-GGUF", "m.gguf") is None


def test_format_bytes():
    assert hub.format_bytes(512) == "512 B"
    assert hub.format_bytes(16 * 1024**3) == "16.0 GB"
    assert hub.format_bytes(None) == "?"
