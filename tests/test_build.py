"""native/build.py's CUDA options, without compiling: a fake nvcc stands in for the toolkit."""

from __future__ import annotations

import importlib.util
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("dg_native_build", ROOT / "native" / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def fake_toolkit(root: Path, release: str = "13.0", stub: bool = False, cublas: bool = False) -> Path:
    """A toolkit folder whose bin/nvcc answers --version and --dryrun like the real one."""
    (root / "bin").mkdir(parents=True)
    lib = root / "targets" / "x86_64-linux" / "lib"
    inc = root / "targets" / "x86_64-linux" / "include"
    lib.mkdir(parents=True)
    inc.mkdir(parents=True)
    if stub:
        (lib / "stubs").mkdir()
        (lib / "stubs" / "libcuda.so").write_bytes(b"")
    if cublas:
        (lib / "libcublas.so").write_bytes(b"")
        (inc / "cublas_v2.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"""#!/bin/sh
case "$1" in
  --version) echo "Cuda compilation tools, release {release}, V{release}.1";;
  --dryrun) echo "#$ TOP={root}/bin/.." >&2;;
esac
""")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return nvcc


@pytest.fixture
def toolkit(tmp_path, monkeypatch):
    def make(**kw) -> Path:
        nvcc = fake_toolkit(tmp_path / f"cuda-{len(list(tmp_path.iterdir()))}", **kw)
        monkeypatch.setenv("CUDACXX", str(nvcc))
        return nvcc
    monkeypatch.setenv("DG_CACHE_DIR", str(tmp_path / "cache"))
    return make


def test_cuda_options(toolkit):
    nvcc = toolkit()
    args = build.cmake_args_for(build.parse_args(["--cuda"]))
    assert "-DGGML_CUDA=on" in args
    assert f"-DCMAKE_CUDA_COMPILER={nvcc.parent.parent.resolve() / 'bin' / 'nvcc'}" in args
    assert "-DCMAKE_CUDA_ARCHITECTURES=86-real;89-real;90" in args
    assert "-DGGML_NATIVE=OFF" in args  # the wheel travels to another machine's CPU
    assert "-DGGML_CUDA_NO_VMM=ON" in args  # no libcuda.so to link against
    toolkit(stub=True)
    assert "-DGGML_CUDA_NO_VMM=ON" not in build.cmake_args_for(build.parse_args(["--cuda"]))
    custom = build.cmake_args_for(build.parse_args(["--cuda", "--cuda-arch", "90a-real"]))
    assert "-DCMAKE_CUDA_ARCHITECTURES=90a-real" in custom


def test_bad_arch_and_missing_nvcc(toolkit, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        build.parse_args(["--cuda", "--cuda-arch", "sm_90; rm -rf /"])
    monkeypatch.setenv("CUDACXX", str(tmp_path / "nowhere" / "nvcc"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(build, "DEFAULT_NVCC", str(tmp_path / "nowhere" / "nvcc"))
    assert build.main(["--cuda", "--print-key"]) == 1
    assert "nvcc not found" in capsys.readouterr().err


def test_keys(toolkit, monkeypatch):
    cpu = build.cmake_args_for(build.parse_args([]))
    toolkit(release="13.0")
    cuda_13_0 = build.cmake_args_for(build.parse_args(["--cuda"]))
    assert build.build_key(cpu) != build.build_key(cuda_13_0)
    # a portable build does not depend on the CPU it was built on; a native one does
    keys = {}
    for sig in ("a", "b"):
        monkeypatch.setattr(build, "cpu_signature", lambda sig=sig: sig)
        keys[sig] = (build.build_key(cpu), build.build_key(cuda_13_0))
    assert keys["a"][0] != keys["b"][0] and keys["a"][1] == keys["b"][1]
    # a new toolkit is a new wheel
    toolkit(release="13.1")
    cuda_13_1 = build.cmake_args_for(build.parse_args(["--cuda"]))
    assert build.build_key(cuda_13_1) != build.build_key(cuda_13_0)


def test_cublas_from_the_toolkit_or_the_cache(toolkit, tmp_path):
    log = tmp_path / "log"
    toolkit(cublas=True)
    assert build.cublas_cmake_args(log) == []
    toolkit()
    # an unpacked pip cuBLAS in the cache is used without downloading again
    dest = build.cache_root().parent / "cuda-deps" / "cublas-13.0"
    (dest / "lib").mkdir(parents=True)
    (dest / "include").mkdir()
    for name in ("libcublas.so.13", "libcublasLt.so.13"):
        (dest / "lib" / name).write_bytes(b"")
    (dest / "include" / "cublas_v2.h").write_text("")
    (dest / ".complete").touch()
    args = build.cublas_cmake_args(log)
    assert args == [f"-DCUDA_cublas_LIBRARY={dest / 'lib' / 'libcublas.so.13'}",
                    f"-DCUDA_cublasLt_LIBRARY={dest / 'lib' / 'libcublasLt.so.13'}",
                    f"-DCMAKE_CUDA_FLAGS=-I{dest / 'include'}"]
    assert not log.exists()  # nothing was fetched


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has finished; only its parent's wait is missing
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


# A stand-in for pip -> ninja -> nvcc: a shell whose child outlives a signal to the shell alone.
_TREE = "sleep 120 & echo child $!; wait"


def test_interrupted_step_stops_its_compilers(tmp_path):
    seen: list[int] = []

    def interrupt_on_child(line: str) -> None:
        if line.startswith("child "):
            seen.append(int(line.split()[1]))
            raise KeyboardInterrupt  # Ctrl-C while the compile runs

    with pytest.raises(KeyboardInterrupt):
        build.run_logged(["sh", "-c", _TREE], tmp_path / "log", "compile", on_line=interrupt_on_child)
    assert seen, "the stand-in never started its child"
    assert _wait_gone(seen[0]), "the compile's child kept running after the build was interrupted"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Popen(process_group=) needs Python 3.11; before, a new session")
def test_compile_step_runs_in_its_own_group_in_this_session(tmp_path):
    """Its own process group (so that it can be stopped whole), but this session: a new session is a new
    scheduler autogroup on Linux, and `nice native/build.py` would then no longer yield the CPU."""
    ids: list[str] = []
    probe = "import os; print('ids', os.getsid(0), os.getpgid(0), os.getpid(), flush=True)"
    build.run_logged([sys.executable, "-c", probe], tmp_path / "log", "compile", on_line=ids.append)
    [line] = [i for i in ids if i.startswith("ids ")]
    sid, pgid, pid = (int(x) for x in line.split()[1:])
    assert sid == os.getsid(0)
    assert pgid == pid != os.getpgid(0)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
@pytest.mark.subprocess
def test_terminated_build_stops_its_compilers_and_exits_128_plus_signal(tmp_path, signum, code):
    script = tmp_path / "run.py"
    script.write_text(f"""
import importlib.util, signal, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("b", {str(ROOT / "native" / "build.py")!r})
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
for s in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, b.raise_stop)
try:
    b.run_logged(["sh", "-c", {_TREE!r}], Path({str(tmp_path / "log")!r}), "compile",
                 on_line=lambda line: print(line, flush=True))
except b.StopRequested as stop:
    sys.exit(128 + stop.signum)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("child "), line
    child = int(line.split()[1])
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == code
    assert _wait_gone(child), "the compile's child kept running after the build was stopped"


@pytest.mark.parametrize("failure", [KeyboardInterrupt, build.StopRequested])
def test_an_unfinished_wheel_build_leaves_no_partial_folder(tmp_path, monkeypatch, failure):
    """Interrupted, stopped or failed, the compile step leaves no `.KEY.partial` folder behind: they were
    piling up in the wheel cache, one per interrupted key."""
    monkeypatch.setenv("DG_CACHE_DIR", str(tmp_path / "cache"))

    def compile_step(cmd, log, step, **kwargs):
        out_dir = Path(cmd[cmd.index("-w") + 1])
        assert out_dir.is_dir() and out_dir.name.endswith(".partial")
        raise failure(signal.SIGTERM) if failure is build.StopRequested else failure()

    monkeypatch.setattr(build, "run_logged", compile_step)
    with pytest.raises(failure):
        build.build_wheel(tmp_path / "src", ["-DGGML_NATIVE=on"], "k" * 20, tmp_path / "log", 1)
    wheels = build.cache_root() / "wheels"
    assert wheels.is_dir() and not list(wheels.iterdir())
    # no wheel made: a build error, and nothing left either
    monkeypatch.setattr(build, "run_logged", lambda *a, **k: None)
    with pytest.raises(build.BuildError, match="produced no wheel"):
        build.build_wheel(tmp_path / "src", ["-DGGML_NATIVE=on"], "k" * 20, tmp_path / "log", 1)
    assert not list(wheels.iterdir())


def test_piped_messages_stay_one_line(tmp_path, monkeypatch, capsys):
    """Piped (make demo in a CI log), "dg native: installed (key ..., log PATH)" was wrapped by Rich at 80
    columns, cutting the log's path in two; an error's text is printed as text, one line too."""
    cache = tmp_path / ("a-long-cache-folder-name-" * 3)
    monkeypatch.setenv("DG_CACHE_DIR", str(cache))
    monkeypatch.setattr(build, "fetch_sdist", lambda log: tmp_path / "sdist")
    monkeypatch.setattr(build, "extract_pristine", lambda sdist: tmp_path / "pristine")
    monkeypatch.setattr(build, "prepare_source", lambda pristine, log: (tmp_path / "src", 0))
    monkeypatch.setattr(build, "ensure_build_deps", lambda log: None)
    monkeypatch.setattr(build, "build_wheel", lambda *a, **k: tmp_path / "x.whl")
    monkeypatch.setattr(build, "install_wheel", lambda *a, **k: None)
    args = build.parse_args([])
    assert build.build_and_install(args, [], "k" * 20) == 0
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if ln.startswith("dg native: installed")]
    assert line.endswith(".log)") and str(build.cache_root() / "logs") in line

    def fail(*a, **k):
        raise build.BuildError("compile", "[/x] in " + str(cache), tmp_path / "build.log")
    monkeypatch.setattr(build, "build_wheel", fail)
    assert build.build_and_install(args, [], "k" * 20) == 1
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert line == f"error: native build failed at step 'compile': [/x] in {cache} (full log: {tmp_path / 'build.log'})"
