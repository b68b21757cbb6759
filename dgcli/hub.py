"""`dg pull`: download registry models with huggingface-hub into its cache.

huggingface-hub (2.x) downloads into a process-unique `blobs/<etag>.<id>.incomplete` file, resumes
it with Range requests when the connection drops mid-transfer, deletes it when the download fails
or is interrupted, and only links the file into `snapshots/<commit>/` once complete. `cached_path`
reads the snapshot, so a partial file is never loaded. (Older huggingface-hub versions kept
`<etag>.incomplete` across runs and resumed it; 2.x starts over after Ctrl-C.)
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dgcli.engine.types import DgError

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


def incomplete_files(repo: str) -> list[Path]:
    """Partial downloads of this repo left in the cache (never loaded; removed by `dg pull`)."""
    blobs = _repo_cache_folder(repo) / "blobs"
    return sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []


@dataclass(frozen=True)
class RemoteFile:
    repo: str
    filename: str
    size: int | None


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
    return RemoteFile(repo, filename, meta.size)


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
    """Download one file into the huggingface-hub cache (resuming a partial one) and return its path.

    Checks free disk space first, against the Hub's size for the file (the registry's approximate
    size only if the Hub gave none). Partial files left by an older huggingface-hub are removed
    first: this version cannot resume them, and they would only hold disk space.
    """
    from huggingface_hub import hf_hub_download

    existing = cached_path(repo, filename)
    if existing is not None:
        if on_progress:
            size = existing.stat().st_size
            on_progress(size, size)
        return existing
    remote = remote_file(repo, filename)
    size = remote.size or approx_size
    target = cache_dir()
    for stale in incomplete_files(repo):
        stale.unlink(missing_ok=True)
    if size:
        check_free_disk(size, target, filename)

    tqdm_class = None
    if on_progress is not None:
        def tqdm_class(**kwargs):  # noqa: E306 - huggingface-hub instantiates it with tqdm kwargs
            return _CallbackProgress(on_progress, **kwargs)

    try:
        path = hf_hub_download(
            repo, filename, cache_dir=str(target), endpoint=hub_endpoint(), tqdm_class=tqdm_class
        )
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001
        raise _network_or(err, repo, filename) from None
    return Path(path)


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
