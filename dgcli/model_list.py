"""`dg list`'s library: every registry model with its repository, the file it resolves to, its size
and whether it is on disk.

Offline by default: a quant's file is what the cached listing of its repository says (`dg pull`,
`dg info` and `dg list --refresh` keep one), else the registry's own name for it, marked as not
checked. `refresh_listings` fetches every repository's listing from the Hub first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dgcli.errors import DgError
from dgcli.registry import Registry, RegistryEntry


@dataclass
class ModelRow:
    name: str
    quant: str | None  # None: a shipped model (one file)
    role: str
    pair: str | None
    repo: str | None  # None: shipped with dg
    revision: str | None  # the pinned commit, if any
    file: str | None  # the file the quant resolves to (the first part of a split model)
    checked: bool  # `file` is from the repository's listing, not only the registry's name for it
    parts: int  # files to download (a split model's parts)
    size: int | None
    size_exact: bool  # the Hub's size (or the file's on disk), not the registry's approximate one
    on_disk: bool
    default: bool  # the entry's default quant
    description: str
    path: str | None
    commit: str | None  # of the listing the file comes from
    problem: str | None  # the listing names no single file for the quant: why

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _shipped_row(entry: RegistryEntry) -> ModelRow:
    present = entry.shipped.exists()
    return ModelRow(name=entry.name, quant=None, role=entry.role, pair=entry.pair, repo=None, revision=None,
                    file=entry.shipped.name, checked=True, parts=1,
                    size=entry.shipped.stat().st_size if present else None, size_exact=present, on_disk=present,
                    default=True, description=entry.description, path=str(entry.shipped) if present else None,
                    commit=None, problem=None)


def model_rows(registry: Registry, *, locate=None, listings=None) -> list[ModelRow]:
    """One row per shipped model and per quant of a repo entry, from the cache (never the network)."""
    rows = []
    for entry in registry.entries.values():
        if entry.shipped is not None:
            rows.append(_shipped_row(entry))
            continue
        for quant in entry.files:
            r = registry.resolve_quant(entry, quant, locate=locate, listings=listings)
            on_disk = r.path is not None
            # the listing's size (every part); a file found by the registry's name: its own
            size = r.path.stat().st_size if on_disk and r.choice is None else r.approx_size_bytes
            rows.append(ModelRow(name=entry.name, quant=quant, role=entry.role, pair=entry.pair, repo=r.repo,
                                 revision=r.revision, file=r.filename, checked=r.choice is not None,
                                 parts=max(len(r.parts), 1), size=size, size_exact=r.size_known or on_disk,
                                 on_disk=on_disk, default=quant == entry.default_quant,
                                 description=entry.description, path=str(r.path) if r.path else None,
                                 commit=r.listing_commit, problem=r.listing_problem))
    return rows


def refresh_listings(registry: Registry) -> list[str]:
    """Fetch (and cache) the listing of every repository the registry names; one line per repository
    that could not be listed (the rows then keep what the cache had)."""
    from dgcli.hub_files import fetch_listing

    wanted = []
    for entry in registry.entries.values():
        for mf in entry.files.values():
            if (mf.repo, mf.revision) not in wanted:
                wanted.append((mf.repo, mf.revision))
    problems = []
    for repo, revision in wanted:
        try:
            fetch_listing(repo, revision)
        except DgError as err:
            problems.append(f"{repo}: {err}")
    return problems


def sources(registry: Registry) -> list[str]:
    """Where each entry's files are: `name: owner/repo`, with the quants that live elsewhere and pins."""
    out = []
    for entry in registry.entries.values():
        if entry.shipped is not None:
            out.append(f"{entry.name}: shipped with dg")
            continue
        pin = f"@{entry.revision[:12]}" if entry.revision else ""
        elsewhere: dict[str, list[str]] = {}
        for quant, mf in entry.files.items():
            if mf.repo != entry.repo or mf.revision != entry.revision:
                elsewhere.setdefault(mf.repo + (f"@{mf.revision[:12]}" if mf.revision else ""), []).append(quant)
        extra = "".join(f" ({', '.join(quants)}: {where})" for where, quants in elsewhere.items())
        out.append(f"{entry.name}: {entry.repo}{pin}{extra}")
    return out
