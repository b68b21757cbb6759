"""`dg pull` against a hostile or broken hub (the fake one, on 127.0.0.1): nothing the server sends
shapes a path outside the cache, content is checked against the metadata API's sha256 (never the
ETag alone), two pulls of one file take turns, and a blob a pull did not finish with is hashed
again before it is used."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgcli import hub
from dgcli.errors import DgError

REPO, NAME = "org/model-GGUF", "m.gguf"
PAYLOAD = bytes(range(256)) * 4096  # 1 MiB
SHA = hashlib.sha256(PAYLOAD).hexdigest()


def outside_cache(root: Path) -> list[str]:
    """Everything under `root` (the test's folder) that is not the cache itself."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if hub.cache_dir() not in [p, *p.parents])


@pytest.fixture
def served(fake_hub):
    fake_hub.files[(REPO, NAME)] = PAYLOAD
    return fake_hub


def test_etag_with_a_path_in_it_is_never_a_path(served, tmp_path):
    served.etag = "../../../x/owned"
    path = hub.download(REPO, NAME)
    assert path.read_bytes() == PAYLOAD
    assert Path(os.path.realpath(path)).name == SHA  # the blob is named by the metadata API's sha256
    assert outside_cache(tmp_path) == []


def test_commit_with_a_path_in_it_is_refused_and_no_user_file_is_touched(served, tmp_path):
    user_file = tmp_path / "x" / NAME
    user_file.parent.mkdir()
    user_file.write_text("the user's own file")
    for commit in ("../../../x", "0123456789abcdef0123456789abcdef0123456/", "main", ""):
        served.commit = commit
        with pytest.raises(DgError, match="no valid commit id"):
            hub.download(REPO, NAME)
    assert user_file.read_text() == "the user's own file" and not user_file.is_symlink()
    assert not served.gets()  # refused before any byte was fetched


def test_content_is_checked_against_the_metadata_api_not_the_etag(served, tmp_path):
    served.etag = "not-a-sha256"
    served.served = bytes(reversed(PAYLOAD))  # same size, other bytes
    with pytest.raises(DgError, match=r"checksum mismatch \(sha256 .* from the Hub's metadata\)"):
        hub.download(REPO, NAME)
    assert hub.cached_path(REPO, NAME) is None and hub.partial_files(REPO) == []
    served.served = None
    assert hub.download(REPO, NAME).read_bytes() == PAYLOAD


def test_metadata_api_without_a_valid_sha256_is_refused(served):
    for bad in ("../../x", "0" * 63, "G" * 64):
        served.api_sha256 = bad
        with pytest.raises(DgError, match="no valid sha256"):
            hub.download(REPO, NAME)
    assert not served.gets()


def test_etag_that_contradicts_the_metadata_api_is_refused(served):
    served.etag = "f" * 64
    with pytest.raises(DgError, match="ETag .* is not the sha256"):
        hub.download(REPO, NAME)


def test_small_non_lfs_file_is_checked_against_its_git_blob_id(served):
    served.lfs = False
    served.served = bytes(reversed(PAYLOAD))
    with pytest.raises(DgError, match="git blob id"):
        hub.download(REPO, NAME)
    served.served = None
    path = hub.download(REPO, NAME)
    assert path.read_bytes() == PAYLOAD


def test_a_server_that_sends_more_than_the_size_is_stopped_at_the_size(served):
    # http_get compares sizes only once the server stops: one sending without end filled the disk
    served.served = PAYLOAD * 8
    served.seconds_per_chunk = 0.001
    with pytest.raises(DgError, match="sent more than the 1048576 bytes its metadata API gives"):
        hub.download(REPO, NAME)
    assert all(p.stat().st_size <= len(PAYLOAD) for p in hub.partial_files(REPO))
    served.served = None
    assert hub.download(REPO, NAME).read_bytes() == PAYLOAD  # the next pull still works


def test_cache_folder_that_links_outside_the_cache_is_not_written_through(served, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = hub.blobs_dir(REPO).parent
    folder.mkdir(parents=True)
    (folder / "snapshots").symlink_to(elsewhere)
    with pytest.raises(DgError, match="refusing to write outside the huggingface-hub cache"):
        hub.download(REPO, NAME)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("repo,name", [("../../x", NAME), ("org/../..", NAME), (REPO, "../../../x.gguf"),
                                       (REPO, "/etc/passwd"), (REPO, "")])
def test_repo_ids_and_file_names_cannot_climb_out(repo, name, served, tmp_path):
    with pytest.raises(DgError, match="not a (Hub repository id|file name inside a repository)"):
        hub.download(repo, name)
    assert outside_cache(tmp_path) == [] and not served.requests


PULL = """
import inspect, sys
from dgcli import hub
wait = {"on_wait": lambda line: print("waited:", line, file=sys.stderr)}
path = hub.download("org/model-GGUF", "m.gguf", **(wait if "on_wait" in inspect.signature(hub.download).parameters else {}))
print(path)
"""


@pytest.mark.subprocess
def test_two_pulls_of_one_file_take_turns(served, tmp_path):
    big = bytes(range(256)) * 4096 * 4  # 4 MiB, served slowly so that the pulls overlap
    served.files[(REPO, NAME)] = big
    served.seconds_per_chunk = 0.02
    procs = [subprocess.Popen([sys.executable, "-c", PULL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    assert [code for _, _, code in results] == [0, 0], results
    assert len({out for out, _, _ in results}) == 1
    path = Path(results[0][0].strip())
    assert path.read_bytes() == big
    assert sum("waited: another download of m.gguf is running" in err for _, err, _ in results) == 1
    assert len(served.gets()) == 1  # the second found the first one's file
    assert hub.partial_files(REPO) == []


def _finished_but_still_marked(blob_bytes: bytes) -> Path:
    """The cache as a pull leaves it when killed after moving its blob, before clearing the mark."""
    blobs = hub.blobs_dir(REPO)
    blobs.mkdir(parents=True)
    blob = blobs / SHA
    blob.write_bytes(blob_bytes)
    (blobs / (SHA + hub.UNVERIFIED_SUFFIX)).touch()
    pointer = blobs.parent / "snapshots" / "0123456789abcdef0123456789abcdef01234567" / NAME
    pointer.parent.mkdir(parents=True)
    pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    return pointer


def test_blob_of_an_unfinished_pull_is_hashed_before_first_use(served):
    _finished_but_still_marked(PAYLOAD[:-1] + b"\x00")  # right size, wrong content
    assert hub.cached_path(REPO, NAME) is None  # not loaded as "already downloaded"
    checked = []
    path = hub.download(REPO, NAME, on_verify=lambda done, total: checked.append(done))
    assert path.read_bytes() == PAYLOAD and len(served.gets()) == 1  # found wrong, fetched again
    assert checked and checked[-1] == len(PAYLOAD)
    assert hub.cached_path(REPO, NAME) == path


def test_good_blob_of_an_unfinished_pull_is_kept_without_fetching_it_again(served):
    pointer = _finished_but_still_marked(PAYLOAD)
    assert hub.download(REPO, NAME) == pointer
    assert not served.gets() and hub.cached_path(REPO, NAME) == pointer
