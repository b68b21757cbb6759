"""dg as a Unix tool (issue 28 item 5): a closed pipe or a full stdout ends it quietly or in one line,
never a traceback; every error names a flag as it was typed; `--temp 0` is greedy; `-c` says what
llama.cpp made of it; help fits 40 and 80 columns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dgcli.cli import _options
from dgcli.engine.sampler import NumpyStepSampler, schedule_temperature
from dgcli.params import GREEDY_TEMPERATURE, DiffusionParams

from cli_helpers import assert_one_line_error, run

REPO = Path(__file__).resolve().parent.parent


def dg_process(args, stdout, tmp_path, stdin=subprocess.DEVNULL):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_CACHE=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
               COLUMNS="80")
    return subprocess.run([sys.executable, "-m", "dgcli.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          stdin=stdin, env=env, cwd=tmp_path, timeout=120)


def trace_file(tmp_path) -> Path:
    path = tmp_path / "run.jsonl"
    r = dg_process(["generate", "nato: QWERTY", "-s", "1", "--trace", str(path)], subprocess.DEVNULL, tmp_path)
    assert r.returncode == 0, r.stderr
    return path


# the commands whose stdout the issue found failing: tables, the header reader, an answer streamed, JSON,
# a trace on stdout, help, a replayed trace
STDOUT_COMMANDS = [
    ["list"],
    ["info", "demo"],
    ["--help"],
    ["generate", "nato: QWERTY", "-s", "1"],
    ["generate", "nato: QWERTY", "-s", "1", "--json"],
    ["generate", "nato: QWERTY", "-s", "1", "--trace", "-"],
    ["replay", "TRACE", "--pace", "0"],
]


def _args(args, tmp_path):
    return [str(trace_file(tmp_path)) if a == "TRACE" else a for a in args]


@pytest.mark.subprocess
@pytest.mark.parametrize("args", STDOUT_COMMANDS, ids=" ".join)
def test_a_closed_pipe_ends_dg_quietly_with_141(args, tmp_path):
    """`dg list | head -1`: the reader has gone; dg stops as `yes | head -1` does (141, nothing on stderr
    about it). The pipe's read end is closed before dg writes, so every write meets it closed."""
    args = _args(args, tmp_path)
    read, write = os.pipe()
    os.close(read)
    try:
        r = dg_process(args, write, tmp_path)
    finally:
        os.close(write)
    stderr = r.stderr.decode()
    assert r.returncode == 141, stderr
    assert "Traceback" not in stderr and "Exception" not in stderr and "error" not in stderr.lower(), stderr


@pytest.mark.subprocess
@pytest.mark.parametrize("args", STDOUT_COMMANDS, ids=" ".join)
def test_stdout_on_dev_full_is_one_error_line(args, tmp_path):
    args = _args(args, tmp_path)
    with open("/dev/full", "w") as full:
        r = dg_process(args, full, tmp_path)
    stderr = r.stderr.decode()
    assert r.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: cannot write ") \
        and errors[0].endswith(": No space left on device"), stderr
    assert "Traceback" not in stderr and "Exception" not in stderr


@pytest.mark.parametrize("flags,fragment", [
    (["-n", "0"], "invalid -n 0: must be"),
    (["--max-new-tokens", "0"], "invalid --max-new-tokens 0: must be"),
    (["--max-new-tokens=0"], "invalid --max-new-tokens 0: must be"),
    (["-t", "0"], "invalid -t 0: must be"),
    (["-c", "-5"], "invalid -c -5: must be"),
    (["--temp", "-1"], "invalid --temp -1.0: must be 0 (greedy)"),
    (["--temp", "1e-40"], "invalid --temp 1e-40"),
    (["-ngl", "-2"], "invalid -ngl -2: must be"),
])
def test_errors_name_the_flag_as_typed(flags, fragment, tiny_gguf):
    assert_one_line_error(run("generate", "hi", "-m", tiny_gguf, *flags), fragment)


def test_the_flag_as_typed_tells_options_that_share_a_prefix_apart(monkeypatch):
    """`-ngl 5` is not `-n` with the value "gl 5"; the last of two spellings counts, as click takes the last value."""
    import typer
    from typer.testing import CliRunner

    seen = {}
    app = typer.Typer()

    @app.command()
    def cmd(max_new_tokens: int = typer.Option(1, "--max-new-tokens", "-n"),
            gpu_layers: int = typer.Option(0, "--gpu-layers", "-ngl"), verbose: bool = typer.Option(False, "-v")):
        seen["n"], seen["ngl"] = _options.typed_flag("max_new_tokens"), _options.typed_flag("gpu_layers")

    for args, n, ngl in ((["-ngl", "5"], "--max-new-tokens", "-ngl"), (["-n5", "--gpu-layers", "1"], "-n", "--gpu-layers"),
                         (["-n", "2", "--max-new-tokens", "3"], "--max-new-tokens", "--gpu-layers")):
        monkeypatch.setattr(_options, "command_line", args)
        assert CliRunner().invoke(app, args).exit_code == 0
        assert (seen["n"], seen["ngl"]) == (n, ngl), args


def test_temp_0_is_greedy():
    """llama.cpp's `--temp 0`: every position's sample is its argmax and its entropy 0, so a step accepts
    the whole canvas."""
    params = DiffusionParams(t_min=0.0, t_max=0.0).validate(canvas_length=8)
    temperature = schedule_temperature(1, params.max_denoising_steps, params.t_min, params.t_max)
    assert temperature == np.float32(GREEDY_TEMPERATURE) and temperature > 0
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 50)).astype(np.float32) * 5
    stats = NumpyStepSampler().process_logits(logits.copy(), temperature, rng.random(8))
    assert np.array_equal(stats.sampled, logits.argmax(axis=1)) and np.array_equal(stats.argmax, logits.argmax(axis=1))
    assert np.all(stats.entropy == 0.0)


@pytest.mark.native
def test_generate_at_temp_0_accepts_every_position_at_each_step(tmp_path):
    r = run("generate", "sort: QWERTY", "--temp", "0", "-s", "3", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["params"]["t_min"] == doc["params"]["t_max"] == 0.0
    steps = [e for e in doc["trace"] if e["kind"] == "step"]
    assert steps and all(e["n_accepted"] == len(e["accepted"]) and e["mean_entropy"] == 0.0 for e in steps)


@pytest.mark.native
def test_a_context_llama_cpp_rounds_up_is_said(tmp_path):
    r = run("generate", "reverse: HELLO", "-c", "10", "-s", "1", "--no-live")
    assert r.exit_code == 0, r.stderr
    assert "note: -c 10 gives a context of 256 tokens (llama.cpp rounds a context up to a multiple of 256 tokens)" \
        in r.stderr
    r = run("generate", "reverse: HELLO", "-c", "512", "-s", "1", "--no-live")
    assert r.exit_code == 0 and "gives a context" not in r.stderr


@pytest.mark.native
def test_a_prompt_past_the_training_context_warns(tmp_path):
    """The demo was trained on 1,024 tokens; -c 4096 lets a longer prompt in, and says what that means."""
    prompt = tmp_path / "long.txt"
    prompt.write_text("reverse: " + "AB " * 700)
    r = run("generate", "-f", prompt, "-c", "4096", "-s", "1", "-n", "4", "--no-live")
    assert r.exit_code == 0, r.stderr
    assert "past the 1024 tokens the model was trained on" in r.stderr
    r = run("generate", "reverse: HELLO", "-c", "4096", "-s", "1", "--no-live")
    assert r.exit_code == 0 and "trained on" not in r.stderr


@pytest.mark.parametrize("columns", [40, 80])
@pytest.mark.parametrize("command", [[], ["generate"], ["bench"], ["info"], ["compare"], ["chat"]])
def test_help_fits_the_terminal_and_names_every_option_whole(command, columns, monkeypatch):
    from dgcli.cli import app
    from typer.main import get_command

    monkeypatch.setenv("COLUMNS", str(columns))
    r = run(*command, "-h")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= columns, "\n".join(line for line in lines if len(line) > columns)
    group = get_command(app)
    cmd = group.commands[command[0]] if command else group
    words = set(r.stdout.replace(",", " ").split())
    for param in cmd.params:
        for opt in (*param.opts, *param.secondary_opts):
            if opt.startswith("-"):
                assert opt in words, (opt, r.stdout)
