"""dg pull against a fake Hugging Face Hub on 127.0.0.1 (never the real network)."""

from __future__ import annotations

import hashlib
import re
from collections import namedtuple
from pathlib import Path

import pytest

from dgcli import hub
from dgcli.errors import DgError

from hub_server import closed_port  # the fake_hub fixture lives in conftest.py

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

    # past huggingface-hub's DOWNLOAD_CHUNK_SIZE: dg writes each piece as it arrives, so the retry
    # continues from the last byte received (it used to restart from the last whole 10 MB chunk)
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    payload = PAYLOAD * (chunk // len(PAYLOAD) + 2)
    fake_hub.files[("org/model-GGUF", "m.gguf")] = payload
    fake_hub.cut_first_get_at = chunk + 1000
    path = hub.download("org/model-GGUF", "m.gguf")
    assert path.read_bytes() == payload
    assert [r for _, _, r in fake_hub.gets()] == [None, f"bytes={chunk + 1000}-"]
    assert constants.DOWNLOAD_CHUNK_SIZE == chunk  # huggingface-hub's own setting is back


def test_partial_left_in_cache_is_never_loaded_and_is_replaced(fake_hub):
    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    etag = hashlib.sha256(PAYLOAD).hexdigest()
    blobs = hub.blobs_dir(repo)
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


def test_ctrl_c_mid_stream_keeps_every_byte_received_for_the_next_pull(fake_hub):
    # http_get wrote in 10 MB pieces: a Ctrl-C 3 MB into a download left an empty partial file
    repo, name = "org/model-GGUF", "m.gguf"
    payload = PAYLOAD * 4
    fake_hub.files[(repo, name)] = payload
    received = 3 * len(PAYLOAD) + 12345
    fake_hub.interrupt_first_get_at = received
    seen = []
    with pytest.raises(KeyboardInterrupt):
        hub.download(repo, name, on_progress=lambda done, total: seen.append(done))
    [partial] = hub.partial_files(repo)
    assert partial.read_bytes() == payload[:received] and seen[-1] == received
    path = hub.download(repo, name)
    assert path.read_bytes() == payload
    assert fake_hub.gets()[-1][2] == f"bytes={received}-"


def test_corrupt_partial_is_caught_by_the_checksum_and_removed(fake_hub):
    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    etag = hashlib.sha256(PAYLOAD).hexdigest()
    blobs = hub.blobs_dir(repo)
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
    with pytest.raises(DgError, match=r"not enough disk space for m.gguf: needs 68.2 MB \(1.0 MB"):
        hub.download("org/model-GGUF", "m.gguf")
    assert not fake_hub.gets()
    assert hub.cached_path("org/model-GGUF", "m.gguf") is None


def test_a_pull_refused_for_disk_space_leaves_no_unverified_mark(fake_hub, monkeypatch):
    # the refusal left an empty blobs/<sha256>.dg-unverified: once the file was in the cache
    # (fetched by huggingface-hub itself), dg took it for unfinished and said it was not downloaded
    from huggingface_hub import hf_hub_download

    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    Usage = namedtuple("Usage", "total used free")
    with monkeypatch.context() as m:
        m.setattr(hub.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
        with pytest.raises(DgError, match=r"not enough disk space"):
            hub.download(repo, name)
    assert list(hub.blobs_dir(repo).iterdir()) == []
    path = hf_hub_download(repo, name, cache_dir=str(hub.cache_dir()), endpoint=hub.hub_endpoint())
    assert hub.cached_path(repo, name) == Path(path)



def test_disk_space_message_never_says_more_is_free_than_needed(fake_hub, monkeypatch):
    # free space between the file's size and its size plus the margin read "needs 1.0 MB, 34.6 MB free"
    fake_hub.files[("org/model-GGUF", "m.gguf")] = PAYLOAD
    Usage = namedtuple("Usage", "total used free")
    free = len(PAYLOAD) + 32 * 1024**2
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda p: Usage(10**12, 10**12 - free, free))
    with pytest.raises(DgError, match=r"not enough disk space") as err:
        hub.download("org/model-GGUF", "m.gguf")
    needs, has = re.search(r"needs ([0-9.]+) MB.*, ([0-9.]+) MB free", str(err.value)).groups()
    assert float(needs) > float(has), str(err.value)
    assert not fake_hub.gets()

def test_format_bytes_uses_one_decimal_unit_system():
    assert hub.format_bytes(512) == "512 B"
    assert hub.format_bytes(1457248) == "1.5 MB"
    assert hub.format_bytes(16 * 10**9) == "16.0 GB"
    assert hub.format_bytes(16 * 1024**3) == "17.2 GB"
    assert hub.format_bytes(3 * 10**12) == "3.0 TB"
    assert hub.format_bytes(None) == "?"


def test_a_cache_that_is_not_a_folder_is_one_line(fake_hub, tmp_path, monkeypatch):
    # HF_HUB_CACHE naming a file (or /dev/null) was a NotADirectoryError traceback from `dg pull`
    fake_hub.files[("org/model-GGUF", "m.gguf")] = PAYLOAD
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("HF_HUB_CACHE", str(not_a_folder))
    with pytest.raises(DgError, match=r"cannot write to the huggingface-hub cache .*a-file.*: Not a directory") as err:
        hub.download("org/model-GGUF", "m.gguf")
    assert "\n" not in str(err.value) and not_a_folder.read_text() == "x"


def test_refs_main_symlink_is_replaced_not_written_through(fake_hub, tmp_path):
    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    refs = hub._repo_cache_folder(repo) / "refs" / "main"
    refs.parent.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    refs.symlink_to(victim)
    assert hub.download(repo, name).read_bytes() == PAYLOAD
    assert victim.read_text() == "keep me"
    assert not refs.is_symlink() and len(refs.read_text()) == 40


def test_a_partial_file_that_is_a_symlink_is_replaced_not_written_through(fake_hub, tmp_path):
    # the download was appended to the symlink's target (a file outside the cache grew by 1 MB)
    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    blobs = hub.blobs_dir(repo)
    blobs.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (blobs / f"{hashlib.sha256(PAYLOAD).hexdigest()}{hub.PARTIAL_SUFFIX}").symlink_to(victim)
    assert hub.download(repo, name).read_bytes() == PAYLOAD
    assert victim.read_text() == "keep me"


def test_an_unverified_mark_that_is_a_symlink_creates_nothing_where_it_leads(fake_hub, tmp_path):
    # touch() followed a dangling link and created an empty file outside the cache
    repo, name = "org/model-GGUF", "m.gguf"
    fake_hub.files[(repo, name)] = PAYLOAD
    blobs = hub.blobs_dir(repo)
    blobs.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere" / "created"
    elsewhere.parent.mkdir()
    (blobs / f"{hashlib.sha256(PAYLOAD).hexdigest()}{hub.UNVERIFIED_SUFFIX}").symlink_to(elsewhere)
    assert hub.download(repo, name).read_bytes() == PAYLOAD
    assert not elsewhere.exists() and hub.cached_path(repo, name) is not None
