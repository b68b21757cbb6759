"""`dg pull`: download registry models with huggingface-hub into its cache.

The file lands in huggingface-hub's cache layout (`blobs/<sha256>`, linked from
`snapshots/<commit>/<file>`), so other Hugging Face tools see it too. The transfer itself is ours:
huggingface-hub 2.x's `hf_hub_download` deletes its partial file when a download fails or is
interrupted, and a 16 GB GGUF should not start over after a Ctrl-C. We write
`blobs/<sha256>.dg-partial`, continue it with a Range request on the next `dg pull`
(huggingface-hub's `http_get` also resumes within a run when the connection drops), check its size
and sha256, and only then move it to `blobs/<sha256>` and link the snapshot. `cached_path` reads
the snapshot, so a partial file is never loaded.

Nothing the server sends is trusted as it comes: the commit must be 40 hex digits, the content's
sha256 comes from the Hub's metadata API (paths-info at that commit; the ETag is only cross-checked)
and must be 64 hex digits, the sizes must agree, and every path is checked to stay inside the cache
after resolving symlinks. One pull of a blob at a time: huggingface-hub's own lock file
(`.locks/<repo>/<sha256>.lock`, which `hf_hub_download` takes too). A pull marks the blob
`<sha256>.dg-unverified` while it works; a blob still marked (a pull killed before it finished) is
hashed again before its first use.

hf_xet is not used: dg's transfer is a plain HTTPS download the next run can continue with a Range
request; every registry file is under the 50 GB the Hub serves over HTTPS, and Xet's protocol
cannot be exercised against the local fake Hub the tests use.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dgcli.errors import DgError
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


COMMIT = re.compile(r"[0-9a-f]{40}")
SHA256 = re.compile(r"[0-9a-f]{64}")
GIT_BLOB_ID = re.compile(r"[0-9a-f]{40}")
# a Hugging Face repository id: owner/name of letters, digits, '-', '_', '.' (no '..': no path tricks)
REPO_ID = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
MAX_FILE_BYTES = 1 << 50  # a size from the server above this is not a file dg will fetch


def check_repo_file(repo: str, filename: str) -> None:
    """A repository id and a file name that can only name a place inside the cache."""
    if not isinstance(repo, str) or not REPO_ID.fullmatch(repo):
        raise HubError(f"not a Hub repository id: {repo!r}")
    parts = Path(filename).parts if isinstance(filename, str) else ()
    if not parts or Path(filename).is_absolute() or ".." in parts or "\\" in filename:
        raise HubError(f"not a file name inside a repository: {filename!r}")


def _inside_cache(path: Path) -> Path:
    """`path` with symlinks resolved, if that stays inside the cache; else a HubError."""
    root = cache_dir().resolve()
    real = path.resolve()
    if real != root and root not in real.parents:
        raise HubError(f"refusing to write outside the huggingface-hub cache ({root}): {path} leads to {real}")
    return real


def _unverified_marker(blob: Path) -> Path:
    return blob.with_name(blob.name + UNVERIFIED_SUFFIX)


def cached_path(repo: str, filename: str, revision: str | None = None) -> Path | None:
    """The complete cached file (of the commit `revision`, or of the one refs/main names), or None.
    Never touches the network; never hashes.

    A blob a pull did not finish with (still marked unverified) is not complete: `download`
    checks it first."""
    from huggingface_hub import try_to_load_from_cache

    try:
        check_repo_file(repo, filename)
        if revision is not None and not COMMIT.fullmatch(revision):
            return None
        found = try_to_load_from_cache(repo, filename, cache_dir=str(cache_dir()), revision=revision)
        if not isinstance(found, str) or not Path(found).is_file():
            return None
        blob = _inside_cache(Path(found))
    except (HubError, OSError):
        return None
    return None if _unverified_marker(blob).exists() else Path(found)


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
UNVERIFIED_SUFFIX = ".dg-unverified"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at one commit, every field checked (see `remote_file`)."""

    repo: str
    filename: str
    size: int
    commit: str  # 40 hex digits
    digest: str  # the blob's name: the LFS sha256 (64 hex), or the git blob id of a small file (40 hex)
    url: str  # where the bytes are (after the Hub's redirects)

    @property
    def lfs(self) -> bool:
        return len(self.digest) == 64


def _translate(err: BaseException, repo: str, filename: str, target: str | None = None) -> HubError:
    """Map huggingface-hub / network exceptions to one actionable line (`target`: what was being
    fetched, when it is not the file `filename`)."""
    from huggingface_hub import errors

    action = f"fetching {target}" if target else f"download of {repo}/{filename}"
    target = target or f"{repo}/{filename}"
    if isinstance(err, errors.GatedRepoError):
        return HubError(f"{repo} is gated: accept its license on the Hub, then log in (`hf auth login`)")
    if isinstance(err, errors.RepositoryNotFoundError):
        return HubError(f"repository not found on the Hub: {repo} (or it is private and you are not logged in)")
    if isinstance(err, errors.RevisionNotFoundError):
        return HubError(f"revision not found in {repo}")
    if isinstance(err, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return HubError(
            f"cannot reach the Hugging Face Hub ({hub_endpoint() or 'huggingface.co'}) to fetch {target}; "
            "check your connection (or HF_ENDPOINT / HF_HUB_OFFLINE)"
        )
    if isinstance(err, (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", ()))):
        return HubError(f"file {filename} not found in {repo}")
    if isinstance(err, errors.HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        return HubError(f"the Hub answered HTTP {status} for {target}")
    if isinstance(err, OSError) and getattr(err, "errno", None) == 28:
        return HubError(f"disk full while downloading {filename} into {cache_dir()}; free space and re-run to resume")
    return HubError(f"{action} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": "))


def remote_file(repo: str, filename: str, revision: str | None = None) -> RemoteFile:
    """The file's commit, size, digest and URL (at the pinned commit `revision`, or on main): a HEAD
    request, then the Hub's metadata API at that commit for the content digest. Every value is
    checked; raises HubError when one is missing, malformed or inconsistent."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    check_repo_file(repo, filename)
    if revision is not None and not COMMIT.fullmatch(revision):
        raise HubError(f"not a commit id: {revision!r}")
    endpoint = hub_endpoint()
    try:
        meta = get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision, endpoint=endpoint),
                                    endpoint=endpoint)
    except Exception as err:  # noqa: BLE001 - every failure becomes one line
        raise _network_or(err, repo, filename) from None
    where = f"{repo}/{filename}"
    commit = meta.commit_hash
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise HubError(f"the Hub sent no valid commit id for {where} ({commit!r}); cannot download it safely")
    if revision is not None and commit != revision:
        raise HubError(f"the Hub sent {where} of commit {commit[:12]}, not of the pinned revision {revision[:12]}")
    if not meta.location:
        raise HubError(f"the Hub sent no download location for {where}")
    try:
        [info] = HfApi(endpoint=endpoint).get_paths_info(repo, [filename], revision=commit)
    except ValueError:
        raise HubError(f"the Hub's metadata API does not list {where} at commit {commit[:12]}") from None
    except Exception as err:  # noqa: BLE001
        raise _network_or(err, repo, filename) from None
    lfs = getattr(info, "lfs", None)
    digest = getattr(lfs, "sha256", None) if lfs is not None else getattr(info, "blob_id", None)
    pattern = SHA256 if lfs is not None else GIT_BLOB_ID
    if getattr(info, "path", None) != filename or not isinstance(digest, str) or not pattern.fullmatch(digest):
        raise HubError(f"the Hub's metadata API gave no valid {'sha256' if lfs is not None else 'blob id'} "
                       f"for {where} ({digest!r}); cannot verify a download")
    size = getattr(info, "size", None)
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
        raise HubError(f"the Hub's metadata API gave an invalid size for {where}: {size!r}")
    if meta.size is not None and meta.size != size:
        raise HubError(f"the Hub disagrees with itself about {where}: {meta.size} bytes in its headers, "
                       f"{size} in its metadata API")
    etag = meta.etag or ""
    if lfs is not None and SHA256.fullmatch(etag) and etag != digest:
        raise HubError(f"the Hub's ETag for {where} is not the sha256 its metadata API gives")
    return RemoteFile(repo, filename, size, commit, digest, meta.location)


def _network_or(err: BaseException, repo: str, filename: str, target: str | None = None) -> HubError:
    from huggingface_hub import errors

    if isinstance(err, errors.HfHubHTTPError):
        return _translate(err, repo, filename, target)
    if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__module__.startswith(("httpx", "httpcore")):
        return _translate(errors.LocalEntryNotFoundError("offline"), repo, filename, target)
    return _translate(err, repo, filename, target)


def free_bytes(directory: Path) -> int:
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_free_disk(needed: int, directory: Path, what: str, *, margin: int = 64 * 1024**2) -> None:
    free = free_bytes(directory)
    if needed + margin > free:
        raise HubError(
            f"not enough disk space for {what}: needs {format_bytes(needed + margin)} ({format_bytes(needed)} "
            f"and {format_bytes(margin)} to spare), {format_bytes(free)} free in {directory}"
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
    revision: str | None = None,
    main: bool | None = None,
    expected: tuple[int, str | None] | None = None,
    approx_size: int | None = None,
    on_progress: ProgressCallback | None = None,
    on_verify: ProgressCallback | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> Path:
    """Download one file into the huggingface-hub cache, continuing a partial one, and return its path.

    `revision`: the commit to download (None: main's); `main`: whether refs/main is to name it (by
    default when `revision` is None). `expected`: the (size, sha256) a listing gave for the file, which
    the Hub's metadata must repeat. Checks free disk space first, against the Hub's size for the
    file, minus what a partial download already holds.
    `on_progress` sees the transfer, `on_verify` the hash pass after it, `on_wait` a line when
    another pull of the same file holds its lock.
    """
    existing = cached_path(repo, filename, revision)
    if existing is not None:
        if on_progress:
            size = existing.stat().st_size
            on_progress(size, size)
        return existing
    remote = remote_file(repo, filename, revision)
    if expected is not None:
        size, sha256 = expected
        if remote.size != size or (sha256 is not None and remote.digest != sha256):
            raise HubError(f"the Hub's metadata for {repo}/{filename} ({remote.size} bytes, {remote.digest[:12]}...) "
                           f"is not what its file list gave ({size} bytes, {(sha256 or '-')[:12]}...)")
    folder = _repo_cache_folder(repo)
    blob = folder / "blobs" / remote.digest
    for path in (blob, folder / "snapshots" / remote.commit / remote.filename, folder / "refs" / "main"):
        _inside_cache(path.parent)
    try:
        with _pull_lock(remote, on_wait):
            return _pull_locked(remote, blob, approx_size, on_progress, on_verify,
                                main=revision is None if main is None else main)
    except OSError as err:  # the cache itself: HF_HUB_CACHE a file, a folder dg may not write, a full disk
        if err.errno == errno.ENOSPC:
            raise _translate(err, repo, filename) from None
        where = f" ({err.filename})" if err.filename else ""
        raise HubError(f"cannot write to the huggingface-hub cache {cache_dir()}{where}: {err.strerror or err}") from None


def _blob_lock(repo: str, digest: str):
    """huggingface-hub's lock file for one blob (`hf_hub_download` takes the same one)."""
    from filelock import FileLock

    path = cache_dir() / ".locks" / _repo_cache_folder(repo).name / f"{digest}.lock"
    _inside_cache(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path))


@contextmanager
def _pull_lock(remote: RemoteFile, on_wait: Callable[[str], None] | None) -> Iterator[None]:
    """One pull of a blob at a time, dg's or huggingface-hub's; the second waits, saying so."""
    from filelock import Timeout

    lock = _blob_lock(remote.repo, remote.digest)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if on_wait is not None:
            on_wait(f"another download of {remote.filename} is running; waiting for it to finish")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _remove_stale_partials(repo: str, keep: Path) -> None:
    """Partial files of other versions of files, or of huggingface-hub's own transfers, only hold
    disk: removed, unless a download of theirs is running (its lock is held)."""
    from filelock import Timeout

    held = keep.name.split(".")[0]  # the caller holds this blob's lock
    for stale in incomplete_files(repo) + partial_files(repo):
        digest = stale.name.split(".")[0]
        if stale == keep:
            continue
        if digest == held:
            stale.unlink(missing_ok=True)
            continue
        lock = _blob_lock(repo, digest)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            stale.unlink(missing_ok=True)
        finally:
            lock.release()


def _pull_locked(remote: RemoteFile, blob: Path, approx_size: int | None,
                 on_progress: ProgressCallback | None, on_verify: ProgressCallback | None, main: bool = True) -> Path:
    folder = blob.parent.parent
    pointer = folder / "snapshots" / remote.commit / remote.filename
    marker = _unverified_marker(blob)
    if pointer.is_file() and blob.is_file() and not marker.exists() and _same_file(pointer, blob):
        return pointer  # another pull finished it while this one waited for the lock
    blob.parent.mkdir(parents=True, exist_ok=True)
    if marker.is_symlink():  # touch() would create the link's target, wherever it leads
        marker.unlink()
    marker.touch()
    try:
        return _fill_blob(remote, blob, approx_size, on_progress, on_verify, main)
    except BaseException:
        if not blob.exists():  # a mark without its blob (refused for disk space, Ctrl-C) would outlive the pull
            marker.unlink(missing_ok=True)
        raise


def _fill_blob(remote: RemoteFile, blob: Path, approx_size: int | None,
               on_progress: ProgressCallback | None, on_verify: ProgressCallback | None, main: bool) -> Path:
    """The blob verified and linked, from what is there (a blob, a partial download) or the Hub."""
    folder = blob.parent.parent
    partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
    if blob.is_file():  # left by a pull that stopped before linking it, or by another tool
        if _mismatch(blob, remote, on_verify) is None:
            return _link_into_cache(folder, blob, remote, main)
        blob.unlink()
    _remove_stale_partials(remote.repo, keep=partial)
    if partial.is_symlink():  # replaced, never appended through: it may lead anywhere, outside the cache too
        partial.unlink()
    have = partial.stat().st_size if partial.exists() else 0
    if have > remote.size:
        partial.unlink()
        have = 0
    check_free_disk(max((remote.size or approx_size or 0) - have, 0), cache_dir(), remote.filename)
    _transfer(remote, partial, have, on_progress)
    if partial.stat().st_size < remote.size:
        raise HubError(f"{remote.filename}: downloaded {partial.stat().st_size} bytes, the Hub says {remote.size}; "
                       "run `dg pull` again to continue")
    problem = _mismatch(partial, remote, on_verify)
    if problem is not None:
        partial.unlink()
        raise HubError(f"{remote.filename}: {problem}; the partial download was removed, run `dg pull` again")
    partial.replace(blob)
    return _link_into_cache(folder, blob, remote, main)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _transfer(remote: RemoteFile, partial: Path, have: int, on_progress: ProgressCallback | None) -> None:
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    tqdm_class = None
    if on_progress is not None:
        def tqdm_class(**kwargs):  # noqa: E306 - huggingface-hub instantiates it with tqdm kwargs
            return _CallbackProgress(on_progress, **kwargs)

    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(partial, "ab") as out, _pieces_as_they_arrive():
            http_get(remote.url, _CappedFile(out, remote), resume_size=have, headers=build_hf_headers(),
                     expected_size=remote.size, displayed_filename=remote.filename, tqdm_class=tqdm_class)
    except (KeyboardInterrupt, HubError):
        raise  # the partial file stays; the next `dg pull` continues it (or drops it, if too long)
    except Exception as err:  # noqa: BLE001
        raise _network_or(err, remote.repo, remote.filename) from None


@contextmanager
def _pieces_as_they_arrive() -> Iterator[None]:
    """http_get gathers the response into DOWNLOAD_CHUNK_SIZE (10 MB) pieces and writes each once it
    is whole: a Ctrl-C threw away up to 10 MB already received, which the next pull fetched again.
    With no chunk size, each piece is written as it arrives, so the partial file keeps all of it."""
    from huggingface_hub import constants

    saved = constants.DOWNLOAD_CHUNK_SIZE
    constants.DOWNLOAD_CHUNK_SIZE = None
    try:
        yield
    finally:
        constants.DOWNLOAD_CHUNK_SIZE = saved


class _CappedFile:
    """The partial file as http_get writes it, never past the metadata API's size: http_get only
    compares sizes once the server stops sending, so a server that sends more (or never stops)
    would fill the disk first."""

    def __init__(self, file, remote: RemoteFile):
        self._file, self._remote = file, remote

    def write(self, data) -> int:
        if self._file.tell() + len(data) > self._remote.size:
            raise HubError(f"the Hub sent more than the {self._remote.size} bytes its metadata API gives for "
                           f"{self._remote.repo}/{self._remote.filename}; stopped (run `dg pull` again to retry)")
        return self._file.write(data)

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def _mismatch(path: Path, remote: RemoteFile, on_progress: ProgressCallback | None) -> str | None:
    """None when the file is the Hub's (size, then the metadata API's digest: the sha256, or the git
    blob id of a small non-LFS file); else what differs."""
    got = path.stat().st_size
    if got != remote.size:
        return f"{got} bytes, the Hub says {remote.size}"
    digest = _digest(path, remote, on_progress)
    if digest != remote.digest:
        kind = "sha256" if remote.lfs else "git blob id"
        return f"checksum mismatch ({kind} {digest[:12]}... != {remote.digest[:12]}... from the Hub's metadata)"
    return None


def _digest(path: Path, remote: RemoteFile, on_progress: ProgressCallback | None) -> str:
    if remote.lfs:
        digest = hashlib.sha256()
    else:  # git's blob id: sha1 of "blob <size>\0" + content
        digest = hashlib.sha1()
        digest.update(f"blob {remote.size}\0".encode())
    done = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            digest.update(chunk)
            done += len(chunk)
            if on_progress is not None:
                on_progress(done, remote.size)
    return digest.hexdigest()


def _link_into_cache(folder: Path, blob: Path, remote: RemoteFile, main: bool = True) -> Path:
    """Link a verified blob from the snapshot, point refs/main at its commit (when it is main's: a
    pinned older commit is not), and drop its unverified mark; returns the snapshot path."""
    pointer = folder / "snapshots" / remote.commit / remote.filename
    _inside_cache(pointer.parent)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.unlink(missing_ok=True)
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks (some Windows set-ups): huggingface-hub stores a copy then
        shutil.copyfile(blob, pointer)
    if main:
        refs = folder / "refs" / "main"
        refs.parent.mkdir(parents=True, exist_ok=True)
        refs.unlink(missing_ok=True)  # a symlink there is replaced, never written through
        refs.write_text(remote.commit)
    _unverified_marker(blob).unlink(missing_ok=True)
    return pointer
