"""`dg replay` on trace files that are damaged, hand-edited or from another dg version: one `error:`
line naming the line and exit 1, never a traceback (each case below ended in one before)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dgcli import cli

runner = CliRunner()

HEADER = {"kind": "header", "schema": "dg-trace/1", "model": {"name": "demo", "path": "demo.gguf"},
          "prompt": "reverse: AB", "canvas_length": 4, "end_token_ids": [1], "pad_token_id": 0}
STEP = {"kind": "step", "canvas": 0, "step": 1, "max_steps": 48, "temperature": 0.8,
        "argmax_canvas": [7, 8, 1, 0], "accepted": [True, True, True, True], "n_accepted": 4,
        "mean_entropy": 0.01, "forward_s": 0.01, "sampling_s": 0.001, "stopped": True,
        "pieces": {"7": "B", "8": "A", "1": "<eos>", "0": "<pad>"}}
CANVAS = {"kind": "canvas", "canvas": 0, "token_ids": [7, 8], "steps": 1, "commit_s": 0.0, "text": "BA"}
RESULT = {"kind": "result", "mode": "diffusion", "text": "BA", "token_ids": [7, 8], "n_prompt_tokens": 9,
          "steps_per_canvas": [1], "decoder_forwards": 1, "tokens_per_forward": 2.0, "prefill_s": 0.01,
          "total_s": 0.03, "forward_s": 0.01, "sampling_s": 0.001, "stop_reason": "end_token",
          "interrupted": False, "seed": 1, "display_s": 0.0, "n_cached_prompt_tokens": 0}


def write(tmp_path, header=HEADER, step=STEP, canvas=CANVAS, result=RESULT):
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (header, step, canvas, result)))
    return path


def replay(path):
    return runner.invoke(cli.app, ["replay", str(path), "--pace", "0", "--no-live"])


def test_a_well_formed_hand_written_trace_replays(tmp_path):
    r = replay(write(tmp_path))
    assert r.exit_code == 0, (r.stderr, r.exception)
    assert r.stdout == "BA\n" and "recorded: 2 new tokens" in r.stderr


@pytest.mark.parametrize("change, where, fragment", [
    (dict(header={**HEADER, "end_token_ids": 1}), ":1:", "end_token_ids must be a list of token ids"),
    (dict(header={**HEADER, "end_token_ids": "ab"}), ":1:", "end_token_ids must be a list of token ids"),
    (dict(header={**HEADER, "model": "demo"}), ":1:", "model must be an object with a name"),
    (dict(header={**HEADER, "pad_token_id": "x"}), ":1:", "pad_token_id must be a token id"),
    (dict(step={**STEP, "argmax_canvas": [10**30] * 4}), ":2:", "malformed step line"),
    (dict(step={**STEP, "pieces": ["B", "A"]}), ":2:", "pieces must be an object"),
    # a step line's figures were shown as they were: "T=nan", "accepted 99/4", "step 1/0", "canvas -4"
    (dict(step={**STEP, "temperature": float("nan")}), ":2:", "temperature must be a finite number >= 0"),
    (dict(step={**STEP, "n_accepted": 99}), ":2:", "n_accepted 99 is more than the canvas's 4 tokens"),
    (dict(step={**STEP, "max_steps": 0}), ":2:", "max_steps must be an integer >= 1"),
    (dict(step={**STEP, "step": 49}), ":2:", "step 49 is past max_steps 48"),
    (dict(step={**STEP, "canvas": -5}), ":2:", "canvas must be an integer >= 0"),
    (dict(step={**STEP, "step": "1"}), ":2:", "step must be an integer >= 1"),
    (dict(result={**RESULT, "steps_per_canvas": 1}), ":4:", "steps_per_canvas must be a list of integers"),
    (dict(result={**RESULT, "total_s": None}), ":4:", "total_s must be a finite number"),
    # JSON as Python reads it takes NaN and Infinity: the recorded summary showed "nan tok/s"
    (dict(result={**RESULT, "tokens_per_forward": float("nan")}), ":4:", "tokens_per_forward must be a finite number"),
    (dict(result={**RESULT, "total_s": float("inf")}), ":4:", "total_s must be a finite number"),
    (dict(result={**RESULT, "token_ids": ["B"]}), ":4:", "token_ids must be a list of integers"),
    # the recorded summary's tok/s subtracts it: a string ended replay in a TypeError
    (dict(result={**RESULT, "prefill_answer_tokens": "1"}), ":4:", "prefill_answer_tokens must be an integer >= 0"),
    # more than the answer's tokens: the recorded summary read "0 new tokens in 0.04s  -77.3 tok/s"
    (dict(result={**RESULT, "token_ids": [], "text": "", "prefill_answer_tokens": 3}), ":4:",
     "prefill_answer_tokens 3 is more than the answer's 0 tokens"),
])
def test_a_malformed_field_is_one_error_line_naming_the_line(tmp_path, change, where, fragment):
    r = replay(write(tmp_path, **change))
    assert r.exit_code == 1, (r.stdout, r.stderr, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert f"run.jsonl{where}" in lines[0] and fragment in lines[0], lines[0]


def test_a_trace_of_a_newer_schema_says_so(tmp_path):
    r = replay(write(tmp_path, header={**HEADER, "schema": "dg-trace/3"}))
    assert r.exit_code == 1
    assert r.stderr.strip() == ("error: " + str(tmp_path / "run.jsonl") + " is a dg-trace/3 trace, which this dg "
                                "cannot read (it reads dg-trace/1 and dg-trace/2; a newer dg wrote it?)")


def test_a_trace_from_stdin_or_a_pipe(tmp_path):
    """`dg replay -` reads the trace from stdin (`dg generate --trace - | dg replay -`), and a pipe's
    path (`<(...)`) is read as a file is; an empty stdin is one error line."""
    import os
    import threading

    text = write(tmp_path).read_text()
    r = runner.invoke(cli.app, ["replay", "-", "--pace", "0", "--no-live"], input=text)
    assert r.exit_code == 0, (r.stderr, r.exception)
    assert r.stdout.strip() == "BA" and "recorded: 2 new tokens" in r.stderr

    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=(text,))
    writer.start()
    r = runner.invoke(cli.app, ["replay", str(fifo), "--pace", "0", "--no-live"])
    writer.join()
    assert r.exit_code == 0 and r.stdout.strip() == "BA", (r.stderr, r.exception)

    r = runner.invoke(cli.app, ["replay", "-", "--no-live"], input="")
    assert r.exit_code == 1 and r.stderr.strip() == "error: stdin is empty"


def test_a_trace_cut_off_mid_line_replays_up_to_the_cut(tmp_path):
    """`dg generate --trace - > run.jsonl` killed while writing a line: the lines before it replay, and
    stderr says the end was cut (this was `error: run.jsonl:4: not JSON`, nothing replayed); a damaged
    line that is not the last is still an error."""
    path = write(tmp_path)
    whole = path.read_text()
    path.write_text(whole[:whole.rindex('"stop_reason"')])  # inside the result line
    r = replay(path)
    assert r.exit_code == 0, (r.stderr, r.exception)
    assert r.stdout == "BA\n"
    assert r.stderr.strip().splitlines()[-1] == ("the trace ends in a cut-off line (its run stopped while "
                                                 "writing it); replayed up to there")

    lines = whole.splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:40] + "\n" + "".join(lines[2:]))
    r = replay(path)
    assert r.exit_code == 1 and r.stderr.startswith(f"error: {path}:2: not JSON"), r.stderr
