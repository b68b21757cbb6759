"""Files of the llama.cpp that native/build.py builds from (the pinned llama-cpp-python sdist, which
`make setup` downloads and checks): Gemma 4's chat template, llama-server's own tests."""

from __future__ import annotations

import importlib.util
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build_module():
    spec = importlib.util.spec_from_file_location("dg_native_build_for_tests", ROOT / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sdist_path() -> Path:
    build = _build_module()
    return build.cache_root().parent / "sdist" / build.SDIST_FILE


def vendored_member(relative: str) -> str:
    """The tar member name of `relative` (a path inside vendor/llama.cpp)."""
    build = _build_module()
    return f"llama_cpp_python-{build.SDIST_VERSION}/vendor/llama.cpp/{relative}"


def read_vendored(relative: str) -> bytes:
    """A file of the vendored llama.cpp, read from the sdist (skips when the sdist is absent)."""
    sdist = sdist_path()
    if not sdist.is_file():
        pytest.skip(f"the llama-cpp-python sdist is not at {sdist}: run `make setup` (native/build.py fetches it)")
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(vendored_member(relative))
        assert member is not None, relative
        return member.read()


def extract_vendored(relative_dir: str, dest: Path) -> Path:
    """A folder of the vendored llama.cpp, extracted under dest; returns its path there."""
    sdist = sdist_path()
    if not sdist.is_file():
        pytest.skip(f"the llama-cpp-python sdist is not at {sdist}: run `make setup` (native/build.py fetches it)")
    prefix = vendored_member(relative_dir).rstrip("/") + "/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        for m in members:
            target = dest / m.name[len(prefix):]
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(m).read())
    return dest


GEMMA4_TEMPLATE = "models/templates/google-gemma-4-31B-it.jinja"
