"""Issue 8: what a newcomer sees. One test per defect seen (each failed on the code before the fix),
and the conventions users bring from llama-cli and ollama (-p, -f, --system, --raw, -c, -s, --temp).

Most run the shipped demo pair through llama.cpp (the issue's own reproducers); the terminal paths
are in test_terminal.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dgcli import cli, registry
from dgcli.cli import _terminal, render
from dgcli.engine.types import GenerationResult
from dgcli.testing.tiny import write_tiny_random_gguf

REPO = Path(__file__).resolve().parents[1]
needs_native = pytest.mark.native  # skipped where the patched llama.cpp is not built (conftest.py)
runner = CliRunner()


def dg(*args, input=None):
    return runner.invoke(cli.app, [str(a) for a in args], input=input)


def ok_json(*args, input=None) -> dict:
    r = dg(*args, input=input)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def one_line_error(r, *fragments) -> None:
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ------------------------------------------------------------------------------------ defect 2: pads


@needs_native
def test_pads_count_for_nothing_and_a_canvas_of_pads_ends_the_run():
    doc = ok_json("compare", "What is the capital of France?", "--seed", "0", "--json")
    d = doc["diffusion"]["result"]
    # The first demo printed an empty answer here yet reported 256 new tokens, 1026 tok/s and a 1.56x
    # speedup. The retrained one answers with its help line: every answer token counted, nothing else.
    assert d["text"] and d["stop_reason"] == "end_token" and 0 not in d["token_ids"]
    assert d["n_new_tokens"] == len(d["token_ids"]) and doc["speedup"] is not None
    assert d["tokens_per_forward"] == pytest.approx(d["n_new_tokens"] / d["decoder_forwards"])
    # an empty answer (a first canvas of pads) has no rate, so no speedup either
    empty = GenerationResult(mode="diffusion", text="", token_ids=[], n_prompt_tokens=3, total_s=1.0)
    one = GenerationResult(mode="autoregressive", text="A", token_ids=[5], n_prompt_tokens=3, total_s=1.0)
    assert empty.tokens_per_second == 0 and render.speedup(empty, one) is None
    # far past its trained lengths the demo's answer runs into a canvas of pads, which ends the run
    long = ok_json("generate", "sort: ABCDEFGHIJKLMNOPQRSTUVWXYZ", "-n", "200", "--seed", "0", "--json")["result"]
    assert long["stop_reason"] == "pad_canvas" and len(long["steps_per_canvas"]) == 2  # not six more canvases
    assert long["n_new_tokens"] == len(long["token_ids"]) == len(long["text"]) and 0 not in long["token_ids"]
    assert long["tokens_per_forward"] == pytest.approx(long["n_new_tokens"] / long["decoder_forwards"])


# ------------------------------------------------------------------------------------ defect 3: stdin


@needs_native
def test_a_prompt_from_stdin_or_a_file_loses_its_trailing_newline(tmp_path):
    argument = dg("generate", "reverse: HELLO", "--seed", "1")
    piped = dg("generate", "--seed", "1", input="reverse: HELLO\n")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("reverse: HELLO\r\n")
    from_file = dg("generate", "-f", prompt_file, "--seed", "1")
    assert argument.stdout == piped.stdout == from_file.stdout == "OLLEH\n"  # stdin gave OHLLEH


# ------------------------------------------------------------------------------------ defect 4: -n


@needs_native
def test_max_new_tokens_is_a_limit():
    doc = ok_json("generate", "reverse: HELLO", "-n", "2", "--seed", "1", "--json")
    assert doc["answer"] == "OL" and doc["result"]["n_new_tokens"] == 2 and doc["result"]["stop_reason"] == "length"
    r = dg("generate", "reverse: HELLO", "-n", "1", "--seed", "1")
    assert r.stdout == "O\n" and "1 new token in" in r.stderr  # and "1 new tokens" no more


# ------------------------------------------------------------------------------------ defect 5: seed


@needs_native
def test_a_run_without_a_seed_reports_the_seed_that_reproduces_it():
    first = ok_json("generate", "sort: QWERTY", "--json")
    seed = first["seed"]
    assert isinstance(seed, int) and first["result"]["seed"] == seed
    again = ok_json("generate", "sort: QWERTY", "-s", str(seed), "--json")
    def canvases(doc):
        return [(e["argmax_canvas"], e["accepted"]) for e in doc["trace"] if e["kind"] == "step"]

    assert again["answer"] == first["answer"] and canvases(again) == canvases(first)
    r = dg("generate", "sort: QWERTY", "--seed", "-1")  # llama-cli's "random" seed
    assert re.search(r"seed \d+", r.stderr)
    one_line_error(dg("generate", "hi", "--seed", "-5"), "invalid --seed -5")


# ------------------------------------------------------------------------------------ defect 8: pace, replay


def test_pace_holds_each_step_on_screen(monkeypatch):
    clock = {"now": 100.0}
    slept = []
    monkeypatch.setattr(_terminal.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(_terminal.time, "sleep", lambda s: (slept.append(round(s, 6)), clock.update(now=clock["now"] + s)))
    pacer = _terminal.Pacer(0.3)
    pacer.wait()  # the first step shows at once
    clock["now"] += 0.05  # the next step took 0.05 s to compute
    pacer.wait()
    clock["now"] += 0.5  # a slow step is not held longer
    pacer.wait()
    assert slept == [0.25]
    _terminal.Pacer(0).wait()
    assert slept == [0.25]


@needs_native
def test_replay_shows_a_saved_trace_again_without_the_model(tmp_path):
    trace = tmp_path / "run.jsonl"
    live = dg("generate", "sort: QWERTY", "--seed", "0", "--trace", trace)
    assert live.exit_code == 0, live.stderr
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["schema"] == "dg-trace/1" and lines[-1]["kind"] == "result"
    replayed = dg("replay", trace, "--pace", "0")
    assert replayed.exit_code == 0, replayed.stderr
    assert replayed.stdout == live.stdout == "EQRTWY\n"
    assert "canvas 1  step 1/48" in replayed.stderr and "recorded: 6 new tokens" in replayed.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "step"}\n')
    one_line_error(dg("replay", bad), "is not a dg-trace/1 trace")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(trace.read_text().splitlines()[0] + '\n{"kind": "step", "canvas": 0}\n')
    one_line_error(dg("replay", broken), "broken.jsonl:2: malformed step line")
    one_line_error(dg("replay", tmp_path / "none.jsonl"), "trace file not found")


# ------------------------------------------------------------------------------------ defect 10: examples


def test_the_examples_have_an_extra_and_a_make_target():
    extras = registry.tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("matplotlib") for dep in extras["examples"])
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^examples:", makefile, re.M) and ".[examples]" in makefile


# ------------------------------------------------------------------------------------ defect 11: JSON


def test_every_json_output_names_its_schema_and_the_schemas_are_documented(tiny_gguf):
    documented = (REPO / "docs" / "json.md").read_text()
    from dgcli.bench import BENCH_SCHEMA
    from dgcli.cli.commands import compare, generate, info, list_models
    from dgcli.trace import TRACE_SCHEMA

    for schema in (generate.GENERATE_SCHEMA, compare.COMPARE_SCHEMA, BENCH_SCHEMA, TRACE_SCHEMA,
                   list_models.LIST_SCHEMA, info.INFO_SCHEMA):
        assert f"`{schema}`" in documented, schema
    listing = ok_json("list", "--json")
    assert listing["schema"] == list_models.LIST_SCHEMA
    keys = {frozenset(row) for row in listing["models"]}
    assert len(keys) == 1  # shipped and downloadable rows share their keys
    assert ok_json("info", tiny_gguf, "--json")["schema"] == info.INFO_SCHEMA


@needs_native
def test_generate_json_holds_the_trace_line_for_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    doc = ok_json("generate", "sort: BA", "--seed", "3", "--json", "--trace", trace)
    assert doc["schema"] == "dg-generate/1" and doc["seed"] == 3
    assert [json.loads(line) for line in trace.read_text().splitlines()] == doc["trace"]


# ------------------------------------------------------------------------------------ defect 13: small ones


def test_help_and_version_flags():
    assert dg("-h").exit_code == 0 and "generate" in dg("-h").stdout
    assert dg("generate", "-h").exit_code == 0
    version = dg("--version")
    assert version.exit_code == 0 and re.fullmatch(r"dg \S+\n", version.stdout)
    help_text = dg("generate", "--help").stdout
    assert "--no-live" in help_text and not re.search(r"--no-live\s+<bool>", help_text)
    assert "<bool>" not in help_text


def test_each_commands_entry_in_dg_help_is_one_paragraph_that_reflows():
    # the help list shows a docstring's first paragraph with its line breaks kept: info's read
    # "sampler defaults, and" / "whether it fits ..." broken mid-sentence at any width
    import inspect

    import typer

    commands = typer.main.get_command(cli.app).commands
    assert "info" in commands
    for name, command in commands.items():
        first = inspect.cleandoc(command.help or "").split("\n\n")[0]
        assert "\n" not in first, (name, first)


def test_plurals_in_the_summary():
    from dgcli.engine.types import GenerationResult

    one = GenerationResult(mode="diffusion", text="x", token_ids=[5], n_prompt_tokens=1, decoder_forwards=1,
                           total_s=1.0, seed=4)
    assert render.result_summary(one).startswith("1 new token in 1.00s") and "1 forward " in render.result_summary(one)


# ------------------------------------------------------------------------------------ conventions


@needs_native
def test_prompt_options_p_f_and_their_conflicts(tmp_path):
    assert dg("generate", "-p", "reverse: HELLO", "-s", "1").stdout == "OLLEH\n"
    one_line_error(dg("generate", "hi", "-p", "hi"), "the prompt was given twice")
    one_line_error(dg("generate", "-f", tmp_path / "missing.txt"), "prompt file not found")
    one_line_error(dg("generate", "-f", tmp_path), "prompt file is not a regular file")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe")
    one_line_error(dg("generate", "-f", binary), "is not UTF-8 text")


@needs_native
def test_system_temp_and_ctx_size():
    doc = ok_json("generate", "sort: BA", "--system", "Be brief.", "--temp", "0.5", "-s", "2", "--json")
    assert doc["system"] == "Be brief." and doc["params"]["t_min"] == doc["params"]["t_max"] == 0.5
    assert all(e["temperature"] == pytest.approx(0.5) for e in doc["trace"] if e["kind"] == "step")
    one_line_error(dg("generate", "hi", "--system", "x", "--raw"), "--system needs the chat template")
    one_line_error(dg("generate", "word " * 300, "-c", "64"), "exceeds the context", "-c/--ctx-size")
    long = ok_json("generate", "sort: " + "A" * 300, "-c", "0", "-n", "8", "-s", "0", "--json")
    assert long["result"]["n_prompt_tokens"] > 300  # -c 0: the model's training context (4096 > 64)


@needs_native
def test_raw_runs_a_gguf_without_a_chat_template(tmp_path):
    path = write_tiny_random_gguf(tmp_path / "no-template.gguf", chat_template=None)
    one_line_error(dg("generate", "hi", "-m", path, "--steps", "2", "-n", "16"), "has no chat template", "--raw")
    r = dg("generate", "hi", "-m", path, "--raw", "--steps", "2", "-n", "16", "-s", "0", "--json")
    assert r.exit_code == 0, r.stderr
    from dgcli.testing.tiny import tiny_vocab

    # a bos, then the text as it is
    assert json.loads(r.stdout)["result"]["n_prompt_tokens"] == len(tiny_vocab().encode("hi", add_bos=True))


@pytest.mark.skipif(not shutil.which("make"), reason="no make")
@pytest.mark.parametrize("prompt", ["reverse: HELLO", 'sort: "QWE"', "reverse: $HOME", "it's `id` $(id), ok"])
@pytest.mark.subprocess
def test_make_demo_passes_the_prompt_as_typed(prompt):
    # `make demo PROMPT="..."` (README): the Makefile put it in double quotes, so the shell dropped quotes
    # inside it and ran backticks and $(...), and make itself ate `$H` of "reverse: $HOME"
    # --no-print-directory and no inherited make settings: under `make test` this make is a sub-make,
    # which would print "Leaving directory" after the command
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    commands = subprocess.run(["make", "--no-print-directory", "-n", "demo", f"PROMPT={prompt}"], cwd=REPO,
                              capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()
    assert shlex.split(commands[-1])[1:] == ["generate", prompt, "--pace", "0.3"], commands[-1]


@needs_native
@pytest.mark.subprocess
def test_the_readmes_python_example_prints_what_the_readme_shows():
    """The README's Python API sample, run from the repository as a newcomer would paste it; its
    output must be the block the README shows after it."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    code, shown = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.S)[:2]
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == shown.strip()
