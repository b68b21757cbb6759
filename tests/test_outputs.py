"""Output files: never over an input, never over an existing file without --force, never a device
node or a symlink replaced by a regular file, a stream for `-`, devices and FIFOs, no temporary left.

The CLI cases run the real commands on the tiny GGUFs (generate, bench) and the reference checkpoint
(convert)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading

import pytest
from typer.testing import CliRunner

from dgcli import cli
from dgcli.errors import DgError
from dgcli.outputs import OutputFile, writing
from native_helpers import requires_native

runner = CliRunner()
needs_torch = pytest.mark.reference  # skipped without torch and transformers (conftest.py)


def run(*args):
    return runner.invoke(cli.app, [str(a) for a in args])


def one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def write(out: OutputFile, text: str = "new\n") -> None:
    with writing(out):
        out.write(text)


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


# ------------------------------------------------------------------------------------- OutputFile


def test_new_file_appears_complete_with_ordinary_permissions(tmp_path):
    target = tmp_path / "out.json"
    out = OutputFile(target)
    with writing(out):
        out.write("part 1\n")
        assert not target.exists()  # only once complete
        assert leftovers(tmp_path)
    assert target.read_text() == "part 1\n" and leftovers(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
def test_a_replaced_file_keeps_its_permissions(tmp_path, mode):
    # --force over a private (0600) report made it 0644, readable by everyone
    target = tmp_path / "report.json"
    target.write_text("old")
    target.chmod(mode)
    write(OutputFile(target, force=True))
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == mode


def test_existing_file_needs_force(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("keep\n")
    with pytest.raises(DgError, match="it exists; pass --force"):
        OutputFile(target)
    assert target.read_text() == "keep\n"
    write(OutputFile(target, force=True))
    assert target.read_text() == "new\n"


def test_file_that_appears_while_writing_is_not_replaced(tmp_path):
    target = tmp_path / "out.json"
    out = OutputFile(target)
    with pytest.raises(DgError, match="created by something else"):
        with writing(out):
            out.write("new\n")
            target.write_text("someone else's\n")
    assert target.read_text() == "someone else's\n" and leftovers(tmp_path) == []


def test_an_input_is_never_an_output_even_with_force(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF weights")
    alias = tmp_path / "alias.gguf"
    os.link(model, alias)
    for path in (model, alias, tmp_path / "." / "model.gguf"):
        with pytest.raises(DgError, match="one of this command's inputs"):
            OutputFile(path, force=True, inputs=[model])
    assert model.read_bytes() == b"GGUF weights"


def test_symlink_is_kept_and_its_target_replaced_only_with_force(tmp_path):
    real = tmp_path / "runs" / "1.json"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    with pytest.raises(DgError, match="a symlink to an existing file; pass --force"):
        OutputFile(link)
    write(OutputFile(link, force=True))
    assert link.is_symlink() and real.read_text() == "new\n"
    assert leftovers(tmp_path) == [] and leftovers(real.parent) == []


def test_fifo_is_a_stream_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    write(OutputFile(fifo), "through the pipe\n")
    reader.join(10)
    assert got == ["through the pipe\n"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and leftovers(tmp_path) == []


def test_fifo_nobody_reads_yet_is_waited_for_with_a_message(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []

    def late_reader():
        while "waiting for a process to read" not in capsys.readouterr().err:
            threading.Event().wait(0.01)
        got.append(open(fifo).read())

    reader = threading.Thread(target=late_reader, daemon=True)
    reader.start()
    write(OutputFile(fifo), "late\n")
    reader.join(10)
    assert got == ["late\n"]


def test_character_device_is_written_to_never_replaced(tmp_path):
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
    except PermissionError:
        pytest.skip("creating a device node needs root (the CLI test below uses /dev/null itself)")
    write(OutputFile(node), "discarded\n")
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_full_device_is_one_error(tmp_path):
    out = OutputFile("/dev/full")
    with pytest.raises(DgError, match="No space left on device"):
        with writing(out):
            out.write("x" * 100_000)
    assert stat.S_ISCHR(os.lstat("/dev/full").st_mode)


def test_dash_is_stdout(capsys):
    write(OutputFile("-"), "to stdout\n")
    assert capsys.readouterr().out == "to stdout\n"


def test_folder_missing_folder_and_unwritable_folder(tmp_path):
    with pytest.raises(DgError, match="it is a folder"):
        OutputFile(tmp_path)
    with pytest.raises(DgError, match="does not exist"):
        OutputFile(tmp_path / "no" / "out.json")
    # /proc/self: a folder nobody can create files in, root included
    with pytest.raises(DgError, match=r"cannot write output /proc/self/out.json: "):
        OutputFile("/proc/self/out.json").open()


def test_regular_file_only_where_the_writer_seeks(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (fifo, "-"):
        with pytest.raises(DgError, match="regular file"):
            OutputFile(path, streams=False)


# ------------------------------------------------------------------------------------- commands


@requires_native
def test_generate_trace_refuses_existing_file_and_model_and_streams_to_dev_null(tiny_gguf, tmp_path):
    base = ["generate", "hi", "-m", tiny_gguf, "-n", "4", "--steps", "2", "--seed", "0", "--no-live"]
    trace = tmp_path / "t.jsonl"
    trace.write_text("earlier run\n")
    one_line_error(run(*base, "--trace", trace), "--trace", "pass --force")
    assert trace.read_text() == "earlier run\n"
    assert run(*base, "--trace", trace, "--force").exit_code == 0
    assert "step" in [json.loads(line)["kind"] for line in trace.read_text().splitlines()]

    before = tiny_gguf.read_bytes()
    one_line_error(run(*base, "--trace", tiny_gguf, "--force"), "one of this command's inputs")
    assert tiny_gguf.read_bytes() == before

    r = run(*base, "--trace", "/dev/null")
    assert r.exit_code == 0, r.stderr
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)

    r = run(*base, "--trace", "-")
    assert r.exit_code == 0 and '"kind": "step"' in r.stdout
    assert leftovers(tmp_path) == []


@requires_native
def test_a_trace_on_stdout_has_it_to_itself(tiny_gguf, tmp_path):
    # `--trace - > run.jsonl`: the answer was streamed into the trace's lines, which dg replay then refused
    r = run("generate", "reverse: HELLO", "--seed", "1", "--trace", "-")  # the demo model
    assert r.exit_code == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]  # every line is one JSON object
    assert lines[0]["kind"] == "header" and lines[-1]["kind"] == "result" and lines[-1]["text"] == "OLLEH"
    assert "\nOLLEH\n" in r.stderr  # the answer is shown, on stderr
    saved = tmp_path / "run.jsonl"
    saved.write_text(r.stdout)
    replayed = run("replay", saved, "--pace", "0")
    assert replayed.exit_code == 0, replayed.stderr
    one_line_error(run("generate", "hi", "-m", tiny_gguf, "--json", "--trace", "-"), "--json and --trace to stdout")


@requires_native
def test_status_lines_never_follow_streamed_text_on_its_line():
    # a canvas's text is streamed as it is final, without a newline: the next status line on the
    # same stream was glued to it, "QUEBEC WHISKEY ECHO ROMEO TANGO canvas 2  step 1/48 ..."
    r = run("generate", "nato: QWERTY", "--seed", "1", "--trace", "-")  # the demo model: two canvases
    assert r.exit_code == 0, r.stderr
    lines = [line.strip() for line in r.stderr.splitlines()]
    assert "QUEBEC WHISKEY ECHO ROMEO TANGO" in lines and "YANKEE" in lines, r.stderr
    assert all(line.startswith("canvas ") for line in lines if "step" in line and "/48" in line), r.stderr


@requires_native
@pytest.mark.subprocess
def test_status_lines_start_lines_of_their_own_in_one_file_for_both_streams(tmp_path):
    # `dg generate ... > run.log 2>&1` (or `2>&1 | cat`): stdout and stderr are one file, and the
    # second canvas's status line was glued to the first canvas's text in it
    import subprocess
    import sys

    log = tmp_path / "run.log"
    with open(log, "wb") as f:
        subprocess.run([sys.executable, "-m", "dgcli.cli", "generate", "nato: QWERTY", "--seed", "1"],
                       stdout=f, stderr=subprocess.STDOUT, check=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                       env=dict(os.environ, COLUMNS="80"))
    lines = [line.strip() for line in log.read_text().splitlines()]
    assert "QUEBEC WHISKEY ECHO ROMEO TANGO" in lines and "YANKEE" in lines, lines
    assert any(line.startswith("canvas 2  step 1/48") for line in lines), lines
    # stdout and stderr apart: stdout's bytes are the model's text, nothing added
    out = subprocess.run([sys.executable, "-m", "dgcli.cli", "generate", "nato: QWERTY", "--seed", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout
    assert out == b"QUEBEC WHISKEY ECHO ROMEO TANGO YANKEE\n", out


@requires_native
def test_generate_trace_into_an_unwritable_folder_is_one_line(tiny_gguf):
    one_line_error(run("generate", "hi", "-m", tiny_gguf, "-n", "4", "--steps", "2", "--trace", "/proc/self/t.jsonl"),
                   "cannot write --trace /proc/self/t.jsonl")


@requires_native
def test_bench_output_refuses_its_prompt_file(tiny_gguf, tiny_ar_gguf, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    args = ["bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--prompts", prompts, "--repeat", "1",
            "-n", "4", "--steps", "2", "--no-speed-model", "--json"]
    one_line_error(run(*args, "-o", prompts, "--force"), "--output", "one of this command's inputs")
    assert prompts.read_text() == "hi\n"
    report = tmp_path / "report.json"
    report.write_text("{}")
    one_line_error(run(*args, "-o", report), "pass --force")
    assert run(*args, "-o", report, "--force").exit_code == 0
    assert json.loads(report.read_text())["schema"].startswith("dg-bench/")


@requires_native
def test_bench_output_refuses_the_models_own_prompt_set(tiny_gguf, tiny_ar_gguf, tmp_path, monkeypatch):
    # without --prompts, bench reads the registry entry's bench_prompts (the demo's, inside the package):
    # -o onto it with --force wrote the report over it
    from dgcli import registry

    package = tmp_path / "package"
    (package / "data").mkdir(parents=True)
    prompts = package / "data" / "prompts.tsv"
    prompts.write_text("add\twhat is 3+5\t8\n")
    for name, src in (("d.gguf", tiny_gguf), ("ar.gguf", tiny_ar_gguf)):
        (package / name).symlink_to(src)
    reg = tmp_path / "models.toml"
    reg.write_text('[models.mine]\nrole = "diffusion"\nshipped = "d.gguf"\npair = "mine-ar"\n'
                   'bench_prompts = "data/prompts.tsv"\n'
                   '[models.mine-ar]\nrole = "ar"\nshipped = "ar.gguf"\npair = "mine"\n')
    monkeypatch.setenv("DG_REGISTRY", str(reg))
    monkeypatch.setattr(registry, "PACKAGE_DIR", package)
    one_line_error(run("bench", "-m", "mine", "--repeat", "1", "-n", "4", "--steps", "2", "--no-speed-model",
                       "--json", "-o", prompts, "--force"), "--output", "one of this command's inputs")
    assert prompts.read_text() == "add\twhat is 3+5\t8\n"


@needs_torch
def test_convert_never_writes_over_its_checkpoint_or_one_output_over_the_other(reference_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_checkpoint, ckpt)
    weights = (ckpt / "model.safetensors").read_bytes()
    for out in (ckpt / "model.safetensors", ckpt / "config.json"):
        one_line_error(run("convert", ckpt, out, "--outtype", "f32", "--force"), "one of this command's inputs")
    assert (ckpt / "model.safetensors").read_bytes() == weights

    out = tmp_path / "m.gguf"
    one_line_error(run("convert", ckpt, out, "--ar-twin", tmp_path / "." / "m.gguf"), "same file")
    assert not out.exists()

    assert run("convert", ckpt, out, "--outtype", "f32").exit_code == 0
    first = out.read_bytes()
    one_line_error(run("convert", ckpt, out, "--outtype", "f16"), "OUT", "pass --force")
    assert out.read_bytes() == first
    r = run("convert", ckpt, out, "--outtype", "f16", "--force", "--ar-twin", tmp_path / "ar.gguf")
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes() != first and (tmp_path / "ar.gguf").exists()
    assert leftovers(tmp_path) == []


@needs_torch
def test_convert_refuses_every_file_of_its_checkpoint_as_output(reference_checkpoint, tmp_path):
    # special_tokens_map.json (read for the special tokens) was not counted as an input: --force wrote
    # the GGUF over it
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_checkpoint, ckpt)
    files = sorted(ckpt.iterdir())
    assert "special_tokens_map.json" in [f.name for f in files]
    before = {f: f.read_bytes() for f in files}
    for f in files:
        one_line_error(run("convert", ckpt, f, "--outtype", "f32", "--force"), "one of this command's inputs")
    assert {f: f.read_bytes() for f in sorted(ckpt.iterdir())} == before


@needs_torch
def test_convert_refuses_an_output_its_checkpoint_would_read_back(reference_checkpoint, tmp_path):
    # OUT = CKPT/x.safetensors (or chat_template.jinja, which the checkpoint lacked) was written, exit 0,
    # and the next conversion of CKPT failed on it ("x.safetensors is not a safetensors file")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_checkpoint, ckpt)
    before = sorted(p.name for p in ckpt.iterdir())
    for out in (ckpt / "x.safetensors", ckpt / "chat_template.jinja", tmp_path / "." / "ckpt" / "y.safetensors"):
        one_line_error(run("convert", ckpt, out, "--outtype", "f32"), "reads that name as part of the checkpoint")
    one_line_error(run("convert", ckpt, tmp_path / "m.gguf", "--ar-twin", ckpt / "ar.safetensors"),
                   "--ar-twin", "reads that name as part of the checkpoint")
    assert sorted(p.name for p in ckpt.iterdir()) == before and not (tmp_path / "m.gguf").exists()
    assert run("convert", ckpt, ckpt / "m.gguf", "--outtype", "f32").exit_code == 0  # a .gguf there is fine


@pytest.mark.subprocess
def test_is_stdout_names_the_process_stdout_however_spelled(tmp_path):
    # bench -o PATH with --json prints the report once when PATH is stdout (`-`, /dev/stdout, or the file
    # stdout is piped to)
    import subprocess
    import sys

    code = ("import sys; from dgcli.outputs import OutputFile; "
            "print([OutputFile(p, force=True).is_stdout for p in sys.argv[1:]])")
    other = tmp_path / "other.txt"
    result = subprocess.run([sys.executable, "-c", code, "-", "/dev/stdout", str(other), "/dev/null"],
                            stdout=subprocess.PIPE, text=True, check=True)  # stdout a pipe: /dev/stdout a FIFO
    assert result.stdout.strip() == "[True, True, False, False]"
