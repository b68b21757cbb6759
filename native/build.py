#!/usr/bin/env python3
"""Build llama-cpp-python with our diffusion-gemma patch and install it into this environment.

    python native/build.py              # CPU (default)
    python native/build.py --cuda       # -DGGML_CUDA=on for sm_86, sm_89, sm_90 (+ PTX); see CUDA_ARCHITECTURES
    python native/build.py --cuda --no-install   # build (or find) the cached wheel, print its path
    python native/build.py --metal      # macOS: the same as no option (every Mac build has Metal)
    python native/build.py --cmake-arg -DGGML_AVX512=off   # any other llama.cpp CMake option

Steps: fetch the pinned sdist from the package registry (once; sha256 checked every time), lay our
patch over a persistent copy of its source (new files copied in, `llama.cpp.diff` applied to
pristine copies; only changed files are touched so CMake rebuilds only what changed), build a wheel
with a persistent CMake build folder, install it. Everything lives under ~/.cache/dg/native (or
$DG_CACHE_DIR/native), keyed by sdist + patch + options: an unchanged tree does not rebuild, and a
wheel already built for the same key is reinstalled without compiling.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections import deque
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

# mtmd (llava) is not needed by dg and costs a third of the build time. ggml's RPC backend is what
# `dg worker` and `--rpc` use to spread a model over machines (two small sources).
BASE_CMAKE_ARGS = ["-DLLAVA_BUILD=OFF", "-DGGML_RPC=ON"]
BUILD_DEPS = {"scikit_build_core": "scikit-build-core>=0.9.2", "cmake": "cmake>=3.21", "ninja": "ninja"}

# The CUDA architectures a --cuda wheel carries machine code for (each one is a full compile of
# ggml-cuda, so fewer = a shorter build):
#   86-real  Ampere consumer and workstation cards (RTX 30xx, A10, A40); its code also runs on 8.9
#   89-real  Ada (RTX 40xx, L4, L40): the 8-16 GB cards partial offload is for, and the L4 of the
#            published per-step numbers
#   90       Hopper H100/H200 machine code, plus compute_90 PTX: newer cards (Blackwell sm_100/
#            sm_120) compile that PTX at first load (minutes, cached by the driver afterwards)
# Older cards (A100 sm_80, T4 sm_75) need their own: --cuda-arch "80-real;86-real;89-real;90".
CUDA_ARCHITECTURES = "86-real;89-real;90"
# cuBLAS headers and libraries when the CUDA toolkit lacks them (an nvcc-only install): NVIDIA's pip
# package of the same major.minor version as nvcc.
CUBLAS_PIP = {12: "nvidia-cublas-cu12", 13: "nvidia-cublas"}
DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"  # NVIDIA's installers' location, when nvcc is not on PATH

NATIVE_DIR = Path(__file__).resolve().parent
PATCH_DIR = NATIVE_DIR / "patch"
PATCH_DIFF = PATCH_DIR / "llama.cpp.diff"
INSTALLED_KEY_FILE = ".dg-build-key"


class BuildError(Exception):
    """A failed step: the message names the step; `log` points at the full output."""

    def __init__(self, step: str, reason: str, log: Path | None = None):
        self.step, self.reason, self.log = step, reason, log
        where = f" (full log: {log})" if log else ""
        super().__init__(f"native build failed at step '{step}': {reason}{where}")


def cache_root() -> Path:
    base = os.environ.get("DG_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "dg") / "native"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def patch_files() -> list[Path]:
    """Every file of our patch, in a stable order (the diff and the new sources)."""
    return sorted(p for p in PATCH_DIR.rglob("*") if p.is_file())


def new_source_files() -> dict[str, Path]:
    """New files of ours, keyed by their path inside vendor/llama.cpp."""
    out = {}
    for sub in ("src", "include"):
        root = PATCH_DIR / sub
        for path in sorted(root.rglob("*")) if root.exists() else []:
            if path.is_file():
                out[str(Path(sub) / path.relative_to(root))] = path
    return out


def command_output(cmd: list[str]) -> str:
    """What `cmd` prints, stripped; "" when it cannot run."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def cpu_signature() -> str:
    # GGML_NATIVE compiles for this CPU, so a wheel must not be reused on a different one.
    if sys.platform == "darwin":
        # platform.processor() is "arm" on every Apple Silicon chip: the chip's name and its
        # hw.optional features (the FEAT_* flags GGML_NATIVE's -mcpu=native follows) tell them apart
        chip = command_output(["sysctl", "-n", "machdep.cpu.brand_string"]) + "\n" + command_output(["sysctl", "hw.optional"])
        if chip.strip():
            return hashlib.sha256(chip.encode()).hexdigest()[:16]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") or line.startswith("Features"):
                return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or "unknown"


def portable_cpu(cmake_args: list[str]) -> bool:
    return any(a.upper().replace("=0", "=OFF") == "-DGGML_NATIVE=OFF" for a in cmake_args)


def apple_toolchain() -> str:
    """On macOS, the SDK and the compiler the build uses: ggml-metal's shaders are compiled with them
    and embedded in the library, so a new Xcode or SDK is a new wheel. "" elsewhere."""
    if sys.platform != "darwin":
        return ""
    cc = command_output(["cc", "--version"]).splitlines()
    return " ".join(filter(None, (command_output(["xcrun", "--show-sdk-version"]),
                                  command_output(["xcrun", "--show-sdk-build-version"]), cc[0] if cc else "")))


def build_key(cmake_args: list[str]) -> str:
    digest = hashlib.sha256()
    # A portable build (GGML_NATIVE=OFF) runs on any x86-64-v3 CPU: the CPU it was built on is no part of it.
    cpu = "portable" if portable_cpu(cmake_args) else cpu_signature()
    compilers = " ".join(filter(None, (compiler_versions(cmake_args), apple_toolchain())))
    for part in (SDIST_SHA256, " ".join(cmake_args), sys.implementation.cache_tag, platform.machine(),
                 platform.system(), cpu, *([compilers] if compilers else [])):
        digest.update(part.encode() + b"\0")
    for path in patch_files():
        digest.update(str(path.relative_to(PATCH_DIR)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def compiler_versions(cmake_args: list[str]) -> str:
    """The version banner of each compiler named in the options (a new CUDA toolkit = a new wheel)."""
    out = []
    for arg in cmake_args:
        if arg.startswith("-DCMAKE_CUDA_COMPILER="):
            try:
                out.append(subprocess.run([arg.split("=", 1)[1], "--version"], capture_output=True, text=True,
                                          timeout=60).stdout.strip().splitlines()[-1])
            except (OSError, IndexError, subprocess.TimeoutExpired):
                out.append("unknown")
    return " ".join(out)


def options_key(cmake_args: list[str]) -> str:
    # The CMake build folder is shared by every patch version with the same options, so that an
    # edit to our sources recompiles only the edited files.
    return hashlib.sha256((SDIST_SHA256 + " ".join(cmake_args)).encode()).hexdigest()[:12]


def run_logged(cmd: list[str], log: Path, step: str, env: dict | None = None, cwd: Path | None = None,
               on_line=None) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        # Its own process group, so that stopping the build stops ninja and every compiler under it:
        # a compiler left running would write into the build folder after the lock is released.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=cwd, bufsize=1, **own_process_group())
        tail: deque[str] = deque(maxlen=25)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                tail.append(line.rstrip())
                if on_line:
                    on_line(line.rstrip())
            code = proc.wait()
        finally:
            stop_process_group(proc)
    if code != 0:
        last = next((t for t in reversed(tail) if "error" in t.lower()), tail[-1] if tail else "")
        raise BuildError(step, f"`{cmd[0]} {cmd[1] if len(cmd) > 1 else ''}` exited {code}: {last.strip()[:200]}", log)


def own_process_group() -> dict:
    """Popen arguments for a new process group in this session. A new session (the only way before
    Python 3.11) would also be a new scheduler autogroup on Linux, where `nice` on the build no longer
    leaves the CPU to the user's other work."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}


def stop_process_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End whatever is left of the group `proc` leads: TERM, then KILL after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                proc.poll()
                return
            proc.poll()  # reap the leader, or the group never empties
            time.sleep(0.05)


class StopRequested(BaseException):
    """SIGTERM or SIGHUP: unwind like Ctrl-C (stopping the compilers), then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_stop(signum: int, _frame) -> None:
    raise StopRequested(signum)


# -- steps ---------------------------------------------------------------------------------------


def fetch_sdist(log: Path) -> Path:
    sdist_dir = cache_root().parent / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    sdist = sdist_dir / SDIST_FILE
    if not sdist.exists():
        with tempfile.TemporaryDirectory(dir=sdist_dir) as tmp:
            run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_NAME,
                        f"{SDIST_NAME}=={SDIST_VERSION}", "-d", tmp], log, "fetch sdist")
            downloaded = Path(tmp) / SDIST_FILE
            if not downloaded.exists():
                raise BuildError("fetch sdist", f"pip did not produce {SDIST_FILE}", log)
            downloaded.replace(sdist)
    actual = sha256_file(sdist)
    if actual != SDIST_SHA256:
        bad = sdist.with_suffix(".mismatch")
        sdist.replace(bad)
        raise BuildError("verify sdist", f"sha256 {actual} != pinned {SDIST_SHA256} (moved aside to {bad})")
    return sdist


def extract_pristine(sdist: Path) -> Path:
    """The untouched sdist source, extracted once per sdist."""
    pristine = cache_root() / f"pristine-{SDIST_SHA256[:12]}"
    top = pristine / f"llama_cpp_python-{SDIST_VERSION}"
    if not (pristine / ".complete").exists():
        shutil.rmtree(pristine, ignore_errors=True)
        pristine.mkdir(parents=True)
        with tarfile.open(sdist) as tar:
            # the archive's sha256 is pinned; the "data" filter where this Python has it (3.10.12+)
            tar.extractall(pristine, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        (pristine / ".complete").touch()
    return top


def write_if_changed(dst: Path, data: bytes) -> bool:
    if dst.exists() and dst.read_bytes() == data:
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".dgtmp")
    tmp.write_bytes(data)
    tmp.replace(dst)
    return True


def files_in_diff(diff_text: str) -> list[str]:
    names = []
    for line in diff_text.splitlines():
        if line.startswith("+++ "):
            name = line[4:].split("\t")[0].strip()
            if name != "/dev/null":
                names.append(name.split("/", 1)[1] if name.startswith(("a/", "b/")) else name)
    return names


def patched_contents(pristine_llama: Path, log: Path) -> dict[str, bytes]:
    """Path inside vendor/llama.cpp -> content after our patch, for every file the patch touches."""
    contents = {rel: path.read_bytes() for rel, path in new_source_files().items()}
    if PATCH_DIFF.exists() and PATCH_DIFF.stat().st_size:
        diff_text = PATCH_DIFF.read_text()
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(tmp)
            for rel in files_in_diff(diff_text):
                src = pristine_llama / rel
                if src.exists():
                    (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, scratch / rel)
            # options GNU patch and the BSD patch of macOS both take (-t batch, -N forward); a
            # backup either may leave lies in this scratch folder, which only the patched files leave
            run_logged(["patch", "-p1", "-t", "-N", "-i", str(PATCH_DIFF)], log, "apply patch", cwd=scratch)
            for rel in files_in_diff(diff_text):
                contents[rel] = (scratch / rel).read_bytes()
    return contents


def prepare_source(pristine_top: Path, log: Path) -> tuple[Path, int]:
    """A persistent patched copy of the sdist. Returns (source dir, number of files rewritten)."""
    work_top = cache_root() / f"src-{SDIST_SHA256[:12]}"
    if not (work_top / ".complete").exists():
        shutil.rmtree(work_top, ignore_errors=True)
        shutil.copytree(pristine_top, work_top, symlinks=True)
        (work_top / ".complete").touch()
    vendor = "vendor/llama.cpp"
    wanted = patched_contents(pristine_top / vendor, log)
    manifest_path = work_top / ".dg-patched.json"
    previous = set(json.loads(manifest_path.read_text())) if manifest_path.exists() else set()
    changed = 0
    # Files the previous patch touched but this one does not go back to pristine (or away).
    for rel in sorted(previous - set(wanted)):
        original = pristine_top / vendor / rel
        target = work_top / vendor / rel
        if original.exists():
            changed += write_if_changed(target, original.read_bytes())
        elif target.exists():
            target.unlink()
            changed += 1
    for rel, data in wanted.items():
        changed += write_if_changed(work_top / vendor / rel, data)
    manifest_path.write_text(json.dumps(sorted(wanted)))
    return work_top, changed


def ensure_build_deps(log: Path) -> None:
    missing = []
    for module, requirement in BUILD_DEPS.items():
        try:
            __import__(module)
        except ImportError:
            missing.append(requirement)
    if missing:
        run_logged([sys.executable, "-m", "pip", "install", "-q", *missing], log, "install build tools")


# -- CUDA toolkit -------------------------------------------------------------------------------------


class CudaToolkit:
    """The nvcc a --cuda build compiles with, and what its toolkit holds."""

    def __init__(self, nvcc: Path, root: Path, version: tuple[int, int]):
        self.nvcc, self.root, self.version = nvcc, root, version
        self.lib_dirs = [d for d in (root / "targets" / f"{platform.machine()}-linux" / "lib", root / "lib64",
                                     root / "lib") if d.is_dir()]
        self.include_dirs = [d for d in (root / "targets" / f"{platform.machine()}-linux" / "include",
                                         root / "include") if d.is_dir()]

    def has_library(self, name: str, extra_dirs: tuple[str, ...] = ()) -> bool:
        dirs = [*self.lib_dirs, *(d / "stubs" for d in self.lib_dirs), *map(Path, extra_dirs)]
        return any((d / f"lib{name}.so").exists() for d in dirs)

    def has_cublas(self) -> bool:
        return self.has_library("cublas") and any((d / "cublas_v2.h").exists() for d in self.include_dirs)

    def has_driver_stub(self) -> bool:
        # ggml's VMM pool links libcuda.so (the toolkit's stub, or a driver's development link).
        return self.has_library("cuda", ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/wsl/lib"))


def find_cuda_toolkit() -> CudaToolkit:
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc"),
                  *(str(Path(os.environ[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)),
                  DEFAULT_NVCC]
    nvcc = next((Path(c) for c in candidates if c and Path(c).is_file()), None)
    if nvcc is None:
        raise BuildError("cuda toolkit", "nvcc not found (install the CUDA toolkit, or set CUDACXX / CUDA_HOME)")
    try:
        version_text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
        # the toolkit's root as nvcc itself sees it (nvcc on PATH may be a wrapper script)
        dry = subprocess.run([str(nvcc), "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BuildError("cuda toolkit", f"cannot run {nvcc}: {err}") from None
    version = re.search(r"release (\d+)\.(\d+)", version_text)
    top = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    if not version or not top:
        raise BuildError("cuda toolkit", f"cannot read the version and location of {nvcc}")
    root = Path(top.group(1).strip()).resolve()
    real_nvcc = root / "bin" / "nvcc"
    return CudaToolkit(real_nvcc if real_nvcc.is_file() else nvcc, root, (int(version[1]), int(version[2])))


def cuda_cmake_args(architectures: str) -> list[str]:
    toolkit = find_cuda_toolkit()
    args = ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_COMPILER={toolkit.nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={architectures}",
            # the wheel is meant to travel (to the GPU machine): x86-64-v3 CPU code, not this CPU's
            "-DGGML_NATIVE=OFF",
            # one GPU; NCCL would be one more runtime library to find
            "-DGGML_CUDA_NCCL=OFF"]
    if not toolkit.has_driver_stub():
        # Without libcuda.so to link, ggml uses its cudaMalloc pool instead of the VMM one.
        args.append("-DGGML_CUDA_NO_VMM=ON")
    return args


def cublas_cmake_args(log: Path) -> list[str]:
    """cuBLAS for the link when the toolkit lacks it: NVIDIA's pip wheel for nvcc's version, unpacked
    once into the cache. The installed libraries keep an RPATH to that folder, so they load here; on
    another machine cuBLAS must be on the library path (the pip package's lib folder)."""
    toolkit = find_cuda_toolkit()
    if toolkit.has_cublas():
        return []
    major, minor = toolkit.version
    if major not in CUBLAS_PIP:
        raise BuildError("cuBLAS", f"the CUDA {major}.{minor} toolkit has no cuBLAS and dg knows no pip package for it")
    requirement = f"{CUBLAS_PIP[major]}=={major}.{minor}.*"
    dest = cache_root().parent / "cuda-deps" / f"cublas-{major}.{minor}"
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
            run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp,
                        requirement], log, "fetch cuBLAS")
            wheels = list(Path(tmp).glob("*.whl"))
            if not wheels:
                raise BuildError("fetch cuBLAS", f"pip did not produce a wheel for {requirement}", log)
            with zipfile.ZipFile(wheels[0]) as wheel:
                for member in wheel.infolist():
                    parts = Path(member.filename).parts
                    # nvidia/cu13/{include,lib}/... (CUDA 13) or nvidia/cublas/{include,lib}/... (CUDA 12)
                    if len(parts) == 4 and parts[0] == "nvidia" and parts[2] in ("include", "lib"):
                        target = dest / parts[2] / parts[3]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with wheel.open(member) as src, open(target, "wb") as out:
                            shutil.copyfileobj(src, out, 1 << 20)
        (dest / ".complete").touch()
    libs = {name: sorted((dest / "lib").glob(f"lib{name}.so.*")) for name in ("cublas", "cublasLt")}
    if not all(libs.values()) or not (dest / "include" / "cublas_v2.h").exists():
        raise BuildError("fetch cuBLAS", f"{requirement} lacks libcublas / libcublasLt / cublas_v2.h ({dest})", log)
    return [f"-DCUDA_cublas_LIBRARY={libs['cublas'][0]}", f"-DCUDA_cublasLt_LIBRARY={libs['cublasLt'][0]}",
            f"-DCMAKE_CUDA_FLAGS=-I{dest / 'include'}"]


def build_wheel(source: Path, cmake_args: list[str], key: str, log: Path, jobs: int, on_line=None) -> Path:
    wheel_dir = cache_root() / "wheels" / key
    existing = sorted(wheel_dir.glob("*.whl")) if wheel_dir.exists() else []
    if existing:
        return existing[0]
    build_dir = cache_root() / f"build-{options_key(cmake_args)}"
    tmp_dir = cache_root() / "wheels" / f".{key}.partial"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    env = dict(os.environ)
    # where the toolchain's libraries are is no part of the key (the key names the toolkit's version)
    toolchain = cublas_cmake_args(log) if "-DGGML_CUDA=on" in cmake_args else []
    env["CMAKE_ARGS"] = shlex.join(cmake_args + toolchain)
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(jobs)
    try:
        run_logged([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_dir),
                    "-C", f"build-dir={build_dir}", "-v", str(source)], log, "compile", env=env, on_line=on_line)
        wheels = sorted(tmp_dir.glob("*.whl"))
        if not wheels:
            raise BuildError("compile", "pip wheel produced no wheel", log)
    except BaseException:  # failed, interrupted or stopped: no empty .partial folder left in the cache
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    # Only a finished wheel gets the key's name, so an interrupted build is never reused.
    shutil.rmtree(wheel_dir, ignore_errors=True)
    tmp_dir.replace(wheel_dir)
    return wheel_dir / wheels[0].name


def installed_key() -> str | None:
    spec = _llama_cpp_dir()
    marker = spec / INSTALLED_KEY_FILE if spec else None
    return marker.read_text().strip() if marker and marker.exists() else None


def _llama_cpp_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def install_wheel(wheel: Path, key: str, log: Path) -> None:
    run_logged([sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", str(wheel)], log,
               "install")
    # llama-cpp-python's own runtime needs (numpy, jinja2, ...) without touching anything else.
    run_logged([sys.executable, "-m", "pip", "install", "-q", "typing-extensions>=4.5.0", "numpy>=1.20.0",
                "diskcache>=5.6.1", "jinja2>=2.11.3"], log, "install")
    target = _llama_cpp_dir()
    if target is None:
        raise BuildError("install", "llama_cpp is not importable after installing the wheel", log)
    (target / INSTALLED_KEY_FILE).write_text(key + "\n")


# -- command line ---------------------------------------------------------------------------------


@contextlib.contextmanager
def exclusive_build_lock():
    """One build at a time per cache: two builds of the same key would share (and wipe) one folder."""
    lock_path = cache_root() / "build.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("dg native: another build is running; waiting for it to finish", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    backend = parser.add_mutually_exclusive_group()
    backend.add_argument("--cuda", action="store_true", help="build the CUDA backend (-DGGML_CUDA=on)")
    parser.add_argument("--cuda-arch", default=CUDA_ARCHITECTURES, metavar="ARCHS",
                        help=f"CMAKE_CUDA_ARCHITECTURES for --cuda (default {CUDA_ARCHITECTURES!r})")
    backend.add_argument("--metal", action="store_true",
                         help="the Metal backend (macOS only; every macOS build has it: the sdist turns it on)")
    parser.add_argument("--cmake-arg", action="append", default=[], metavar="ARG",
                        help="extra llama.cpp CMake option, e.g. -DGGML_NATIVE=off (repeatable)")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 2, 8), help="parallel compile jobs")
    parser.add_argument("--force", action="store_true", help="rebuild the wheel even if one is cached")
    parser.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    parser.add_argument("--no-install", action="store_true",
                        help="only build (or find) the cached wheel and print its path, e.g. to carry it elsewhere")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"(native|all|all-major|\d+[af]?(-real|-virtual)?(;\d+[af]?(-real|-virtual)?)*)", args.cuda_arch):
        parser.error(f"--cuda-arch {args.cuda_arch!r}: expected CMake CUDA architectures such as '86-real;90'")
    return args


def cmake_args_for(args: argparse.Namespace) -> list[str]:
    cmake_args = list(BASE_CMAKE_ARGS)
    if args.cuda:
        cmake_args.extend(cuda_cmake_args(args.cuda_arch))
    if args.metal and sys.platform != "darwin":
        raise BuildError("options", "--metal builds ggml-metal, which needs macOS (Apple's Metal framework and SDK)")
    # On macOS nothing to add: llama-cpp-python's CMakeLists forces GGML_METAL=ON on Apple whatever
    # the options say, so an option here would only key a second cache entry for the same build.
    cmake_args.extend(args.cmake_arg)
    return cmake_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cmake_args = cmake_args_for(args)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    key = build_key(cmake_args)
    if args.print_key:
        print(key)
        return 0
    up_to_date = not args.force and not args.no_install and installed_key() == key
    if up_to_date:
        print(f"dg native: up to date (key {key})")
        return 0
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, raise_stop)
    with exclusive_build_lock():
        # The build we waited for may have installed exactly this key.
        if not args.force and not args.no_install and installed_key() == key:
            print(f"dg native: up to date (key {key})")
            return 0
        return build_and_install(args, cmake_args, key)


def build_and_install(args: argparse.Namespace, cmake_args: list[str], key: str) -> int:

    from rich.console import Console
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    # piped (make demo in a CI log), each message stays one line: the log's path is not cut at 80 columns
    wrap = {"soft_wrap": not console.is_terminal}
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "logs" / f"build-{key}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            def step(description: str):
                return progress.add_task(description, total=1)

            t = step(f"sdist {SDIST_NAME} {SDIST_VERSION} (sha256 pinned)")
            sdist = fetch_sdist(log)
            pristine = extract_pristine(sdist)
            progress.update(t, completed=1)

            t = step("applying the diffusion-gemma patch")
            source, changed = prepare_source(pristine, log)
            # the count is of files rewritten in the cached source tree since its last build, not the patch's size
            progress.update(t, completed=1, description="applied the diffusion-gemma patch (" + (
                f"cached source: {changed} files updated" if changed else "cached source already patched") + ")")

            t = step("build tools")
            ensure_build_deps(log)
            progress.update(t, completed=1)

            wheel_dir = root / "wheels" / key
            cached = wheel_dir.exists() and any(wheel_dir.glob("*.whl")) and not args.force
            if args.force:
                shutil.rmtree(wheel_dir, ignore_errors=True)
            t = step("compiling llama.cpp" + (" (cached wheel)" if cached else f" -j{args.jobs}"))

            def show(line: str) -> None:
                if line.startswith("[") and "]" in line[:12]:
                    progress.update(t, description=f"compiling llama.cpp {line[:90]}")

            wheel = build_wheel(source, cmake_args, key, log, args.jobs, on_line=show)
            progress.update(t, completed=1, description=f"built {wheel.name}" + (" (cached)" if cached else ""))

            if args.no_install:
                print(wheel)
                return 0
            t = step("installing into " + sys.prefix)
            install_wheel(wheel, key, log)
            progress.update(t, completed=1)
    except BuildError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}", **wrap)
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]: nothing was installed; the next run resumes the build", **wrap)
        return 130
    except StopRequested as stop:
        console.print(f"[yellow]stopped by {signal.Signals(stop.signum).name}[/yellow]: nothing was installed; "
                      "the next run resumes the build", **wrap)
        return 128 + stop.signum
    console.print(f"dg native: installed (key {key}, {time.monotonic() - started:.0f} s; log {log})",
                  markup=False, **wrap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
