"""`dg pull`: download registry models with huggingface-hub into its cache.

The file lands in huggingface-hub's cache layout (`blobs/<etag>`, linked from
`snapshots/<commit>/<file>`), so other Hugging Face tools see it too. The transfer itself is ours:
huggingface-hub 2.x's `hf_hub_download` deletes its partial file when a download fails or is
interrupted, and a 16 GB GGUF should not start over after a Ctrl-C. We write `blobs/<etag>.dg-partial`,
continue it with a Range request on the next `dg pull` (huggingface-hub's `http_get` also resumes
within a run when the connection drops), check its size (and sha256, which is the etag of LFS
files), and only then move it to `blobs/<etag>` and link the snapshot. `cached_path` reads the
snapshot, so a partial file is never loaded.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dgcli.engine.types import DgError
from dgcli.units import format_bytes  # noqa: F401 (callers use hub.format_bytes)

ProgressCallback = Callable[[int, "int | None"], None]  # (bytes done, total bytes or None)


class HubError(DgError):
    """Offline, missing repo/file, gated repo, no disk space: one line the user can act on."""


def hub_endpoint() -> str | None:
    # Read at call time (huggingface_hub reads HF_ENDPOINT once, at import).
    return os.environ.get("HF_ENDPOINT") or None


def cache_dir() -> Path:
    """huggingface-hub's model cache, honouring HF_HUB_CACHE / HF_HOME at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_path(repo: str, filename: str) -> Path | None:
    """The complete cached file, or None. Never touches the network."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=str(cache_dir()))
    if isinstance(found, str) and Path(found).is_file():
        return Path(found)
    return None


def _repo_cache_folder(repo: str) -> Path:
    return cache_dir() / ("models--" + repo.replace("/", "--"))


def blobs_dir(repo: str) -> Path:
    """Where the repo's file contents live in the cache (complete blobs and partial downloads)."""
    return _repo_cache_folder(repo) / "blobs"


def incomplete_files(repo: str) -> list[Path]:
    """huggingface-hub's own partial downloads of this repo (never loaded; removed by `dg pull`)."""
    blobs = blobs_dir(repo)
    return sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []


def partial_files(repo: str) -> list[Path]:
    """dg's resumable partial downloads of this repo (never loaded; continued by `dg pull`)."""
    blobs = blobs_dir(repo)
    return sorted(blobs.glob("*" + PARTIAL_SUFFIX)) if blobs.is_dir() else []


PARTIAL_SUFFIX = ".dg-partial"


@dataclass(frozen=True)
class RemoteFile:
    repo: str
    filename: str
    size: int | None
    etag: str | None = None
    commit: str | None = None
    url: str | None = None  # where the bytes are (after the Hub's redirects)


def _translate(err: BaseException, repo: str, filename: str) -> HubError:
    """Map huggingface-hub / network exceptions to one actionable line."""
    from huggingface_hub import errors

    if isinstance(err, errors.GatedRepoError):
        return HubError(f"{repo} is gated: accept its license on the Hub, then log in (`hf auth login`)")
    if isinstance(err, errors.RepositoryNotFoundError):
        return HubError(f"repository not found on the Hub: {repo} (or it is private and you are not logged in)")
    if isinstance(err, errors.RevisionNotFoundError):
        return HubError(f"revision not found in {repo}")
    if isinstance(err, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return HubError(
            f"cannot reach the Hugging Face Hub ({hub_endpoint() or 'huggingface.co'}) to fetch {repo}/{filename}; "
            "check your connection (or HF_ENDPOINT / HF_HUB_OFFLINE)"
        )
    if isinstance(err, (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", ()))):
        return HubError(f"file {filename} not found in {repo}")
    if isinstance(err, errors.HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        return HubError(f"the Hub answered HTTP {status} for {repo}/{filename}")
    if isinstance(err, OSError) and getattr(err, "errno", None) == 28:
        return HubError(f"disk full while downloading {filename} into {cache_dir()}; free space and re-run to resume")
    return HubError(f"download of {repo}/{filename} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": "))


def remote_file(repo: str, filename: str) -> RemoteFile:
    """Ask the Hub for the file's size (HEAD request); raises HubError when it cannot."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    endpoint = hub_endpoint()
    try:
        meta = get_hf_file_metadata(hf_hub_url(repo, filename, endpoint=endpoint), endpoint=endpoint)
    except Exception as err:  # noqa: BLE001 - every failure becomes one line
        raise _network_or(err, repo, filename) from None
    return RemoteFile(repo, filename, meta.size, meta.etag, meta.commit_hash, meta.location)


def _network_or(err: BaseException, repo: str, filename: str) -> HubError:
    from huggingface_hub import errors

    if isinstance(err, errors.HfHubHTTPError):
        return _translate(err, repo, filename)
    if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__module__.startswith(("httpx", "httpcore")):
        return _translate(errors.LocalEntryNotFoundError("offline"), repo, filename)
    return _translate(err, repo, filename)


def free_bytes(directory: Path) -> int:
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_free_disk(needed: int, directory: Path, what: str, *, margin: int = 64 * 1024**2) -> None:
    free = free_bytes(directory)
    if needed + margin > free:
        raise HubError(
            f"not enough disk space for {what}: needs {format_bytes(needed)}, "
            f"{format_bytes(free)} free in {directory}"
        )


class _CallbackProgress:
    """Stands in for tqdm inside huggingface-hub: forwards byte counts to a callback."""

    def __init__(self, callback: ProgressCallback, total=None, initial=0, **_ignored):
        self.callback, self.total, self.n = callback, total, initial or 0
        self.callback(self.n, self.total)

    def update(self, n=1):
        self.n += n
        self.callback(self.n, self.total)

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def download(
    repo: str,
    filename: str,
    *,
    approx_size: int | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """Download one file into the huggingface-hub cache, continuing a partial one, and return its path.

    Checks free disk space first, against the Hub's size for the file (the registry's approximate
    size only if the Hub gave none), minus what a partial download already holds.
    """
    existing = cached_path(repo, filename)
    if existing is not None:
        if on_progress:
            size = existing.stat().st_size
            on_progress(size, size)
        return existing
    remote = remote_file(repo, filename)
    if not remote.etag or not remote.commit or not remote.url:
        raise HubError(f"the Hub gave no etag/commit for {filename} in {repo}; cannot download it safely")
    folder = _repo_cache_folder(repo)
    partial = blobs_dir(repo) / (remote.etag + PARTIAL_SUFFIX)
    # Leftovers of other versions of files, or of huggingface-hub's own transfers, only hold disk.
    for stale in incomplete_files(repo) + [p for p in partial_files(repo) if p != partial]:
        stale.unlink(missing_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if remote.size is not None and have > remote.size:
        partial.unlink()
        have = 0
    size = remote.size or approx_size
    if size:
        check_free_disk(max(size - have, 0), cache_dir(), filename)
    _transfer(remote, partial, have, on_progress)
    _verify(partial, remote)
    return _link_into_cache(folder, partial, remote)


def _transfer(remote: RemoteFile, partial: Path, have: int, on_progress: ProgressCallback | None) -> None:
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    tqdm_class = None
    if on_progress is not None:
        def tqdm_class(**kwargs):  # noqa: E306 - huggingface-hub instantiates it with tqdm kwargs
            return _CallbackProgress(on_progress, **kwargs)

    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(partial, "ab") as out:
            http_get(remote.url, out, resume_size=have, headers=build_hf_headers(), expected_size=remote.size,
                     displayed_filename=remote.filename, tqdm_class=tqdm_class)
    except KeyboardInterrupt:
        raise  # the partial file stays; the next `dg pull` continues it
    except Exception as err:  # noqa: BLE001
        raise _network_or(err, remote.repo, remote.filename) from None


def _verify(partial: Path, remote: RemoteFile) -> None:
    """Size always; content too where the etag is the file's sha256 (LFS files, i.e. every GGUF)."""
    import hashlib
    import re

    got = partial.stat().st_size
    if remote.size is not None and got != remote.size:
        raise HubError(f"{remote.filename}: downloaded {got} bytes, the Hub says {remote.size}; run `dg pull` "
                       "again to continue")
    if re.fullmatch(r"[0-9a-f]{64}", remote.etag or ""):
        digest = hashlib.sha256()
        with open(partial, "rb") as f:
            for chunk in iter(lambda: f.read(8 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != remote.etag:
            partial.unlink()
            raise HubError(f"{remote.filename}: checksum mismatch (sha256 {digest.hexdigest()[:12]}... != "
                           f"{remote.etag[:12]}...); the partial download was removed, run `dg pull` again")


def _link_into_cache(folder: Path, partial: Path, remote: RemoteFile) -> Path:
    """Move a complete download into huggingface-hub's cache layout and return the snapshot path."""
    blob = folder / "blobs" / remote.etag
    partial.replace(blob)
    pointer = folder / "snapshots" / remote.commit / remote.filename
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.unlink(missing_ok=True)
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks (some Windows set-ups): huggingface-hub stores a copy then
        shutil.copyfile(blob, pointer)
    refs = folder / "refs" / "main"
    refs.parent.mkdir(parents=True, exist_ok=True)
    refs.write_text(remote.commit)
    return pointer
