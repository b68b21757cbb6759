"""The model registry (models.toml): short names, quants, roles and pairs.

`resolve("diffusiongemma-26b:Q8_0")`, `resolve("demo")` or `resolve("./my.gguf")` all give a
`ResolvedModel` saying where the file is (or would be, once pulled) without touching the network.

A registry entry names a Hub repository and its quants; which file of the repository a quant is
comes from the repository's listing (dgcli.hub_files), kept in the cache by the last `dg pull`,
`dg info` or `dg list --refresh`. Before there is one, the file name the registry gives for the quant
(a preference, which the listing overrides when the repository's file is named otherwise) is the
one looked for in the cache.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dgcli.errors import DgError, ModelLoadError
from dgcli.hub import COMMIT, REPO_ID
from dgcli.hub_files import ModelChoice, NoSingleModelFile, RepoListing, choose_model_file
from dgcli.textfile import read_text_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli, the parser the standard library took as tomllib in 3.11
    import tomli as tomllib

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_REGISTRY_PATH = PACKAGE_DIR.parent / "models.toml"
DEFAULT_MODEL = "demo"
ROLES = ("diffusion", "ar")
GB = 10**9  # sizes are in the Hub's units (decimal), as `dg list` shows them
MAX_REGISTRY_BYTES = 1 << 20
# what `--model NAME[:QUANT]` can reach: no ':' (it splits NAME from QUANT), nothing that reads as a path
# (a '/', a '.gguf' ending), no control characters (the names are printed by `dg list`)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}")


class UnknownModel(DgError):
    """A registry name or quant that does not exist."""


@dataclass(frozen=True)
class ModelFile:
    """One quant of a repo entry: where it is (the entry's repo and revision unless it names its own)."""

    quant: str
    filename: str | None  # the registry's preferred file name; None: the quant alone chooses it
    approx_size_bytes: int | None
    repo: str | None = None
    revision: str | None = None  # a pinned commit; None: the repository's main branch


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    role: str
    description: str = ""
    repo: str | None = None
    files: dict[str, ModelFile] = field(default_factory=dict)
    default_quant: str | None = None
    pair: str | None = None
    shipped: Path | None = None  # absolute path of a file shipped inside the package
    bench_prompts: Path | None = None  # `dg bench`'s default prompt set for this model (inside the package)
    revision: str | None = None  # the commit every quant is pinned to, unless it names its own


@dataclass(frozen=True)
class ResolvedModel:
    """Where one `--model` value points. `path` is None when it must be pulled first.

    `choice` is the file the repository's listing says the quant is (None before a listing was
    fetched, or when it names no single file: `listing_problem` then says why)."""

    spec: str
    role: str | None  # None for a bare path (the GGUF itself says what it is)
    path: Path | None
    entry: RegistryEntry | None = None
    quant: str | None = None
    choice: ModelChoice | None = None
    listing_commit: str | None = None  # the commit of the listing `choice` comes from
    listing_problem: str | None = None

    @property
    def display_name(self) -> str:
        if self.entry is None:
            return str(self.path)
        return f"{self.entry.name}:{self.quant}" if self.quant else self.entry.name

    @property
    def model_file(self) -> ModelFile | None:
        return self.entry.files[self.quant] if self.entry and self.quant else None

    @property
    def repo(self) -> str | None:
        mf = self.model_file
        return mf.repo if mf else self.entry.repo if self.entry else None

    @property
    def revision(self) -> str | None:
        mf = self.model_file
        return mf.revision if mf else None

    @property
    def filename(self) -> str | None:
        """The file to load: the listing's choice, else the registry's preferred name."""
        if self.choice is not None:
            return self.choice.filename
        mf = self.model_file
        return mf.filename if mf else None

    @property
    def parts(self) -> tuple[str, ...]:
        """Every file to download: one, or a split model's parts (the first is `filename`)."""
        if self.choice is not None:
            return tuple(p.path for p in self.choice.parts)
        return (self.filename,) if self.filename else ()

    @property
    def size_known(self) -> bool:
        """The size is the Hub's (from the listing), not the registry's approximate one."""
        return self.choice is not None

    @property
    def approx_size_bytes(self) -> int | None:
        if self.choice is not None:
            return self.choice.size
        mf = self.model_file
        return mf.approx_size_bytes if mf else None

    @property
    def needs_pull(self) -> bool:
        return self.path is None and self.repo is not None


def _fail(path: Path, message: str) -> DgError:
    return DgError(f"invalid registry {path}: {message}")


def _field(path: Path, where: str, raw: dict, key: str, kind: type | tuple, what: str, required: bool = False):
    """raw[key] when it has the right type (None when absent and optional); else a one-line error."""
    value = raw.get(key)
    if value is None:
        if required:
            raise _fail(path, f"{where} needs `{key}`")
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _fail(path, f"{where}.{key} must be {what}, not {value!r}")
    return value


def _relative_file(path: Path, where: str, value: str | None) -> str | None:
    # a repo file name or a file inside the package: never absolute, never climbing out
    if value is not None and (not value.strip() or Path(value).is_absolute() or ".." in Path(value).parts
                              or "\\" in value):
        raise _fail(path, f"{where} must be a relative file name, not {value!r}")
    return value


def _repo(path: Path, where: str, value: str | None) -> str | None:
    if value is not None and not REPO_ID.fullmatch(value):
        raise _fail(path, f"{where} must be a Hub repository id like owner/name, not {value!r}")
    return value


def _revision(path: Path, where: str, value: str | None) -> str | None:
    # a pin is a commit: a branch or tag name can move, and a pinned file would change under it
    if value is not None and not COMMIT.fullmatch(value):
        raise _fail(path, f"{where} must be a commit id (40 lowercase hex digits), not {value!r}")
    return value


def _model_file(path: Path, name: str, quant: str, spec: object, repo: str | None, revision: str | None) -> ModelFile:
    where = f"{name}.files.{quant}"
    if not NAME.fullmatch(quant):
        raise _fail(path, f"{name}: quant {quant!r} must be letters, digits, '.', '_', '+' or '-'")
    if not isinstance(spec, dict):
        raise _fail(path, f"{where} must be a table (`file`, `size_gb`, `repo`, `revision`, all optional)")
    filename = _relative_file(path, f"{where}.file", _field(path, where, spec, "file", str, "a string"))
    size = _field(path, where, spec, "size_gb", (int, float), "a number of GB")
    if size is not None and not 0 < size < 1e6:
        raise _fail(path, f"{where}.size_gb must be a positive number of GB, not {size!r}")
    own_repo = _repo(path, f"{where}.repo", _field(path, where, spec, "repo", str, "a string"))
    own_revision = _revision(path, f"{where}.revision", _field(path, where, spec, "revision", str, "a string"))
    if own_repo is not None and own_repo != repo and own_revision is None:
        revision = None  # the entry's pin is a commit of the entry's repo, not of this one
    return ModelFile(quant, filename, int(size * GB) if size else None, own_repo or repo, own_revision or revision)


def _entry(path: Path, name: str, raw: object) -> RegistryEntry:
    if not NAME.fullmatch(name) or name.lower().endswith(".gguf"):
        raise _fail(path, f"model name {name!r} must be letters, digits, '.', '_', '+' or '-' (not ending in .gguf)")
    if not isinstance(raw, dict):
        raise _fail(path, f"[models.{name}] must be a table")
    role = raw.get("role")
    if role not in ROLES:
        raise _fail(path, f"{name}: role must be one of {', '.join(ROLES)}")
    repo = _repo(path, f"{name}.repo", _field(path, name, raw, "repo", str, "a string"))
    revision = _revision(path, f"{name}.revision", _field(path, name, raw, "revision", str, "a string"))
    files = {quant: _model_file(path, name, quant, spec, repo, revision)
             for quant, spec in (_field(path, name, raw, "files", dict, "a table") or {}).items()}
    shipped = _relative_file(path, f"{name}.shipped", _field(path, name, raw, "shipped", str, "a string"))
    if bool(repo) == bool(shipped):
        raise _fail(path, f"{name}: give exactly one of `repo` or `shipped`")
    if repo and not files:
        raise _fail(path, f"{name}: a repo entry needs [models.{name}.files] (its quants)")
    if shipped and (files or revision):
        raise _fail(path, f"{name}: a shipped entry has no quants or revision")
    default_quant = _field(path, name, raw, "default_quant", str, "a string") or (next(iter(files)) if files else None)
    if files and default_quant not in files:
        raise _fail(path, f"{name}: default_quant {default_quant} is not in its files")
    prompts = _relative_file(path, f"{name}.bench_prompts",
                             _field(path, name, raw, "bench_prompts", str, "a string"))
    return RegistryEntry(
        name=name, role=role, description=_field(path, name, raw, "description", str, "a string") or "",
        repo=repo, files=files, default_quant=default_quant, pair=_field(path, name, raw, "pair", str, "a string"),
        shipped=(PACKAGE_DIR / shipped) if shipped else None,
        bench_prompts=(PACKAGE_DIR / prompts) if prompts else None, revision=revision,
    )


class Registry:
    def __init__(self, entries: dict[str, RegistryEntry], source: Path | None = None):
        self.entries = entries
        self.source = source

    @classmethod
    def load(cls, path: Path | str | None = None) -> "Registry":
        path = Path(path or os.environ.get("DG_REGISTRY") or DEFAULT_REGISTRY_PATH)
        # a regular file of bounded size: DG_REGISTRY=/dev/zero would be read for ever, a FIFO block the open
        text = read_text_file(path, what="model registry", max_bytes=MAX_REGISTRY_BYTES)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise _fail(path, str(err)) from None
        models = data.get("models") or {}
        if not isinstance(models, dict):
            raise _fail(path, "[models] must be a table")
        entries = {name: _entry(path, name, raw) for name, raw in models.items()}
        for entry in entries.values():
            if entry.pair is not None and entry.pair not in entries:
                raise _fail(path, f"{entry.name}: pair {entry.pair!r} is not a registry entry")
            if entry.pair is not None and entries[entry.pair].role == entry.role:
                raise _fail(path, f"{entry.name}: pair {entry.pair!r} has the same role ({entry.role}); "
                                  "a pair is the other role's model")
        return cls(entries, path)

    def names(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> RegistryEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownModel(
                f"unknown model {_shorten(name)!r}; known models: {', '.join(self.entries)} "
                "(or pass a path to a .gguf file)"
            ) from None

    def resolve(self, spec: str, *, locate=None, listings=None, what: str = "--model value") -> ResolvedModel:
        """Resolve `name`, `name:QUANT` or a file path.

        `locate(repo, filename, revision) -> Path | None` finds an already-downloaded file (the hub
        cache), `listings(repo, revision)` a cached listing; injected so that resolving never needs
        the network and tests can stub the cache.
        `what` names the value in errors, as the user typed it (an option or an argument).
        """
        spec = spec.strip()
        if not spec:
            raise UnknownModel(f"empty {what}")
        if looks_like_path(spec):
            try:
                path = Path(spec).expanduser()
            except RuntimeError:  # '~name' of a user that does not exist: pathlib raises, not OSError
                raise ModelLoadError(f"cannot use model path {_shorten(spec)}: no home folder for "
                                     f"{_shorten(spec.split('/')[0])}") from None
            try:
                if not path.exists():
                    raise ModelLoadError(f"model file not found: {_shorten(spec)}")
                if path.is_dir():
                    raise ModelLoadError(f"model path is a directory, not a GGUF file: {_shorten(spec)}")
                if not path.is_file():  # a FIFO would block the reader, a device never ends
                    raise ModelLoadError(f"model path is not a regular file: {_shorten(spec)}")
            except OSError as err:
                raise ModelLoadError(f"cannot use model path {_shorten(spec)}: {err.strerror or err}") from None
            return ResolvedModel(spec=spec, role=None, path=path)
        name, _, quant = spec.partition(":")
        if not name:
            raise UnknownModel(f"no model name before ':' in {_shorten(spec)!r}: expected NAME or NAME:QUANT (see `dg list`)")
        entry = self.get(name)
        if entry.shipped is not None:
            if quant:
                raise UnknownModel(f"{name} has no quants (it is a single shipped file); use {name!r}")
            path = entry.shipped if entry.shipped.exists() else None
            return ResolvedModel(spec=spec, role=entry.role, path=path, entry=entry)
        return self.resolve_quant(entry, quant or entry.default_quant, spec=spec, locate=locate, listings=listings)

    def resolve_quant(self, entry: RegistryEntry, quant: str, *, spec: str | None = None, locate=None,
                      listings=None) -> ResolvedModel:
        """A repo entry's quant (matched case-insensitively): the file the cached listing says it is,
        and where it is in the cache. `listings(repo, revision) -> RepoListing | None` reads the cached
        listings (injected, as `locate` is)."""
        if quant not in entry.files:
            matches = [q for q in entry.files if q.lower() == quant.lower()]
            if not matches:
                raise UnknownModel(
                    f"unknown quant {quant!r} for {entry.name}; available: {', '.join(entry.files)}"
                )
            quant = matches[0]
        if listings is None:
            from dgcli.hub_files import cached_listing as listings
        mf = entry.files[quant]
        return with_listing(ResolvedModel(spec=spec or f"{entry.name}:{quant}", role=entry.role, path=None, entry=entry,
                                          quant=quant), listings(mf.repo, mf.revision), locate=locate)

    def pair_of(self, resolved: ResolvedModel, *, locate=None, listings=None) -> ResolvedModel | None:
        """The registry pair of a registry model, in the same quant when the pair has it (Q8_0 with
        Q8_0), else in the pair's default quant."""
        if resolved.entry is None or resolved.entry.pair is None:
            return None
        pair = self.get(resolved.entry.pair)
        if pair.shipped is not None:
            return self.resolve(pair.name, locate=locate, listings=listings)
        same = [q for q in pair.files if resolved.quant and q.lower() == resolved.quant.lower()]
        return self.resolve_quant(pair, same[0] if same else pair.default_quant, locate=locate, listings=listings)


def with_listing(resolved: ResolvedModel, listing: RepoListing | None, *, locate=None) -> ResolvedModel:
    """`resolved` with the file `listing` says its quant is (when it names one) and where that file is
    in the cache. Without a listing, the registry's file name is looked for (on refs/main, or at the
    pinned commit). `locate(repo, filename, revision) -> Path | None` finds a complete cached file."""
    from dataclasses import replace

    if locate is None:
        from dgcli import hub

        locate = hub.cached_path
    mf = resolved.model_file
    assert mf is not None
    choice, problem = None, None
    if listing is not None:
        try:
            choice = choose_model_file(listing, mf.quant, mf.filename)
        except NoSingleModelFile as err:
            problem = str(err)
    if choice is not None:
        path = _locate_choice(locate, mf.repo, choice, listing.commit)
    else:
        path = locate(mf.repo, mf.filename, mf.revision) if mf.filename else None
    return replace(resolved, path=path, choice=choice, listing_problem=problem,
                   listing_commit=listing.commit if listing is not None else None)


def _locate_choice(locate, repo: str, choice: ModelChoice, commit: str) -> Path | None:
    """The chosen file's first part when every part is in the cache side by side: in the listing's
    commit's snapshot, or in the one refs/main names as long as each part there is the listed content
    (its blob is named by the listed sha256; main moved on, the file did not: no new download, no
    hash pass)."""
    found = [locate(repo, part.path, commit) for part in choice.parts]
    if all(found):
        return found[0]
    found = [locate(repo, part.path, None) for part in choice.parts]
    if all(found) and all(part.sha256 and Path(os.path.realpath(f)).name == part.sha256
                          for f, part in zip(found, choice.parts)):
        return found[0]
    return None


def looks_like_path(spec: str) -> bool:
    """A --model value is a path when it says so; otherwise it is a registry name.

    A name never contains a path separator or ends in .gguf; an existing file is always a path.
    """
    return (
        "/" in spec
        or os.sep in spec
        or spec.lower().endswith(".gguf")
        or spec.startswith((".", "~"))
        or _is_file(Path(spec))
    )


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long to be a file name, for one
        return False


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def missing_shipped_message(resolved: ResolvedModel) -> str:
    assert resolved.entry is not None and resolved.entry.shipped is not None
    return (
        f"model {resolved.entry.name!r} is not installed (missing {resolved.entry.shipped}); "
        "pass --model NAME|PATH (see `dg list`)"
    )
