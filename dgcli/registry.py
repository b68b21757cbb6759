"""The model registry (models.toml): short names, quants, roles and pairs.

`resolve("diffusiongemma-26b:Q8_0")`, `resolve("demo")` or `resolve("./my.gguf")` all give a
`ResolvedModel` saying where the file is (or would be, once pulled) without touching the network.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dgcli.engine.types import DgError, ModelLoadError
from dgcli.hub import REPO_ID
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
    quant: str
    filename: str
    approx_size_bytes: int | None


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


@dataclass(frozen=True)
class ResolvedModel:
    """Where one `--model` value points. `path` is None when it must be pulled first."""

    spec: str
    role: str | None  # None for a bare path (the GGUF itself says what it is)
    path: Path | None
    entry: RegistryEntry | None = None
    quant: str | None = None

    @property
    def display_name(self) -> str:
        if self.entry is None:
            return str(self.path)
        return f"{self.entry.name}:{self.quant}" if self.quant else self.entry.name

    @property
    def repo(self) -> str | None:
        return self.entry.repo if self.entry else None

    @property
    def filename(self) -> str | None:
        if self.entry and self.quant:
            return self.entry.files[self.quant].filename
        return None

    @property
    def approx_size_bytes(self) -> int | None:
        if self.entry and self.quant:
            return self.entry.files[self.quant].approx_size_bytes
        return None

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


def _entry(path: Path, name: str, raw: object) -> RegistryEntry:
    if not NAME.fullmatch(name) or name.lower().endswith(".gguf"):
        raise _fail(path, f"model name {name!r} must be letters, digits, '.', '_', '+' or '-' (not ending in .gguf)")
    if not isinstance(raw, dict):
        raise _fail(path, f"[models.{name}] must be a table")
    role = raw.get("role")
    if role not in ROLES:
        raise _fail(path, f"{name}: role must be one of {', '.join(ROLES)}")
    files = {}
    for quant, spec in (_field(path, name, raw, "files", dict, "a table") or {}).items():
        where = f"{name}.files.{quant}"
        if not NAME.fullmatch(quant):
            raise _fail(path, f"{name}: quant {quant!r} must be letters, digits, '.', '_', '+' or '-'")
        if not isinstance(spec, dict):
            raise _fail(path, f"{where} must be a table with a `file`")
        filename = _relative_file(path, f"{where}.file", _field(path, where, spec, "file", str, "a string", True))
        size = _field(path, where, spec, "size_gb", (int, float), "a number of GB")
        if size is not None and not 0 < size < 1e6:
            raise _fail(path, f"{where}.size_gb must be a positive number of GB, not {size!r}")
        files[quant] = ModelFile(quant, filename, int(size * GB) if size else None)
    repo = _field(path, name, raw, "repo", str, "a string")
    if repo is not None and not REPO_ID.fullmatch(repo):
        raise _fail(path, f"{name}.repo must be a Hub repository id like owner/name, not {repo!r}")
    shipped = _relative_file(path, f"{name}.shipped", _field(path, name, raw, "shipped", str, "a string"))
    if bool(repo) == bool(shipped):
        raise _fail(path, f"{name}: give exactly one of `repo` or `shipped`")
    if repo and not files:
        raise _fail(path, f"{name}: a repo entry needs [models.{name}.files]")
    default_quant = _field(path, name, raw, "default_quant", str, "a string") or (next(iter(files)) if files else None)
    if files and default_quant not in files:
        raise _fail(path, f"{name}: default_quant {default_quant} is not in its files")
    prompts = _relative_file(path, f"{name}.bench_prompts",
                             _field(path, name, raw, "bench_prompts", str, "a string"))
    return RegistryEntry(
        name=name, role=role, description=_field(path, name, raw, "description", str, "a string") or "",
        repo=repo, files=files, default_quant=default_quant, pair=_field(path, name, raw, "pair", str, "a string"),
        shipped=(PACKAGE_DIR / shipped) if shipped else None,
        bench_prompts=(PACKAGE_DIR / prompts) if prompts else None,
    )


class Registry:
    def __init__(self, entries: dict[str, RegistryEntry], source: Path | None = None):
        self.entries = entries
        self.source = source

    @classmethod
    def load(cls, path: Path | str | None = None) -> "Registry":
        path = Path(path or os.environ.get("DG_REGISTRY") or DEFAULT_REGISTRY_PATH)
        # a regular file of bounded size: DG_REGISTRY=/dev/zero read for ever, a FIFO blocked every command
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

    def resolve(self, spec: str, *, locate=None, what: str = "--model value") -> ResolvedModel:
        """Resolve `name`, `name:QUANT` or a file path.

        `locate(repo, filename) -> Path | None` finds an already-downloaded file (the hub cache);
        injected so that resolving never needs the network and tests can stub the cache.
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
        quant = quant or entry.default_quant
        if quant not in entry.files:
            matches = [q for q in entry.files if q.lower() == quant.lower()]
            if not matches:
                raise UnknownModel(
                    f"unknown quant {quant!r} for {name}; available: {', '.join(entry.files)}"
                )
            quant = matches[0]
        if locate is None:
            from dgcli import hub

            locate = hub.cached_path
        path = locate(entry.repo, entry.files[quant].filename)
        return ResolvedModel(spec=spec, role=entry.role, path=path, entry=entry, quant=quant)

    def pair_of(self, resolved: ResolvedModel, *, locate=None) -> ResolvedModel | None:
        """The registry pair of a registry model (same quant family: the pair's default)."""
        if resolved.entry is None or resolved.entry.pair is None:
            return None
        return self.resolve(resolved.entry.pair, locate=locate)


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
