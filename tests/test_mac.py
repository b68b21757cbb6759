"""dg's Python side the way it runs on a Mac, wherever it branches on the platform: library names
(.dylib), no /proc, resource limits the kernel does not enforce (RLIMIT_AS), BSD patch, threads on the
performance cores, macOS's own Python 3.9, Metal's memory (shared with the CPU). No Mac here: the
platform is what these tests say it is (sys.platform, sysctl values, a BSD-like patch on PATH)."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from native_helpers import requires_native

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("dg_native_build_mac", ROOT / "native" / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


# -- libraries: .dylib ------------------------------------------------------------------------------------


def test_library_names_follow_the_platform(monkeypatch):
    from dgcli.runtime import native

    monkeypatch.setattr(sys, "platform", "darwin")
    # the install name first: what libllama.dylib links (@rpath/libggml.0.dylib)
    assert native.library_names("ggml") == ["libggml.0.dylib", "libggml.dylib"]
    monkeypatch.setattr(sys, "platform", "linux")
    assert native.library_names("ggml-cpu") == ["libggml-cpu.so.0", "libggml-cpu.so"]


class _FakeLlama:
    """libllama as ctypes shows it, without the symbol looked up (dladdr cannot say where it is)."""

    def __init__(self, folder: Path):
        self._name = str(folder / "libllama.dylib")

    def __getattr__(self, name):
        raise AttributeError(name)


def test_a_mac_wheel_s_ggml_is_found_by_its_mac_name(tmp_path, monkeypatch):
    """macOS wheels hold libggml.0.dylib and libggml.dylib (no .so): before, every model load and
    `dg info` raised NativeUnavailable looking for libggml.so."""
    from dgcli.runtime import native

    monkeypatch.setattr(sys, "platform", "darwin")
    for name in ("libllama.dylib", "libggml.dylib", "libggml.0.dylib", "libggml-base.dylib"):
        (tmp_path / name).write_bytes(b"")
    llama = _FakeLlama(tmp_path)
    assert native.loaded_library("ggml", "ggml_backend_dev_count", llama) == str(tmp_path / "libggml.0.dylib")
    assert native.loaded_library("ggml-base", "ggml_set_abort_callback", llama) == str(tmp_path / "libggml-base.dylib")


@requires_native
def test_ggml_is_the_copy_libllama_loaded():
    """Found through libllama and dladdr (no /proc/self/maps): the file the process already mapped,
    not a second copy of it with its own backend registry."""
    from dgcli.runtime import native

    llama = native.lib()._lib
    for stem, symbol in (("ggml", "ggml_backend_dev_count"), ("ggml-base", "ggml_set_abort_callback"),
                         ("ggml-base", "ggml_backend_cpu_buffer_type")):
        path = native.loaded_library(stem, symbol)
        assert Path(path).name.startswith(f"lib{stem}.")
        # the same function at the same address: the library libllama links, not another file
        assert (ctypes.cast(getattr(ctypes.CDLL(path), symbol), ctypes.c_void_p).value
                == ctypes.cast(getattr(llama, symbol), ctypes.c_void_p).value)


# -- threads: the performance cores --------------------------------------------------------------------------


def test_a_mac_computes_on_its_performance_cores(monkeypatch, tmp_path):
    from dgcli.runtime import cpu

    sysctl = {"hw.perflevel0.physicalcpu": 8, "hw.physicalcpu": 12}  # an M3 Pro: 8 performance + 4 efficiency
    monkeypatch.setattr(cpu, "sysctl_int", lambda name: sysctl.get(name))
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cpu.compute_threads() == 8
    big = tmp_path / "big.gguf"
    with open(big, "wb") as f:
        f.truncate(cpu.SINGLE_THREAD_BELOW_BYTES)
    assert cpu.default_threads(big) == 8
    del sysctl["hw.perflevel0.physicalcpu"]  # an Intel Mac: no performance levels
    assert cpu.compute_threads() == 12
    sysctl.clear()
    monkeypatch.setattr(os, "cpu_count", lambda: 10)
    assert cpu.compute_threads() == 10
    monkeypatch.setattr(sys, "platform", "linux")  # Linux: every logical CPU, whatever sysctl says
    sysctl["hw.perflevel0.physicalcpu"] = 4
    assert cpu.compute_threads() == 10


def test_sysctl_is_none_where_there_is_none():
    from dgcli.runtime import cpu

    if sys.platform.startswith("linux"):
        assert cpu.sysctl_int("hw.perflevel0.physicalcpu") is None
    else:
        assert cpu.sysctl_int("no.such.sysctl") is None


# -- chat templates: RLIMIT_AS is not enforced ---------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def mac_renderer(monkeypatch):
    """The template renderer as on a Mac: started afresh, the child without an address-space limit."""
    import psutil  # noqa: F401 - its platform module is chosen at import: this machine's own

    from dgcli.templates import sandbox as template_sandbox

    template_sandbox._close_worker()
    template_sandbox._renders.clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    yield template_sandbox
    template_sandbox._close_worker()
    template_sandbox._renders.clear()


@requires_native
def test_chat_templates_render_on_a_mac(mac_renderer, tiny_vocab_obj):
    """No /proc/self/status to read: before, the child died at its start and every render (generate
    without --raw, chat, serve) failed on a Mac."""
    import psutil

    text = mac_renderer.render_chat_template(tiny_vocab_obj.chat_template, messages=MESSAGES, bos_token="<bos>",
                                             eos_token="<eos>")
    assert text == tiny_vocab_obj.render_chat("hi")
    worker = mac_renderer._worker
    assert not worker.limited and worker.watched is not None
    if sys.platform.startswith("linux"):  # the child really runs without the limit it would set on Linux
        assert psutil.Process(worker.proc.pid).rlimit(psutil.RLIMIT_AS)[0] == psutil.RLIM_INFINITY


@requires_native
def test_a_mac_stops_a_template_that_takes_too_much_memory(mac_renderer, monkeypatch):
    """Where RLIMIT_AS does nothing, the parent watches the child's address space and kills it past
    the bound (here 256 MiB; the template asks for ~600 MB in one string)."""
    monkeypatch.setattr(mac_renderer, "TEMPLATE_MEMORY_BYTES", 256 << 20)
    with pytest.raises(mac_renderer.ChatTemplateError, match=r"needed more than 256 MB of memory \(stopped\)"):
        mac_renderer.render_chat_template("{% set s = 'x' * 600000000 %}{{ s|length }}", messages=MESSAGES,
                                          source="x.gguf", timeout_s=30)
    assert mac_renderer._worker is None  # killed, not answered: the next render starts a new child
    assert mac_renderer.render_chat_template("{{ messages[0]['content'] }}", messages=MESSAGES) == "hi"


# -- dg itself, with no /proc and sys.platform "darwin" --------------------------------------------------------

_MAC_LIKE_RUN = textwrap.dedent(r"""
    import os, sys, sysconfig
    sysconfig.get_config_vars()    # read once, by this machine's name for itself
    import psutil                  # its platform module is chosen at import: this machine's own
    import llama_cpp.llama_cpp     # the wheel's libraries, loaded by the names this machine gives them
    from dgcli import cli
    from dgcli.templates import sandbox as template_sandbox

    def psutil_reads(frame):  # psutil's Linux module reads /proc; on a Mac its macOS module asks the kernel
        while frame is not None:
            if frame.f_globals.get("__name__", "").startswith("psutil"):
                return True
            frame = frame.f_back
        return False

    def no_proc(event, args):
        if (event == "open" and args and isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).startswith("/proc")
                and not psutil_reads(sys._getframe(1))):
            raise FileNotFoundError(2, "No such file or directory (a Mac has no /proc)", args[0])

    sys.addaudithook(no_proc)
    sys.platform = "darwin"
    sys.argv[0] = "dg"
    try:
        cli.main()
    finally:
        worker = template_sandbox._worker
        print(f"renderer limited={worker.limited} watched={worker.watched is not None}" if worker else "no renderer",
              file=sys.stderr)
""")


@requires_native
@pytest.mark.subprocess
def test_dg_generate_runs_as_on_a_mac(tmp_path):
    """`dg generate` on the demo model (the chat template included) with every open of /proc failing
    and sys.platform "darwin": the answer is the one a Linux run gives."""
    args = ["generate", "reverse: HELLO", "--seed", "3", "--json", "--no-live"]
    plain = subprocess.run([sys.executable, "-m", "dgcli.cli", *args], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    mac = subprocess.run([sys.executable, "-c", _MAC_LIKE_RUN, *args], capture_output=True, text=True, timeout=300)
    assert mac.returncode == 0, mac.stderr
    assert "renderer limited=False watched=True" in mac.stderr
    assert json.loads(mac.stdout)["result"]["token_ids"] == json.loads(plain.stdout)["result"]["token_ids"]


# -- memory: Metal's is the system's ------------------------------------------------------------------------


def test_a_mac_s_gpu_memory_is_counted_as_ram_too(tmp_path, monkeypatch):
    """Apple's GPU shares the system's memory: a RAM fit counts what the GPU holds, and the step's
    Metal scratch (TOP_K, CUMSUM) is in the GPU's need."""
    from dgcli.modelfile import info
    from dgcli.runtime import native
    from dgcli.testing.tiny import write_tiny_random_gguf

    path = write_tiny_random_gguf(tmp_path / "diff.gguf", seed=2)
    cuda = [info.GpuMemory("CUDA0", 64 << 30, 64 << 30)]
    metal = [info.GpuMemory("MTL0", 64 << 30, 64 << 30, metal=True)]
    on_cuda, on_metal = info.read_info(path, n_gpu_layers=-1, gpus=cuda), info.read_info(path, n_gpu_layers=-1, gpus=metal)
    canvas = on_cuda.canvas_length
    assert on_metal.gpu_needed - on_cuda.gpu_needed == info.metal_step_scratch_bytes(on_cuda.vocab_size, canvas)
    assert on_metal.memory_needed == on_cuda.memory_needed + on_metal.gpu_needed
    VM = type("VM", (), {"total": on_metal.memory_needed - 1, "available": 0})
    monkeypatch.setattr("psutil.virtual_memory", lambda: VM)
    info.check_fits_memory(path, n_gpu_layers=-1, gpus=cuda)  # RAM holds only what the CUDA GPU does not
    with pytest.raises(info.TooBigForMemory, match=r"use a smaller quant \(a Mac's GPU memory is its RAM"):
        info.check_fits_memory(path, n_gpu_layers=-1, gpus=metal)
    # detected through llama.cpp: a device of ggml-metal's registry is a Metal one
    monkeypatch.setattr(native, "gpu_devices", lambda: [native.GpuDevice("MTL0", "Apple M2", 10 << 30, 12 << 30, "MTL"),
                                                        native.GpuDevice("CUDA0", "x", 1, 2, "CUDA")])
    assert [g.metal for g in info.detect_gpus()] == [True, False]


def _placed(report_lines: list[str], vocab_size: int):
    """A DiffusionModel as llama.cpp's load log placed it, without loading one."""
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.offload import LoadReport

    model = DiffusionModel.__new__(DiffusionModel)
    model.load_report, model.vocab_size = LoadReport.from_log(report_lines), vocab_size
    return model


def test_a_vocabulary_past_metal_s_cumsum_row_takes_the_host_sampler():
    """ggml-metal's CUMSUM asserts a row of at most 1024 x 1024: the one-graph step with the output
    layer on a Mac's GPU and a longer vocabulary would abort the process. "auto" takes the host
    sampler, "graph" is refused with one line; Gemma's 262144 and other placements are untouched."""
    from dgcli.engine.diffusion import _resolve_step_backend
    from dgcli.errors import DgError
    from dgcli.runtime.model import METAL_CUMSUM_MAX_ROW

    on_metal = ["load_tensors: offloaded 3/3 layers to GPU", "load_tensors: MTL0_Mapped model buffer size = 1234.00 MiB",
                "load_tensors: CPU_Mapped model buffer size = 10.00 MiB"]
    output_on_cpu = ["load_tensors: offloaded 2/3 layers to GPU", *on_metal[1:]]
    on_cuda = [on_metal[0], "load_tensors: CUDA0 model buffer size = 1234.00 MiB"]
    big = METAL_CUMSUM_MAX_ROW + 1
    refused = _placed(on_metal, big)
    assert "cannot run on Metal with a 1,048,577-token vocabulary" in refused.graph_step_refused()
    assert _resolve_step_backend("auto", refused, 1).name == "native"
    with pytest.raises(DgError, match="cumulative sum takes rows of at most 1,048,576"):
        _resolve_step_backend("graph", refused, 1)
    with pytest.raises(DgError, match="cannot run on Metal"):
        refused.denoise_step(None, 1.0, None)  # before any native call
    for lines, vocab in ((on_metal, 262144), (on_metal, METAL_CUMSUM_MAX_ROW), (output_on_cpu, big), (on_cuda, big)):
        model = _placed(lines, vocab)
        assert model.graph_step_refused() is None and _resolve_step_backend("auto", model, 1) is None


# -- the native build: BSD patch, the chip, the SDK, --metal ----------------------------------------------------

# The options of macOS's patch (BSD); GNU-only ones such as --no-backup-if-mismatch are refused.
_BSD_PATCH = textwrap.dedent(r"""
    #!/bin/sh
    for arg in "$@"; do
      case "$arg" in
        --backup|--batch|--check|--context|--dry-run|--ed|--force|--forward|--fuzz=*|--ignore-whitespace|\
        --input=*|--normal|--posix|--quiet|--reverse|--silent|--strip=*|--unified|--verbose|--version) ;;
        --*) echo "patch: unrecognized option \`$arg'" >&2; exit 2 ;;
      esac
    done
    exec REAL_PATCH "$@"
""").lstrip()


def test_the_patch_applies_with_bsd_patch(tmp_path, monkeypatch):
    real = shutil.which("patch")
    if real is None:
        pytest.skip("no patch program here to stand behind the BSD-like one")
    shim = tmp_path / "bin" / "patch"
    shim.parent.mkdir()
    shim.write_text(_BSD_PATCH.replace("REAL_PATCH", real))
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "build.log"
    vendor = build.extract_pristine(build.fetch_sdist(log)) / "vendor" / "llama.cpp"
    contents = build.patched_contents(vendor, log)
    assert set(build.files_in_diff(build.PATCH_DIFF.read_text())) <= set(contents)
    assert "$ patch -p1 -t -N -i" in log.read_text()


@pytest.mark.subprocess
def test_our_patch_compiles_for_arm64(tmp_path):
    """Apple Silicon is arm64: the patch's x86 kernels must stay behind their guards. Our sources,
    patched in, compiled by an aarch64 cross compiler (Linux headers: the code, not Apple's SDK)."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler here (Debian: g++-aarch64-linux-gnu)")
    log = tmp_path / "build.log"
    pristine = build.extract_pristine(build.fetch_sdist(log)) / "vendor" / "llama.cpp"
    tree = tmp_path / "llama.cpp"
    for rel in ("include", "ggml/include", "src"):
        shutil.copytree(pristine / rel, tree / rel)
    (tree / "ggml" / "src").mkdir()
    for header in (pristine / "ggml" / "src").glob("*.h"):  # ggml's own internal headers
        shutil.copy(header, tree / "ggml" / "src" / header.name)
    # ggml-cpu's headers: dg's expert buffer type implements its extra buffer type interface
    shutil.copytree(pristine / "ggml" / "src" / "ggml-cpu", tree / "ggml" / "src" / "ggml-cpu",
                    ignore=lambda _dir, names: [n for n in names if not n.endswith((".h", ".hpp")) and "." in n])
    for rel, data in build.patched_contents(pristine, log).items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    ours = [rel for rel in build.new_source_files() if rel.endswith(".cpp")]
    assert len(ours) >= 5
    for rel in ours:
        done = subprocess.run([cxx, "-std=c++17", "-march=armv8.2-a+dotprod+fp16", "-fsyntax-only", "-Iinclude",
                               "-Iggml/include", "-Iggml/src", "-Iggml/src/ggml-cpu", "-Isrc", rel], cwd=tree, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{rel}:\n{done.stderr[-3000:]}"


def test_the_cache_key_tells_apple_chips_and_sdks_apart(monkeypatch):
    """`platform.processor()` is "arm" on every Apple Silicon chip: the key names the chip and its
    features (GGML_NATIVE compiles for them) and the SDK and compiler (Metal's shaders are built in)."""
    answers = {("sysctl", "-n", "machdep.cpu.brand_string"): "Apple M1",
               ("sysctl", "hw.optional"): "hw.optional.arm.FEAT_DotProd: 1\nhw.optional.arm.FEAT_I8MM: 0",
               ("xcrun", "--show-sdk-version"): "15.2", ("xcrun", "--show-sdk-build-version"): "24C94",
               ("cc", "--version"): "Apple clang version 16.0.0 (clang-1600.0.26.6)\nTarget: arm64-apple-darwin24.2.0"}
    monkeypatch.setattr(build, "command_output", lambda cmd: answers.get(tuple(cmd), ""))
    monkeypatch.setattr(sys, "platform", "darwin")
    args = build.cmake_args_for(build.parse_args([]))
    keys = {build.build_key(args)}
    answers[("sysctl", "-n", "machdep.cpu.brand_string")] = "Apple M4 Max"
    answers[("sysctl", "hw.optional")] = "hw.optional.arm.FEAT_DotProd: 1\nhw.optional.arm.FEAT_I8MM: 1"
    keys.add(build.build_key(args))
    answers[("xcrun", "--show-sdk-version")] = "26.0"
    keys.add(build.build_key(args))
    answers[("cc", "--version")] = "Apple clang version 17.0.0 (clang-1700.3.19.1)"
    keys.add(build.build_key(args))
    assert len(keys) == 4
    # --metal is what every Mac build is (the sdist forces GGML_METAL on): no second cache entry
    assert build.cmake_args_for(build.parse_args(["--metal"])) == args
    assert build.build_key(build.cmake_args_for(build.parse_args(["--metal"]))) == build.build_key(args)


def test_metal_is_refused_off_a_mac(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "linux")
    assert build.main(["--metal", "--print-key"]) == 1
    assert "--metal builds ggml-metal, which needs macOS" in capsys.readouterr().err


# -- Python: 3.10 without tomllib, and macOS's own 3.9 ---------------------------------------------------------


@pytest.mark.subprocess
def test_the_registry_reads_models_toml_without_tomllib():
    """Python 3.10 has no tomllib (3.11+): tomli, the same parser, stands in (pyproject.toml installs it
    there). Where tomli is not installed (3.11+), the standard library's copy of it plays tomli."""
    code = textwrap.dedent("""
        import importlib.util, sys
        if importlib.util.find_spec("tomli") is None:
            import tomllib
            sys.modules["tomli"] = tomllib
        sys.modules["tomllib"] = None          # as on 3.10: `import tomllib` fails
        sys.version_info = (3, 10, 13, "final", 0)
        from dgcli import registry
        print(registry.tomllib is sys.modules["tomli"], len(registry.Registry.load().names()))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    from_tomli, count = done.stdout.split()
    assert from_tomli == "True" and int(count) > 0


@pytest.mark.subprocess
def test_make_demo_says_what_to_install_on_macos_python_3_9(tmp_path):
    """macOS's own python3 is 3.9: `make demo` names the Python it needs before pip fails on it."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make here")
    old = tmp_path / "python3"
    old.write_text('#!/bin/sh\n[ "$1" = "--version" ] && { echo "Python 3.9.6"; exit 0; }\nexit 1\n')
    old.chmod(0o755)
    work = tmp_path / "repo"
    work.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, work / name)
    done = subprocess.run([make, "demo", f"PY={old}"], cwd=work, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"dg needs Python 3.10 or newer, and '{old}' is Python 3.9.6." in done.stderr
    assert "brew install python@3.12" in done.stderr and "make demo PY=python3.12" in done.stderr
    assert not (work / ".venv").exists()
    missing = subprocess.run([make, "test", f"PY={tmp_path / 'nowhere' / 'python3'}"], cwd=work, capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode != 0 and "is not installed" in missing.stderr and "make test PY=" in missing.stderr


def test_the_makefile_and_pyproject_agree_on_the_oldest_python():
    floor = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    check = re.search(r"sys\.version_info < \((\d+), (\d+)\)", (ROOT / "Makefile").read_text())
    assert floor and check and floor.groups() == check.groups()
