"""The model registry (models.toml): short names, quants, roles and pairs.

`resolve("diffusiongemma-26b:Q8_0")`, `resolve("demo")` or `resolve("./my.gguf")` all give a
`ResolvedModel` saying where the file is (or would be, once pulled) without touching the network.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from dgcli.engine.types import DgError, ModelLoadError

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_REGISTRY_PATH = PACKAGE_DIR.parent / "models.toml"
DEFAULT_MODEL = "demo"
ROLES = ("diffusion", "ar")
GB = 1024**3


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


class Registry:
    def __init__(self, entries: dict[str, RegistryEntry], source: Path | None = None):
        self.entries = entries
        self.source = source

    @classmethod
    def load(cls, path: Path | str | None = None) -> "Registry":
        path = Path(path or os.environ.get("DG_REGISTRY") or DEFAULT_REGISTRY_PATH)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DgError(f"model registry not found: {path}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise _fail(path, str(err)) from None
        entries: dict[str, RegistryEntry] = {}
        for name, raw in (data.get("models") or {}).items():
            if not isinstance(raw, dict):
                raise _fail(path, f"[models.{name}] must be a table")
            role = raw.get("role")
            if role not in ROLES:
                raise _fail(path, f"{name}: role must be one of {', '.join(ROLES)}")
            files = {}
            for quant, spec in (raw.get("files") or {}).items():
                if not isinstance(spec, dict) or "file" not in spec:
                    raise _fail(path, f"{name}.files.{quant} needs a `file`")
                size = spec.get("size_gb")
                files[quant] = ModelFile(quant, spec["file"], int(size * GB) if size else None)
            repo = raw.get("repo")
            shipped = raw.get("shipped")
            if bool(repo) == bool(shipped):
                raise _fail(path, f"{name}: give exactly one of `repo` or `shipped`")
            if repo and not files:
                raise _fail(path, f"{name}: a repo entry needs [models.{name}.files]")
            default_quant = raw.get("default_quant") or (next(iter(files)) if files else None)
            if files and default_quant not in files:
                raise _fail(path, f"{name}: default_quant {default_quant} is not in its files")
            entries[name] = RegistryEntry(
                name=name, role=role, description=raw.get("description", ""), repo=repo, files=files,
                default_quant=default_quant, pair=raw.get("pair"),
                shipped=(PACKAGE_DIR / shipped) if shipped else None,
                bench_prompts=(PACKAGE_DIR / raw["bench_prompts"]) if raw.get("bench_prompts") else None,
            )
        for entry in entries.values():
            if entry.pair is not None and entry.pair not in entries:
                raise _fail(path, f"{entry.name}: pair {entry.pair!r} is not a registry entry")
        return cls(entries, path)

    def names(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> RegistryEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownModel(
                f"unknown model {name!r}; known models: {', '.join(self.entries)} (or pass a path to a .gguf file)"
            ) from None

    def resolve(self, spec: str, *, locate=None) -> ResolvedModel:
        """Resolve `name`, `name:QUANT` or a file path.

        `locate(repo, filename) -> Path | None` finds an already-downloaded file (the hub cache);
        injected so that resolving never needs the network and tests can stub the cache.
        """
        spec = spec.strip()
        if not spec:
            raise UnknownModel("empty --model value")
        if looks_like_path(spec):
            path = Path(spec).expanduser()
            if not path.exists():
                raise ModelLoadError(f"model file not found: {spec}")
            if path.is_dir():
                raise ModelLoadError(f"model path is a directory, not a GGUF file: {spec}")
            return ResolvedModel(spec=spec, role=None, path=path)
        name, _, quant = spec.partition(":")
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
        or Path(spec).is_file()
    )


def missing_shipped_message(resolved: ResolvedModel) -> str:
    assert resolved.entry is not None and resolved.entry.shipped is not None
    return (
        f"model {resolved.entry.name!r} is not installed (missing {resolved.entry.shipped}); "
        "pass --model NAME|PATH (see `dg list`)"
    )
