"""Bad command lines, model paths and registry files seen to end in a traceback (or to be silently
misread): each is one `error:` line and exit 1 now, before any model is loaded."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from dgcli import cli
from dgcli.cli import _models

runner = CliRunner()


def error_line(*args, input=None, env=None) -> str:
    r = runner.invoke(cli.app, [str(a) for a in args], input=input, env=env)
    assert r.exit_code == 1, (r.stdout, r.stderr, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for input that should have been refused")
    for seam in ("open_diffusion_engine", "open_ar_engine", "open_speed_model"):
        monkeypatch.setattr(_models, seam, refuse)


def test_prompt_that_is_not_utf8(tiny_gguf, no_engine):
    # argv bytes that are not UTF-8 reach Python as lone surrogates
    assert "the prompt from the command line is not UTF-8 text (byte 3)" in error_line(
        "generate", "hi \udcff", "-m", tiny_gguf)
    assert "the prompt from stdin is not UTF-8 text (byte 2)" in error_line("generate", "-m", tiny_gguf, input=b"hi\xfe")


def test_system_text_that_is_not_utf8(tiny_gguf, tiny_ar_gguf, no_engine):
    for command in (["generate", "hi"], ["compare", "hi", "--ar-model", tiny_ar_gguf], ["chat"]):
        assert "the --system text is not UTF-8 text (byte 3)" in error_line(
            *command, "-m", tiny_gguf, "--system", "be \udcff", input=b"")


@pytest.mark.parametrize("seed", ["-2", str(2**32)])  # -1: a random seed, as llama-cli's -s -1
def test_seed_outside_its_range(seed, tiny_gguf, tiny_ar_gguf, no_engine):
    for command in (["generate", "hi"], ["compare", "hi", "--ar-model", tiny_ar_gguf], ["bench", "--ar-model", tiny_ar_gguf]):
        assert f"invalid --seed {seed}" in error_line(*command, "-m", tiny_gguf, "--seed", seed)


@pytest.mark.parametrize("flag,value", [("--threads", 2**31), ("--threads", 513), ("--gpu-layers", 2**70),
                                        ("--gpu-layers", -2)])
def test_threads_and_gpu_layers_that_would_wrap_in_a_c_int(flag, value, tiny_gguf, no_engine):
    assert f"invalid {flag} {value}" in error_line("generate", "hi", "-m", tiny_gguf, flag, value)


def test_library_refuses_them_too(tiny_gguf):
    from dgcli.engine.rng import RngStream
    from dgcli.errors import InvalidParameter
    from dgcli.runtime.model import DiffusionModel

    with pytest.raises(InvalidParameter, match="invalid threads"):
        DiffusionModel(tiny_gguf, n_threads=2**31)
    with pytest.raises(InvalidParameter, match="invalid gpu_layers"):
        DiffusionModel(tiny_gguf, n_gpu_layers=2**70)
    with pytest.raises(InvalidParameter, match="invalid seed"):
        RngStream(-1)  # numpy's ValueError before


def test_empty_model_is_not_the_demo(no_engine):
    assert "empty --model value" in error_line("generate", "hi", "-m", "")


def test_model_name_or_path_too_long_for_the_file_system(no_engine):
    name = "a" * 300
    line = error_line("generate", "hi", "-m", name)
    assert "unknown model" in line and len(line) < 300
    assert "File name too long" in error_line("generate", "hi", "-m", name + ".gguf")
    assert "File name too long" in error_line("info", name + ".gguf")


def test_model_files_that_cannot_be_read(tmp_path, no_engine):
    unreadable = tmp_path / "locked.gguf"
    unreadable.write_bytes(b"GGUF" + bytes(64))
    unreadable.chmod(0)
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    # /proc/self/mem and clear_refs refuse reads even to root (EIO, EINVAL)
    cases = {"/proc/self/mem": "cannot read", "/proc/self/clear_refs": "cannot read",
             "/dev/zero": "not a regular file", fifo: "not a regular file",
             unreadable: "cannot read" if os.geteuid() else "malformed"}
    for path, fragment in cases.items():
        for command in (["generate", "hi", "-m", path], ["info", path]):
            assert fragment in error_line(*command), (command, fragment)


REGISTRIES = {
    "models = 3": "[models] must be a table",
    "[models.x]\nrole = 'diffusion'\nrepo = 'a/b'\nfiles = 5": "x.files must be a table",
    "[models.x]\nrole = 'diffusion'\nrepo = 'a/b'\n[models.x.files]\nQ = {file = 'f.gguf', size_gb = 'big'}":
        "size_gb must be a number of GB",
    "[models.x]\nrole = 'diffusion'\nrepo = 'a/b'\n[models.x.files]\nQ = {file = 7}": "x.files.Q.file must be a string",
    "[models.x]\nrole = 'diffusion'\nrepo = 'a/b'\n[models.x.files]\nQ = {file = '../../etc/passwd'}":
        "must be a relative file name",
    "[models.x]\nrole = 'diffusion'\nrepo = '../../x'\n[models.x.files]\nQ = {file = 'f.gguf'}":
        "must be a Hub repository id",
    "[models.x]\nrole = 'diffusion'\nrepo = 5": "x.repo must be a string",
    "[models.x]\nrole = 'diffusion'\nshipped = 'x.gguf'\npair = 3": "x.pair must be a string",
    "[models.x]\nrole = 'diffusion'\nshipped = 'x.gguf'\ndescription = []": "x.description must be a string",
    "[models.x]\nrole = 'diffusion'\nrepo = 'a/b'\ndefault_quant = 1\n[models.x.files]\nQ = {file = 'f.gguf'}":
        "x.default_quant must be a string",
    "[models]\nx = 1": "[models.x] must be a table",
    # names `--model NAME[:QUANT]` could never reach, or that `dg list` printed raw (an escape sequence)
    "[models.'a:b']\nrole = 'ar'\nshipped = 'x.gguf'": "model name 'a:b' must be",
    "[models.'x.gguf']\nrole = 'ar'\nshipped = 'x.gguf'": "model name 'x.gguf' must be",
    "[models.\"\\u001b[2Jx\"]\nrole = 'ar'\nshipped = 'x.gguf'": "model name '\\x1b[2Jx' must be",
    "[models.x]\nrole = 'ar'\nrepo = 'a/b'\n[models.x.files]\n'Q:4' = {file = 'f.gguf'}": "x: quant 'Q:4' must be",
    "[models.x]\nrole = 'diffusion'\nshipped = 'x.gguf'\npair = 'x'": "x: pair 'x' has the same role (diffusion)",
}


@pytest.mark.parametrize("text", list(REGISTRIES))
def test_registry_with_wrong_types(text, tmp_path):
    registry = tmp_path / "models.toml"
    registry.write_text(text)
    assert REGISTRIES[text] in error_line("list", env={"DG_REGISTRY": str(registry)})


def test_registry_that_is_a_folder(tmp_path):
    assert "model registry is not a regular file (a directory)" in error_line("list", env={"DG_REGISTRY": str(tmp_path)})


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
@pytest.mark.subprocess
def test_registry_that_is_not_a_regular_file_is_refused_at_once(kind, tmp_path):
    # DG_REGISTRY=a FIFO blocked every command (even `dg list`) for ever; /dev/zero was read until memory ran out
    import resource
    import subprocess
    import sys
    from pathlib import Path

    registry = tmp_path / "models.toml"
    if kind == "fifo":
        os.mkfifo(registry)
    else:
        registry.symlink_to(kind)

    def bounded_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "dgcli.cli", "list"], capture_output=True, text=True, timeout=60,
                       preexec_fn=bounded_memory, stdin=subprocess.DEVNULL,
                       env=dict(os.environ, PYTHONPATH=str(repo), DG_REGISTRY=str(registry)))
    assert (r.returncode, r.stderr) == (1, f"error: model registry is not a regular file: {registry}\n")


@pytest.mark.parametrize("closed, args, code, stderr", [
    (0, ["generate"], 1, "error: empty prompt\n"),  # `dg generate <&-`: stdin was None, a traceback
    (1, ["list"], 0, ""),  # `dg list >&-`: stdout was None, a traceback while importing
])
@pytest.mark.subprocess
def test_a_closed_standard_stream_reads_as_dev_null(closed, args, code, stderr):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "dgcli.cli", *args], capture_output=True,
                       preexec_fn=lambda: os.close(closed),
                       env=dict(os.environ, PYTHONPATH=str(repo)), cwd=repo, timeout=120, text=True)
    assert (r.returncode, r.stderr) == (code, stderr)


@pytest.mark.parametrize("args, named", [
    (("pull", ""), "empty MODEL argument: `dg pull` takes NAME"),
    (("pull", "  "), "empty MODEL argument: `dg pull` takes NAME"),
    (("info", ""), "empty MODEL argument: `dg info` takes"),
    (("compare", "hi", "--ar-model", ""), "empty --ar-model value"),
    (("bench", "--ar-model", " "), "empty --ar-model value"),
    (("pull", ":Q8_0"), "no model name before ':' in ':Q8_0'"),
    (("generate", "hi", "-m", ":"), "no model name before ':' in ':'"),
])
def test_an_empty_model_name_names_the_argument_given(no_engine, args, named):
    # `dg pull ""` spoke of --model; `--ar-model ""` silently took the registry pair
    line = error_line(*args)
    assert named in line and (args[0] in ("generate",) or "--model" not in line), line


@pytest.mark.parametrize("args", [("info", "~no-such-user-dg/m.gguf"), ("generate", "hi", "-m", "~no-such-user-dg"),
                                  ("pull", "~no-such-user-dg")])
def test_a_home_folder_of_no_user_is_one_line(no_engine, args):
    # pathlib's expanduser raised RuntimeError: a traceback from every command taking a model
    assert "no home folder for ~no-such-user-dg" in error_line(*args)


def _under_the_c_locale(*args, input: bytes = b""):
    """dg with LC_ALL=C and Python's UTF-8 mode off: argv is decoded as ASCII (a byte that is not
    ASCII arrives as a lone surrogate) and the standard streams are ASCII."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "dgcli.cli", *args], capture_output=True, input=input,
                          env=dict(os.environ, PYTHONPATH=str(repo), LC_ALL="C", PYTHONUTF8="0"), cwd=repo,
                          timeout=120)


@pytest.mark.subprocess
def test_utf8_arguments_are_taken_under_the_c_locale():
    # "the prompt from the command line is not UTF-8 text (byte 1)" for "héllo", a valid UTF-8 argument
    r = _under_the_c_locale("generate", "reverse: HÉLLO".encode(), "--system", "Sé brief".encode(), "-n", "8",
                            "--seed", "1")
    assert r.returncode == 0 and b"error" not in r.stderr, r.stderr
    r = _under_the_c_locale("generate", b"h\xc3\xa9\xffllo", "-n", "8")
    assert (r.returncode, r.stderr) == (1, b"error: the prompt from the command line is not UTF-8 text (byte 3)\n")
    r = _under_the_c_locale("generate", "hi", "--system", b"\xc3\xa9\xff")
    assert (r.returncode, r.stderr) == (1, b"error: the --system text is not UTF-8 text (byte 2)\n")


@pytest.mark.subprocess
def test_non_ascii_output_under_the_c_locale_is_utf8():
    # compare's table caption says "÷": UnicodeEncodeError ('ascii' codec) and a traceback, piped
    r = _under_the_c_locale("compare", "reverse: HELLO", "--seed", "1", "--no-live")
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    assert "tok/s ÷ AR tok/s" in r.stdout.decode("utf-8")


@pytest.mark.parametrize("value", ["²", "0", "1000000000"])
@pytest.mark.parametrize("args", [["list"], ["generate", "reverse: HELLO", "--seed", "1"],
                                  ["compare", "reverse: HELLO", "--seed", "1"], ["generate", "--help"]])
@pytest.mark.subprocess
def test_columns_and_lines_that_are_no_terminal_size_are_ignored(args, value):
    # COLUMNS=² ended every command in a traceback (ValueError from Rich's int()), before anything ran
    import resource
    import subprocess
    import sys
    from pathlib import Path

    def bounded_memory():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "dgcli.cli", *args], capture_output=True, text=True, timeout=120,
                       preexec_fn=bounded_memory, stdin=subprocess.DEVNULL, cwd=repo,
                       env=dict(os.environ, PYTHONPATH=str(repo), COLUMNS=value, LINES=value))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert max(map(len, r.stdout.splitlines())) < 400  # no line padded to a billion columns


def test_an_engine_limit_on_a_typed_flag_names_the_flag(tiny_gguf):
    # "invalid n_cpu_moe=1000" and "invalid max_denoising_steps=0" named the engine's parameters,
    # which nobody typed
    assert "invalid --n-cpu-moe 1000: must be -1 (all) or at most the model's" in error_line(
        "generate", "hi", "-m", tiny_gguf, "--n-cpu-moe", 1000)
    assert "invalid --n-cpu-moe 1000" in error_line("info", tiny_gguf, "--n-cpu-moe", 1000)
    assert "invalid --steps 0: must be an integer between 1 and" in error_line("generate", "hi", "-m", tiny_gguf,
                                                                                "--steps", 0)
