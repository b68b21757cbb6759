"""Which file of a Hub repository a registry entry means.

A registry entry names a repository and a quant (models.toml); the file is the repository's one
model `.gguf` of that quant, found in the repository's file listing. The listing comes from the
Hub's model API at a revision (`/api/models/{repo}/revision/{rev}?blobs=true`: every file with its
size and LFS sha256, and the commit the revision is at) and is kept in the huggingface-hub cache
beside the downloads (`models--owner--name/dg/listing-<rev>.json`), so that `dg list`, `dg info` and
every `--model NAME` resolve the same file offline afterwards.

Not every `.gguf` of a repository is a model: a vision projector (`mmproj`), a speculative-decoding
draft (`MTP`, `assistant`, `dflash`), an importance matrix are files beside it, and a model split
by `llama-gguf-split` is one model in several parts (`NAME-00001-of-00003.gguf`, loaded from its
first part). `choose_model_file` keeps those apart; a file name the registry gives is only a
preference among the candidates.

Every value from the server (or read back from the cache) is checked before it is used: a file name
must be a relative path that stays inside the repository (no '..', no absolute path, no backslash,
no control characters), a size an integer in range, a sha256 64 hex digits, the commit 40, the
response of bounded size.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from dgcli import hub
from dgcli.hub import COMMIT, MAX_FILE_BYTES, SHA256, HubError

LISTING_SCHEMA = "dg-hub-listing/1"
MAX_LISTING_BYTES = 32 << 20  # the API's answer for a repository of some thousand files is a few MB
MAX_LISTED_FILES = 100_000
MAX_PATH_CHARS = 1000
MAX_NAMES_SHOWN = 24  # in the one-line error that lists a repository's GGUF files

# llama-gguf-split's naming: the first part is what llama.cpp loads, the others sit beside it
SPLIT_PART = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)
# .gguf files that sit beside a model and are not one: name tokens that say what they are
AUXILIARY_TOKENS = frozenset({"mmproj", "mtp", "imatrix", "draft", "dflash", "dspark", "eagle", "eagle3", "assistant"})
# what may follow a quant's name inside a longer one: Q4_K is not Q4_K_M, Q4_0 is not Q4_0_4_4
_QUANT_CONTINUATION = re.compile(r"\d+|[kmsl]|x+[sl]")


class NoSingleModelFile(HubError):
    """A repository without exactly one model .gguf for a quant (the message lists its GGUF files)."""


@dataclass(frozen=True)
class ListedFile:
    path: str  # relative to the repository root, checked (check_listed_path)
    size: int
    sha256: str | None  # the LFS content hash; None for a small file kept in git itself


@dataclass(frozen=True)
class RepoListing:
    """A repository's .gguf files at one commit."""

    repo: str
    revision: str | None  # the pinned commit asked for; None: the main branch
    commit: str  # the commit the listing is of
    files: tuple[ListedFile, ...]  # sorted by path

    def file(self, path: str) -> ListedFile | None:
        return next((f for f in self.files if f.path == path), None)


@dataclass(frozen=True)
class ModelChoice:
    """The model file of a quant: one file, or a split model's parts in order (the first is loaded)."""

    parts: tuple[ListedFile, ...]

    @property
    def filename(self) -> str:
        return self.parts[0].path

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


# ---------------------------------------------------------------- checking what the server says


def check_listed_path(path: Any) -> str | None:
    """Why `path` cannot be a file of a repository (None when it can): it must be a relative path
    whose parts stay inside the repository, printable, of bounded length."""
    if not isinstance(path, str) or not path:
        return "not a file name"
    if len(path) > MAX_PATH_CHARS:
        return f"a file name of {len(path)} characters"
    if path.startswith("/") or "\\" in path or Path(path).is_absolute():
        return "an absolute path or a backslash"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "an empty, '.' or '..' part"
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") for c in path):
        return "a control character"
    return None


def _listed_file(path: Any, size: Any, sha256: Any, where: str) -> ListedFile:
    problem = check_listed_path(path)
    if problem is not None:
        raise HubError(f"{where} names an unusable file ({problem}): {str(path)[:80]!r}")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
        raise HubError(f"{where} gives {path} an invalid size: {str(size)[:40]!r}")
    if sha256 is not None and (not isinstance(sha256, str) or not SHA256.fullmatch(sha256)):
        raise HubError(f"{where} gives {path} an invalid sha256: {str(sha256)[:80]!r}")
    return ListedFile(path, size, sha256)


def _is_gguf(path: Any) -> bool:
    return isinstance(path, str) and path.lower().endswith(".gguf")


def _checked_files(entries: list[tuple[Any, Any, Any]], where: str) -> tuple[ListedFile, ...]:
    files = [_listed_file(p, s, h, where) for p, s, h in entries if _is_gguf(p)]
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise HubError(f"{where} lists a file twice")
    return tuple(sorted(files, key=lambda f: f.path))


def _checked_commit(commit: Any, revision: str | None, where: str) -> str:
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise HubError(f"{where} gives no valid commit id ({str(commit)[:60]!r})")
    if revision is not None and commit != revision:
        raise HubError(f"{where} is of commit {commit[:12]}, not of the pinned revision {revision[:12]}")
    return commit


def listing_from_api(data: Any, repo: str, revision: str | None) -> RepoListing:
    """The model API's answer (`sha`, `siblings` [{`rfilename`, `size`, `lfs`: {`sha256`}}]), checked."""
    where = f"the Hub's file list of {repo}"
    if not isinstance(data, dict):
        raise HubError(f"{where} is not a JSON object")
    siblings = data.get("siblings")
    if not isinstance(siblings, list) or len(siblings) > MAX_LISTED_FILES:
        raise HubError(f"{where} has no usable `siblings` list (the repository's files)")
    entries = []
    for s in siblings:
        if not isinstance(s, dict):
            raise HubError(f"{where} has an entry that is not an object")
        lfs = s.get("lfs")
        if lfs is not None and not isinstance(lfs, dict):
            raise HubError(f"{where} has an `lfs` entry that is not an object")
        entries.append((s.get("rfilename"), s.get("size"), lfs.get("sha256") if lfs else None))
    return RepoListing(repo, revision, _checked_commit(data.get("sha"), revision, where), _checked_files(entries, where))


def _listing_from_cache(data: Any, repo: str, revision: str | None, where: str) -> RepoListing:
    if not isinstance(data, dict) or data.get("schema") != LISTING_SCHEMA or data.get("repo") != repo \
            or data.get("revision") != revision or not isinstance(data.get("files"), list) \
            or len(data["files"]) > MAX_LISTED_FILES or not all(isinstance(f, dict) for f in data["files"]):
        raise HubError(f"{where} is not a listing of {repo}")
    entries = [(f.get("path"), f.get("size"), f.get("sha256")) for f in data["files"]]
    return RepoListing(repo, revision, _checked_commit(data.get("commit"), revision, where), _checked_files(entries, where))


# ---------------------------------------------------------------- fetching and caching


def _listing_path(repo: str, revision: str | None) -> Path:
    hub.check_repo_file(repo, "x.gguf")
    if revision is not None and not COMMIT.fullmatch(revision):  # a pin is a commit id: it names a file here
        raise HubError(f"not a commit id: {str(revision)[:60]!r}")
    return hub._repo_cache_folder(repo) / "dg" / f"listing-{revision or 'main'}.json"


def cached_listing(repo: str, revision: str | None = None) -> RepoListing | None:
    """The listing a pull (or `dg info`, `dg list --refresh`) kept; None when there is none or it
    cannot be used (it is read as warily as the server's answer). Never touches the network."""
    from dgcli.textfile import read_text_file

    try:
        path = _listing_path(repo, revision)
        if not path.is_file():
            return None
        hub._inside_cache(path)
        text = read_text_file(path, what="listing", max_bytes=MAX_LISTING_BYTES)
        return _listing_from_cache(json.loads(text), repo, revision, f"the cached listing {path}")
    except (HubError, OSError, ValueError, hub.DgError):
        return None


def _store(listing: RepoListing) -> None:
    """Keep the listing in the cache (written whole, then renamed, never through a symlink). The repo's
    `snapshots/` folder is made too: huggingface-hub's cache scan calls a repo folder without it corrupt."""
    path = _listing_path(listing.repo, listing.revision)
    hub._inside_cache(path.parent.parent)
    (path.parent.parent / "snapshots").mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    hub._inside_cache(path.parent)
    doc = {"schema": LISTING_SCHEMA, "repo": listing.repo, "revision": listing.revision, "commit": listing.commit,
           "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in listing.files]}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".listing-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(doc, out, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch_listing(repo: str, revision: str | None = None) -> RepoListing:
    """The repository's .gguf files at `revision` (a pinned commit; None: main) from the Hub, checked,
    and kept in the cache. HubError (one line) when the Hub cannot be reached or answers wrongly."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    _listing_path(repo, revision)  # the repo id and the revision checked before they shape a URL
    endpoint = (hub.hub_endpoint() or constants.ENDPOINT).rstrip("/")
    url = f"{endpoint}/api/models/{repo}/revision/{quote(revision or 'main', safe='')}"
    target = f"the file list of {repo}"
    try:
        with get_session().stream("GET", url, params={"blobs": "true"}, headers=build_hf_headers(),
                                  timeout=constants.HF_HUB_ETAG_TIMEOUT, follow_redirects=True) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_LISTING_BYTES:
                    raise HubError(f"the Hub's answer for {target} is over {MAX_LISTING_BYTES >> 20} MB; not read")
            if response.status_code >= 400:  # huggingface-hub's own mapping to its errors, on the bounded body
                hf_raise_for_status(type(response)(response.status_code, headers=response.headers,
                                                   content=bytes(body), request=response.request))
    except HubError:
        raise
    except Exception as err:  # noqa: BLE001 - every failure becomes one line
        from huggingface_hub import errors

        if isinstance(err, errors.RevisionNotFoundError):
            raise HubError(f"revision {revision or 'main'} not found in {repo}") from None
        raise hub._network_or(err, repo, "", target=target) from None
    try:
        data = json.loads(bytes(body))
    except ValueError:
        raise HubError(f"the Hub's answer for {target} is not JSON") from None
    listing = listing_from_api(data, repo, revision)
    try:
        _store(listing)
    except (OSError, HubError):
        pass  # an unwritable cache only costs the next command a request
    return listing


# ---------------------------------------------------------------- choosing the model's file


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[-_.\s]+", name.lower()) if t]


def is_auxiliary(path: str) -> bool:
    """A .gguf that sits beside a model and is not one: a projector, a draft head, an importance matrix."""
    return any(t in AUXILIARY_TOKENS for t in _tokens(path))


def quant_matches(path: str, quant: str) -> bool:
    """Whether a file's name says it is `quant`: the quant's tokens, in order, in its base name's
    (case-insensitive; separators '-', '_', '.'), not followed by more of a longer quant's name."""
    base = path.rsplit("/", 1)[-1]
    split = SPLIT_PART.fullmatch(base)
    stem = split["prefix"] if split else base[: -len(".gguf")] if base.lower().endswith(".gguf") else base
    have, want = _tokens(stem), _tokens(quant)
    for i in range(len(have) - len(want) + 1):
        if have[i:i + len(want)] == want:
            after = have[i + len(want)] if i + len(want) < len(have) else None
            if after is None or not _QUANT_CONTINUATION.fullmatch(after):
                return True
    return False


def model_candidates(listing: RepoListing) -> list[ModelChoice]:
    """The repository's models: each single .gguf that is not auxiliary, and each split model whose
    parts are all there (a split with a part missing is not loadable, so not a candidate)."""
    singles, splits = [], {}
    for f in listing.files:
        if is_auxiliary(f.path):
            continue
        m = SPLIT_PART.fullmatch(f.path)
        if m is None:
            singles.append(ModelChoice((f,)))
            continue
        splits.setdefault((m["prefix"], int(m["count"])), {})[int(m["no"])] = f
    for (_, count), parts in splits.items():
        if count >= 1 and sorted(parts) == list(range(1, count + 1)):
            singles.append(ModelChoice(tuple(parts[i] for i in range(1, count + 1))))
    return sorted(singles, key=lambda c: c.filename)


def describe_gguf_files(listing: RepoListing) -> str:
    """The repository's .gguf files for an error line: splits as one name with their part count."""
    names, seen = [], set()
    for f in listing.files:
        m = SPLIT_PART.fullmatch(f.path)
        if m is None:
            names.append(f.path)
            continue
        key = (m["prefix"], m["count"])
        if key not in seen:
            seen.add(key)
            have = sum(1 for g in listing.files if (s := SPLIT_PART.fullmatch(g.path)) and (s["prefix"], s["count"]) == key)
            names.append(f"{m['prefix']}-*-of-{m['count']}.gguf ({have} of {int(m['count'])} parts)")
    if not names:
        return "it has no .gguf files"
    more = f" and {len(names) - MAX_NAMES_SHOWN} more" if len(names) > MAX_NAMES_SHOWN else ""
    return "its .gguf files: " + ", ".join(names[:MAX_NAMES_SHOWN]) + more


def choose_model_file(listing: RepoListing, quant: str, preferred: str | None = None) -> ModelChoice:
    """The repository's model file for `quant`: the preferred name when it is one of the repository's
    models, else the one model whose name says `quant`. NoSingleModelFile (listing the repository's
    GGUF files) when none or several do."""
    candidates = model_candidates(listing)
    if preferred is not None:
        for c in candidates:
            if preferred in (p.path for p in c.parts):
                return c
    matches = [c for c in candidates if quant_matches(c.filename, quant)]
    if len(matches) == 1:
        return matches[0]
    at = f" at {listing.commit[:12]}"
    found = (f"no model .gguf for {quant}" if not matches else
             f"{len(matches)} model .gguf files for {quant} ({', '.join(c.filename for c in matches)})")
    raise NoSingleModelFile(f"{listing.repo}{at} has {found}; {describe_gguf_files(listing)}")
