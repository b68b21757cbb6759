"""A registry model on the Hub (`dg pull`, `dg info`): resolved against its repository's listing,
described from the Hub's metadata and its GGUF header before it is downloaded, and downloaded into
the huggingface-hub cache, every part of a split model.

    resolved = registry.resolve("diffusiongemma-26b:Q8_0")     # offline: the cached listing, if any
    resolved = resolve_on_hub(resolved)                         # the Hub's listing: the file it is now
    path = download_model(resolved, progress=..., verify=...)   # its parts, checked against the listing

A listing of main is fetched again on every call (main moves); a pinned commit's is fetched once.
The files are downloaded at the listing's commit, so that what lands is what the listing described;
its size and sha256 must be the listing's too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dgcli import hub
from dgcli.errors import DgError
from dgcli.hub import HubError, ProgressCallback
from dgcli.hub_files import ListedFile, NoSingleModelFile, cached_listing, fetch_listing
from dgcli.registry import ResolvedModel, with_listing


def resolve_on_hub(resolved: ResolvedModel, *, locate=None) -> ResolvedModel:
    """`resolved` with the file its repository's listing on the Hub says its quant is; HubError when
    the Hub cannot be reached, NoSingleModelFile when the listing names no single model file."""
    mf = resolved.model_file
    if mf is None or mf.repo is None:
        return resolved
    listing = (cached_listing(mf.repo, mf.revision) if mf.revision else None) or fetch_listing(mf.repo, mf.revision)
    out = with_listing(resolved, listing, locate=locate)
    if out.listing_problem is not None:
        raise NoSingleModelFile(out.listing_problem)
    return out


def download_model(resolved: ResolvedModel, *,
                   progress: Callable[[str], ProgressCallback | None] = lambda name: None,
                   verify: Callable[[str], ProgressCallback | None] = lambda name: None,
                   on_wait: Callable[[str], None] | None = None) -> Path:
    """Download the file (or every part) `resolved` names after resolve_on_hub, and return the path to
    load (the first part). `progress(name)` / `verify(name)` give each file's progress callbacks."""
    if resolved.choice is None or resolved.listing_commit is None:
        raise HubError(f"{resolved.display_name}: no file of {resolved.repo} chosen yet (resolve it on the Hub first)")
    commit, main = resolved.listing_commit, resolved.revision is None
    if len(resolved.choice.parts) > 1:  # all the parts' space before the first: each download checks its own
        hub.check_free_disk(_bytes_to_fetch(resolved.repo, resolved.choice.parts, commit), hub.cache_dir(),
                            f"the {len(resolved.choice.parts)} parts of {resolved.filename}")
    paths = []
    for part in resolved.choice.parts:
        paths.append(hub.download(resolved.repo, part.path, revision=commit, main=main, expected=(part.size, part.sha256),
                                  on_progress=progress(part.path), on_verify=verify(part.path), on_wait=on_wait))
    return paths[0]


def _bytes_to_fetch(repo: str, parts: tuple[ListedFile, ...], commit: str) -> int:
    """What the parts not in the cache still need: their sizes, less what their partial downloads hold."""
    total = 0
    for part in parts:
        if hub.cached_path(repo, part.path, commit) is not None:
            continue
        partial = hub.blobs_dir(repo) / f"{part.sha256}{hub.PARTIAL_SUFFIX}" if part.sha256 else None
        have = partial.stat().st_size if partial is not None and partial.is_file() else 0
        total += max(part.size - have, 0)
    return total


@dataclass
class HubModelInfo:
    """A registry model's file as the Hub describes it, and its GGUF header when it could be read."""

    repo: str
    revision: str | None  # the pinned commit, if any
    commit: str  # the commit the listing (and the header) are of
    parts: list[str]  # the file, or a split model's parts (the first is the one loaded)
    size: int  # all parts together
    sha256: str | None  # of the first part
    downloaded: bool
    info: Any = None  # dgcli.modelfile.info.GgufInfo from the header read over the network, or None
    header_problem: str | None = None  # why the header was not read

    def to_json(self) -> dict[str, Any]:
        return {"repo": self.repo, "revision": self.revision, "commit": self.commit, "file": self.parts[0],
                "parts": self.parts, "size": self.size, "sha256": self.sha256, "downloaded": self.downloaded}


def hub_model_info(resolved: ResolvedModel, *, read_header: bool = True, **offload) -> HubModelInfo:
    """What the Hub says of `resolved` (resolved_on_hub first): its file(s), size and commit, and, with
    `read_header`, its GGUF header read by Range requests of the first bytes (dgcli.remote_gguf), as
    dgcli.modelfile.info reads a local file's (`offload`: n_gpu_layers, n_cpu_moe, gpus). A header that cannot
    be read leaves `header_problem` saying why; the Hub's metadata is still returned."""
    from dgcli.modelfile.header import merge_split
    from dgcli.modelfile.info import info_from_header
    from dgcli.remote_gguf import read_remote_header

    assert resolved.choice is not None and resolved.listing_commit is not None
    first = resolved.choice.parts[0]
    out = HubModelInfo(repo=resolved.repo, revision=resolved.revision, commit=resolved.listing_commit,
                       parts=list(resolved.parts), size=resolved.choice.size, sha256=first.sha256,
                       downloaded=resolved.path is not None)
    if not read_header:
        return out
    try:
        headers = []
        for part in resolved.choice.parts:  # a split model's parts each have a header: its tensors
            remote = hub.remote_file(resolved.repo, part.path, resolved.listing_commit)
            if remote.size != part.size:
                raise HubError(f"the Hub's metadata gives {part.path} {remote.size} bytes, its file list {part.size}")
            headers.append(read_remote_header(remote))
        header = merge_split(headers[0], headers[1:]) if len(headers) > 1 else headers[0]
        out.info = info_from_header(header, **offload)
    except DgError as err:
        out.header_problem = str(err)
    return out
