"""`dg rm`: a downloaded registry model out of the huggingface-hub cache, found by huggingface-hub's own
cache scan (`scan_cache_dir`): the model's links in every snapshot, each blob no other link points to,
a snapshot left empty and the refs naming it, and dg's partial downloads of its files.

Other files of the repository (another quant, the listing dg keeps beside them, another quant's
partial download) stay: huggingface-hub's `delete_revisions` would take the whole repository folder
with the last revision. Every path is checked to be inside the cache before anything is removed, and
a link is removed as a link (never followed): a cache whose links lead elsewhere is refused whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dgcli import hub
from dgcli.errors import DgError
from dgcli.registry import ResolvedModel


class RemoveError(DgError):
    pass


@dataclass
class Removal:
    """What removing a model takes out of the cache, worked out before anything is removed."""

    display_name: str
    repo: str
    files: list[str]  # the model's files (a split model's parts), as the repository names them
    links: list[Path] = field(default_factory=list)  # snapshot links removed one by one
    blobs: list[Path] = field(default_factory=list)  # blobs no other link uses
    partials: list[Path] = field(default_factory=list)  # dg's partial downloads of the files
    revisions: list[str] = field(default_factory=list)  # commits whose snapshot holds only these files
    snapshots: list[Path] = field(default_factory=list)  # their snapshot folders (empty once the links go)
    refs: list[Path] = field(default_factory=list)  # the refs naming them (refs/main, ...)
    freed: int = 0  # bytes

    @property
    def empty(self) -> bool:
        return not (self.links or self.blobs or self.partials or self.revisions)


def plan_removal(resolved: ResolvedModel) -> Removal:
    """What `dg rm` would remove for a registry model (RemoveError when there is nothing, or a path
    would lead outside the cache)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound

    if resolved.entry is None:
        raise RemoveError(f"{resolved.spec} is a path: `dg rm` removes downloaded registry models (see `dg list`); "
                          "remove your own files yourself")
    if resolved.entry.shipped is not None:
        raise RemoveError(f"{resolved.display_name} is shipped with dg: nothing was downloaded to remove")
    files = list(resolved.parts) or [resolved.filename]
    removal = Removal(display_name=resolved.display_name, repo=resolved.repo, files=files)
    root = hub.cache_dir()
    try:
        cache = scan_cache_dir(root)
    except CacheNotFound:
        cache = None
    repo = next((r for r in cache.repos if r.repo_id == resolved.repo and r.repo_type == "model"), None) \
        if cache is not None else None
    if repo is not None:
        _plan_links(removal, repo, set(files))
    removal.partials = _partials(resolved)
    removal.freed += sum(_size(p) for p in removal.partials)
    if removal.empty:
        raise RemoveError(f"{resolved.display_name} is not downloaded (nothing of {', '.join(files)} from "
                          f"{resolved.repo} in {root})")
    return removal


def _plan_links(removal: Removal, repo, files: set[str]) -> None:
    ours, others = [], []
    for revision in repo.revisions:
        mine = [f for f in revision.files if _relative(f.file_path, revision.snapshot_path) in files]
        others += [f for f in revision.files if f not in mine]
        ours += mine
        if mine and len(mine) == len(revision.files):  # the snapshot holds nothing else: it goes too
            removal.snapshots.append(_check_inside(revision.snapshot_path))
            removal.refs += [_check_inside(repo.repo_path / "refs" / ref) for ref in revision.refs]
            removal.revisions.append(revision.commit_hash)
    kept_blobs = {_check_inside(f.blob_path) for f in others}
    for f in ours:
        removal.links.append(_check_link(f.file_path))
        blob = _check_inside(f.blob_path)
        if blob not in kept_blobs and blob not in removal.blobs:
            removal.blobs.append(blob)
            removal.freed += _size(blob)


def _partials(resolved: ResolvedModel) -> list[Path]:
    """dg's partial downloads of the model's files: named by the sha256 the repository's listing gives."""
    if resolved.choice is None:
        return []
    digests = {part.sha256 for part in resolved.choice.parts if part.sha256}
    return [p for p in hub.partial_files(resolved.repo)
            if p.name.removesuffix(hub.PARTIAL_SUFFIX) in digests and _check_inside(p)]


def execute(removal: Removal) -> None:
    """Remove what plan_removal found: links as links, the blobs, partials and refs, then the snapshot
    folders left empty (a folder that is not is left as it is)."""
    try:
        for link in removal.links:
            os.unlink(link)
        for path in [*removal.blobs, *removal.partials, *removal.refs]:
            path.unlink(missing_ok=True)
        for snapshot in removal.snapshots:
            for folder, _, _ in sorted(os.walk(snapshot), key=lambda entry: -len(entry[0])):
                try:
                    os.rmdir(folder)
                except OSError:
                    pass
    except OSError as err:
        raise RemoveError(f"cannot remove {removal.display_name} from {hub.cache_dir()}: {err.strerror or err}") from None


def _relative(path: Path, snapshot: Path) -> str | None:
    try:
        return Path(path).relative_to(snapshot).as_posix()
    except ValueError:
        return None


def _check_inside(path: Path) -> Path:
    """`path`, if it and what it leads to stay inside the cache."""
    try:
        return hub._inside_cache(Path(path))
    except DgError as err:
        raise RemoveError(f"nothing removed: {err}") from None


def _check_link(path: Path) -> Path:
    """A snapshot link: its folder inside the cache (the link itself is removed, not followed)."""
    path = Path(path)
    _check_inside(path.parent)
    _check_inside(path)  # and where it leads, or the cache is not one dg wrote
    return path.parent.resolve() / path.name


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
