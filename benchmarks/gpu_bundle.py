"""Prepare what the GPU check takes to a GPU machine that has no internet: `.whl/` in the repo root.

    python benchmarks/gpu_bundle.py [--wheel PATH] [--limit-mib 60]

- the sm_90 CUDA build of our llama.cpp (`native/build.py --cuda --cuda-arch 90 --no-install`: built, or found in the
  cache), its shared libraries stripped of symbols and the wheel re-zipped at the highest
  compression, so that it travels within the limit;
- dg's Python dependencies that machine lacks, as wheels for CPython 3.12 on x86-64 Linux: gguf,
  diskcache (llama_cpp imports it), Transformers 5.23.0 (the reference; the machine has an
  older one without DiffusionGemma) and the regex it checks for at import.

`.whl/` is git-ignored; carry it. On the GPU machine, from the repo root:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT

(dg's other needs, numpy, typer, rich, psutil, jinja2, huggingface-hub, torch and pytest, are there;
libggml-cuda finds the CUDA runtime and cuBLAS in NVIDIA's pip wheels through dgcli.runtime.native.)
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".whl"
# regex: Transformers 5.23 checks for regex>=2025.10.22 at import; the machine's own may be older
PY_DEPS = ["gguf==0.19.0", "diskcache==5.6.3", "transformers==5.23.0", "regex==2026.11.19"]
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                   for a in ("--platform", p)]]


# The check's machine is an H200: sm_90 machine code is all it runs, and one architecture is a third
# of the default three-architecture build's time and size.
GPU_CHECK_CUDA_ARCH = "90"


def built_cuda_wheel(cuda_arch: str) -> Path:
    out = subprocess.run([sys.executable, str(ROOT / "native" / "build.py"), "--cuda", "--cuda-arch", cuda_arch,
                          "--no-install"], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"native/build.py --cuda --cuda-arch {cuda_arch} failed (exit {out.returncode})")
    return Path(out.stdout.strip().splitlines()[-1])


# llama_cpp opens these by their unversioned names; every other library is found by its soname (.so.0)
LOADED_BY_PATH = ("libllama.so", "libggml.so")


def keep_member(name: str) -> bool:
    """A wheel stores each library three times (libX.so, .so.0, .so.0.25.3: symlinks in the build) and
    again under a top-level lib/ with headers and CMake files: keep the python package's copy that
    the loader asks for."""
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return True
    if top != "llama_cpp":
        return False
    base = Path(name).name
    if "/lib/" not in name or ".so" not in base:
        return True
    version = base.split(".so", 1)[1]
    return base in LOADED_BY_PATH or (version.count(".") == 1 and version[1:].isdigit())


def slim_wheel(wheel: Path, dest: Path) -> Path:
    """The same wheel with one copy of each library (`keep_member`), its ELF libraries stripped (debug
    and symbol tables; the dynamic symbols stay), RECORD redone (pip checks its hashes), deflate 9."""
    members: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as src:
        for info in src.infolist():
            if not keep_member(info.filename):
                continue
            data = src.read(info)
            if ".so" in Path(info.filename).name and data[:4] == b"\x7fELF":
                path = Path(tmp) / "lib.so"
                path.write_bytes(data)
                subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
                data = path.read_bytes()
            members[info.filename] = data
    record_name = next(n for n in members if n.endswith(".dist-info/RECORD"))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for name, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([name, "", ""] if name == record_name else [name, f"sha256={digest}", len(data)])
    members[record_name] = buf.getvalue().encode()
    target = dest / wheel.name
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for name, data in members.items():
            out.writestr(name, data)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, default=None, help="the llama_cpp wheel to carry (default: the CUDA build)")
    parser.add_argument("--cuda-arch", default=GPU_CHECK_CUDA_ARCH,
                        help=f"CUDA architectures of the build to carry (default {GPU_CHECK_CUDA_ARCH!r}: the H200)")
    parser.add_argument("--limit-mib", type=float, default=60.0,
                        help="fail above this many MiB for .whl/ (the device carries 64 MiB with the repo)")
    args = parser.parse_args(argv)

    wheel = args.wheel or built_cuda_wheel(args.cuda_arch)
    if BUNDLE.exists():
        shutil.rmtree(BUNDLE)
    BUNDLE.mkdir()
    slim = slim_wheel(wheel, BUNDLE)
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB -> {slim.stat().st_size / 2**20:.1f} MiB (stripped, deflate 9)")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(BUNDLE),
                    *PY_DEPS], check=True)
    total = sum(p.stat().st_size for p in BUNDLE.iterdir())
    tree = int(subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, stdout=subprocess.PIPE).stdout.count(b"\0"))
    for p in sorted(BUNDLE.iterdir()):
        print(f"  {p.name}  {p.stat().st_size / 2**20:.1f} MiB")
    print(f".whl/ holds {total / 2**20:.1f} MiB (limit {args.limit_mib} MiB; the {tree} tracked files travel too)")
    if total > args.limit_mib * 2**20:
        print("error: too big to carry; build fewer CUDA architectures (native/build.py --cuda-arch 90)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
