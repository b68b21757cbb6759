"""The `dg` command line, driven for real (CliRunner and the installed console script): generate,
compare, bench, bad input (`dg list`, `info` and `pull`: test_cli_models.py).

Generation tests run the real DiffusionEngine loop over a small numpy model with the step-level API
(`ScriptedModel`), so they exercise the CLI's live view, plain streaming, JSON, trace and Ctrl-C
paths without the native layer; `test_cli_native.py` repeats the end-to-end runs through llama.cpp.
Every bad-input case asserts one `error:` line on stderr, a non-zero exit and no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from dgcli.cli import _errors, _models, _output
from dgcli.engine.diffusion import DiffusionEngine
from dgcli.engine.types import GenerationResult, TokenEvent
from dgcli.params import DiffusionParams

from cli_helpers import assert_one_line_error, run

ANSWER = "the answer is 8".split()


class ScriptedModel:
    """A step-level model whose decoder is confident about a fixed answer (or uniform: `confident=False`).

    Tokens: 0 pad, 1 <eos>, 2 <bos>, 3.. words. The answer's words sit at canvas positions 0..k-1, the end
    token at k, pad after it; confident logits put 12 nats on those ids (softcapped like the real model).
    """

    canvas_length = 8
    vocab_size = 32
    end_token_ids = (1,)
    pad_token_id = 0

    def __init__(self, confident: bool = True, n_ctx: int = 64, interrupt_at_step: int | None = None):
        self.words = ["<pad>", "<eos>", "<bos>"] + [f"w{i}" for i in range(3, self.vocab_size)]
        for i, w in enumerate(ANSWER):
            self.words[3 + i] = w
        self.confident, self.n_ctx, self.n_past = confident, n_ctx, 0
        self.default_params = DiffusionParams()
        self.interrupt_at_step = interrupt_at_step
        self.forwards = 0
        self.closed = False

    def tokenize(self, text, add_bos=True, special=True):
        return ([2] if add_bos else []) + [3 + (sum(map(ord, w)) % 20) for w in text.split()]

    def detokenize(self, ids, special=False):
        return " ".join(self.words[i] for i in ids if i > 2 or special)

    def chat_prompt(self, user_text):
        return self.tokenize(user_text)

    def reset(self):
        self.n_past = 0

    def prefill(self, tokens, return_logits=False):
        self.n_past += len(tokens)

    def commit(self, canvas):
        self.n_past += len(canvas)

    def decode_canvas(self, canvas, sc_logits=None):
        self.forwards += 1
        if self.interrupt_at_step is not None and self.forwards == self.interrupt_at_step:
            raise KeyboardInterrupt
        logits = np.zeros((self.canvas_length, self.vocab_size), np.float32)
        # Near-uniform, but with a word as argmax so an unconfident canvas still reads as text.
        logits[np.arange(self.canvas_length), 3 + np.arange(self.canvas_length) % 20] = 0.01
        if self.confident:
            target = [3 + i for i in range(len(ANSWER))] + [1] + [0] * (self.canvas_length - len(ANSWER) - 1)
            logits[np.arange(self.canvas_length), target] = 12.0
        return logits

    def close(self):
        self.closed = True


class ScriptedAr:
    """AR engine stand-in with the AutoregressiveEngine API: one TokenEvent per answer word."""

    def __init__(self, *args, **kwargs):
        self.closed = False
        self.model = ScriptedModel()

    def generate(self, prompt, max_new_tokens=256, seed=None, chat=True, temperature=0.0, on_event=None,
                 ignore_eos=False):
        ids = list(range(3, 3 + len(ANSWER)))[:max_new_tokens]
        for i, (tid, word) in enumerate(zip(ids, ANSWER)):
            if on_event:
                on_event(TokenEvent(index=i, token_id=tid, piece=(" " if i else "") + word, forward_s=0.001,
                                    sampling_s=0.0001))
        return GenerationResult(mode="autoregressive", text=" ".join(ANSWER[: len(ids)]), token_ids=ids,
                                n_prompt_tokens=3, decoder_forwards=len(ids), tokens_per_forward=1.0,
                                prefill_s=0.001, total_s=0.001 + 0.0011 * len(ids), forward_s=0.001 * len(ids),
                                sampling_s=0.0001 * len(ids), stop_reason="end_token")

    def close(self):
        self.closed = True


@pytest.fixture
def scripted(monkeypatch):
    """Route the CLI's engines to the scripted models; returns the list of models it opened."""
    opened = []

    def factory(**model_kwargs):
        def open_engine(path, threads=None, gpu_layers=0, **_):
            model = ScriptedModel(**model_kwargs)
            opened.append(model)
            engine = DiffusionEngine(model)
            engine.close = model.close  # the CLI must close what it opened
            return engine
        monkeypatch.setattr(_models, "open_diffusion_engine", open_engine)
        monkeypatch.setattr(_models, "open_ar_engine", lambda path, threads=None, gpu_layers=0, **_: ScriptedAr())
        monkeypatch.setattr(_models, "open_speed_model", lambda path, n, threads=None, gpu_layers=0, **_: ScriptedModel())
        return opened

    return factory


# ------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def bad_files(tmp_path, tiny_gguf):
    text = tmp_path / "notes.txt"
    text.write_text("just text")
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(Path(tiny_gguf).read_bytes()[:5000])
    return {"missing": tmp_path / "missing.gguf", "text": text, "trunc": trunc}


@pytest.mark.parametrize("command", ["generate", "info"])
def test_missing_notgguf_truncated_files(command, bad_files, scripted):
    scripted()
    prompt = ["hi"] if command == "generate" else []
    opt = ["-m"] if command == "generate" else []
    assert_one_line_error(run(command, *prompt, *opt, bad_files["missing"]), "not found")
    assert_one_line_error(run(command, *prompt, *opt, bad_files["text"]), "not a GGUF")
    assert_one_line_error(run(command, *prompt, *opt, bad_files["trunc"]), "truncated")


def test_generate_refuses_a_non_diffusion_gguf(tiny_ar_gguf, scripted):
    opened = scripted()
    assert_one_line_error(run("generate", "hi", "-m", tiny_ar_gguf), "'gemma4' model, not a DiffusionGemma")
    assert opened == []  # refused before loading


def test_unknown_registry_name_and_quant():
    assert_one_line_error(run("generate", "hi", "-m", "llama"), "unknown model 'llama'", "diffusiongemma-26b")
    assert_one_line_error(run("generate", "hi", "-m", "diffusiongemma-26b:Q3_K"), "unknown quant 'Q3_K'", "Q8_0")
    assert_one_line_error(run("pull", "gemma4-26b:Q9"), "unknown quant 'Q9'", "Q4_K_M, Q5_K_M, Q6_K, Q8_0")
    assert_one_line_error(run("generate", "hi", "-m", "gemma4-26b"), "is an autoregressive model; this needs a diffusion model")


@pytest.mark.parametrize("flags,fragment", [
    (["--steps", "0"], "invalid --steps 0"),
    (["--steps", "-3"], "invalid --steps -3"),
    (["--t-min", "0.9", "--t-max", "0.5"], "invalid --t-max 0.5: must be at least t_min (0.9)"),
    (["--temp", "0.5", "--t-min", "0.4"], "pass --temp or --t-min/--t-max, not both"),
    (["--temp", "-1"], "invalid --temp -1.0: must be 0 (greedy) or a number between"),
    (["--entropy-bound", "0"], "invalid --entropy-bound 0.0"),
    (["--entropy-bound", "-1"], "invalid --entropy-bound -1.0"),
    (["--confidence-threshold", "0"], "invalid --confidence-threshold 0.0"),
    (["--stability-threshold", "-1"], "invalid --stability-threshold -1"),
    (["--max-new-tokens", "0"], "invalid --max-new-tokens 0"),
    (["--threads", "0"], "invalid --threads 0"),
    (["--thinking", "maybe"], "invalid --thinking 'maybe'"),
    (["--steps", "many"], "Invalid value for '--steps'"),
])
def test_invalid_sampler_values(flags, fragment, tiny_gguf, scripted):
    opened = scripted()
    assert_one_line_error(run("generate", "hi", "-m", tiny_gguf, *flags), fragment)
    assert opened == []


def test_prompt_longer_than_the_context(tiny_gguf, monkeypatch):
    def open_engine(path, threads=None, gpu_layers=0, **_):
        return DiffusionEngine(ScriptedModel(n_ctx=16))
    monkeypatch.setattr(_models, "open_diffusion_engine", open_engine)
    r = run("generate", "word " * 20, "-m", tiny_gguf, "--no-live")
    assert_one_line_error(r, "prompt is 21 tokens", "exceeds the context of 16 tokens")


def test_model_too_big_for_memory(tiny_gguf, scripted, monkeypatch):
    opened = scripted()
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr("psutil.virtual_memory", lambda: VM(1024**2, 1024**2))
    assert_one_line_error(run("generate", "hi", "-m", tiny_gguf), "needs about", "this machine has 1.0 MB")
    assert opened == []


def test_missing_default_model_is_a_clear_error(monkeypatch, tmp_path):
    reg = tmp_path / "models.toml"
    reg.write_text('[models.demo]\nrole = "diffusion"\nshipped = "models/no-such-demo.gguf"\n')
    monkeypatch.setenv("DG_REGISTRY", str(reg))
    assert_one_line_error(run("generate", "hi"), "model 'demo' is not installed", "--model")


def test_no_prompt_and_empty_prompt(tiny_gguf, scripted):
    scripted()
    assert_one_line_error(run("generate", "   ", "-m", tiny_gguf), "empty prompt")
    assert_one_line_error(run("generate", "-", "-m", tiny_gguf, input=""), "empty prompt")


def test_unpulled_registry_model_without_tty_errors_instead_of_prompting(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert_one_line_error(run("generate", "hi", "-m", "diffusiongemma-26b:Q8_0"),
                          "not downloaded", "dg pull diffusiongemma-26b:Q8_0", "--yes")


# ------------------------------------------------------------------------------------------ generate


def test_generate_plain_streams_answer_and_step_lines(tiny_gguf, scripted):
    opened = scripted()
    r = run("generate", "what is 3+5", "-m", tiny_gguf, "--no-live", "--seed", "1")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "the answer is 8"
    assert "canvas 1  step 1/48  T=0.800" in r.stderr
    assert "[stop]" in r.stderr  # a confident model stops early
    assert "tokens/forward" in r.stderr and "stop=end_token" in r.stderr
    assert opened and opened[0].closed


def test_generate_prompt_from_stdin(tiny_gguf, scripted):
    scripted()
    r = run("generate", "-m", tiny_gguf, "--no-live", input="what is 3+5\n")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "the answer is 8"


def test_generate_json_schema(tiny_gguf, scripted):
    scripted()
    r = run("generate", "what is 3+5", "-m", tiny_gguf, "--json", "--steps", "20", "--seed", "3")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) >= {"model", "prompt", "params", "max_new_tokens", "seed", "answer", "thinking", "result", "trace"}
    assert doc["answer"] == "the answer is 8" and doc["thinking"] is None
    assert doc["params"]["max_denoising_steps"] == 20
    res = doc["result"]
    assert res["mode"] == "diffusion" and res["stop_reason"] == "end_token"
    assert res["n_new_tokens"] == len(ANSWER) and res["decoder_forwards"] == sum(res["steps_per_canvas"])
    steps = [e for e in doc["trace"] if e["kind"] == "step"]
    canvases = [e for e in doc["trace"] if e["kind"] == "canvas"]
    assert len(steps) == res["decoder_forwards"] and len(canvases) == len(res["steps_per_canvas"])
    first = steps[0]
    assert first["max_steps"] == 20 and abs(first["temperature"] - 0.8) < 1e-6
    assert len(first["argmax_canvas"]) == len(first["accepted"]) == ScriptedModel.canvas_length
    assert first["n_accepted"] == sum(first["accepted"])


def test_trace_file_holds_one_json_line_per_event(tiny_gguf, scripted, tmp_path):
    scripted(confident=False)
    trace = tmp_path / "run.jsonl"
    r = run("generate", "hi", "-m", tiny_gguf, "--no-live", "--trace", trace, "--steps", "6",
            "--max-new-tokens", "16", "--seed", "0")
    assert r.exit_code == 0, r.stderr
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    # An unconfident (uniform) model never stops early: every canvas runs all 6 steps, 1 token each.
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6] * 2
    assert all(e["n_accepted"] == 1 for e in steps)
    assert [e["kind"] for e in events].count("canvas") == 2
    assert list(tmp_path.iterdir()) == [trace]


def test_failure_mid_run_leaves_no_trace_file(tiny_gguf, tmp_path, monkeypatch):
    from dgcli.errors import DgError

    class Failing(ScriptedModel):
        def decode_canvas(self, canvas, sc_logits=None):
            if self.forwards >= 2:
                raise DgError("decoder failed")
            return super().decode_canvas(canvas, sc_logits)

    monkeypatch.setattr(_models, "open_diffusion_engine", lambda p, threads=None, gpu_layers=0, **_: DiffusionEngine(Failing(confident=False)))
    trace = tmp_path / "t.jsonl"
    r = run("generate", "hi", "-m", tiny_gguf, "--trace", trace, "--no-live")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == "error: decoder failed" and all(l.startswith("canvas 1  step") for l in lines[:-1])
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_trace_into_missing_directory(tiny_gguf, scripted, tmp_path):
    opened = scripted()
    assert_one_line_error(run("generate", "hi", "-m", tiny_gguf, "--trace", tmp_path / "no" / "t.jsonl"),
                          "does not exist")
    assert opened == []


def test_ctrl_c_prints_what_was_produced(tiny_gguf, scripted, tmp_path):
    # Interrupted on the decoder forward of the second canvas's first step: canvas 1 is committed.
    scripted(confident=False, interrupt_at_step=4)
    trace = tmp_path / "t.jsonl"
    r = run("generate", "hi", "-m", tiny_gguf, "--no-live", "--steps", "3", "--trace", trace)
    assert r.exit_code == _errors.EXIT_INTERRUPTED
    assert "interrupted" in r.stderr and "stop=interrupted" in r.stderr
    # The first canvas's text: the argmax words of its 8 positions (token ids 3..10).
    assert r.stdout.split() == ScriptedModel().words[3:3 + ScriptedModel.canvas_length]
    kinds = [json.loads(l)["kind"] for l in trace.read_text().splitlines()]
    assert kinds == ["header", "step", "step", "step", "canvas", "result"]  # the trace keeps what happened


# ------------------------------------------------------------------------------------------ compare / bench


def test_compare_table_and_speedup(tiny_gguf, tiny_ar_gguf, scripted):
    scripted()
    r = run("compare", "what is 3+5", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--no-live", "--seed", "0")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "--- diffusion ---" in out and "--- autoregressive ---" in out
    for row in ("new tokens", "wall time (s)", "tok/s", "forwards", "tokens/forward", "steps/canvas", "peak RSS",
                "speedup"):
        assert row in out
    doc = json.loads(run("compare", "what is 3+5", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--json").stdout)
    # dg-compare/1's AR tokens_per_second counted the prefill's token: a new meaning, a new number
    assert doc["schema"] == "dg-compare/3"
    d, a = doc["diffusion"]["result"], doc["autoregressive"]["result"]
    assert d["n_new_tokens"] == a["n_new_tokens"] == len(ANSWER)
    assert a["tokens_per_forward"] == 1.0 and d["tokens_per_forward"] > 1.0
    assert doc["speedup"] == pytest.approx(d["tokens_per_second"] / a["tokens_per_second"])
    assert doc["diffusion"]["peak_rss"] > 0 and doc["autoregressive"]["peak_rss"] > 0


@pytest.fixture(scope="module")
def q4_0_ar_gguf(tiny_ar_gguf, tmp_path_factory):
    """The AR twin, declaring itself a Q4_0 file (general.file_type 2), as Google's QAT GGUF does."""
    import gguf

    from native_helpers import rewrite_gguf

    return rewrite_gguf(tiny_ar_gguf, tmp_path_factory.mktemp("q4_0") / "ar-q4_0.gguf",
                        set_keys={"general.file_type": (2, gguf.GGUFValueType.UINT32)})


def test_compare_says_when_the_two_files_quantization_differs(tiny_gguf, tiny_ar_gguf, q4_0_ar_gguf, scripted):
    scripted()
    same = json.loads(run("compare", "hi", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--json").stdout)
    assert same["quantization"] == {"diffusion": "F32", "autoregressive": "F32", "match": True}
    r = run("compare", "hi", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--no-live")
    assert "quantization" in r.stdout and "differs" not in r.stdout
    doc = json.loads(run("compare", "hi", "-m", tiny_gguf, "--ar-model", q4_0_ar_gguf, "--json").stdout)
    assert doc["quantization"] == {"diffusion": "F32", "autoregressive": "Q4_0", "match": False}
    r = run("compare", "hi", "-m", tiny_gguf, "--ar-model", q4_0_ar_gguf, "--no-live")
    assert r.exit_code == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("│ quantization"))
    assert [c.strip() for c in row.split("│")[1:-1]] == ["quantization", "F32", "Q4_0"]
    assert "quantization differs: diffusion F32, AR Q4_0" in " ".join(r.stdout.split())


def test_bench_says_when_the_two_files_quantization_differs(tiny_gguf, tiny_ar_gguf, q4_0_ar_gguf, scripted):
    scripted()
    args = ("bench", "-m", tiny_gguf, "--repeat", "1", "--no-speed-model", "-n", "4")
    doc = json.loads(run(*args, "--ar-model", q4_0_ar_gguf, "--json").stdout)
    assert doc["config"]["quantization"] == {"diffusion": "F32", "autoregressive": "Q4_0", "match": False}
    assert doc["notes"][0].startswith("quantization differs: diffusion F32, AR Q4_0")
    r = run(*args, "--ar-model", q4_0_ar_gguf)
    assert r.exit_code == 0, r.stderr
    assert "diffusion:" in r.stdout and "(F32 vs Q4_0)" in r.stdout
    assert "quantization differs: diffusion F32, AR Q4_0" in " ".join(r.stdout.split())
    doc = json.loads(run(*args, "--ar-model", tiny_ar_gguf, "--json").stdout)
    assert doc["config"]["quantization"]["match"] is True and not any("quantization" in n for n in doc["notes"])


def test_compare_needs_an_ar_side_for_a_path_model(tiny_gguf, scripted):
    scripted()
    assert_one_line_error(run("compare", "hi", "-m", tiny_gguf), "no registry pair", "--ar-model")


def test_compare_refuses_diffusion_gguf_as_ar_side(tiny_gguf, scripted):
    scripted()
    assert_one_line_error(run("compare", "hi", "-m", tiny_gguf, "--ar-model", tiny_gguf), "is a diffusion model")


def test_bench_json_and_tables(tiny_gguf, tiny_ar_gguf, scripted, tmp_path, monkeypatch):
    scripted()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# comment\nmath\twhat is 3+5\nsay hi\n")
    out = tmp_path / "bench.json"
    r = run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--prompts", prompts, "--repeat", "2",
            "--no-speed-model", "--json", "-o", out)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["schema"] == "dg-bench/5"
    assert [p["name"] for p in doc["config"]["prompts"]] == ["math", "prompt-2"]
    assert len(doc["runs"]) == 2 * 2 * 2
    s = {(x["mode"], x["prompt"]): x for x in doc["summaries"]}
    assert s[("diffusion", "math")]["tokens_per_forward"]["n"] == 2
    assert s[("autoregressive", "math")]["tokens_per_forward"]["median"] == 1.0
    assert s[("autoregressive", "math")]["steps_per_canvas"] is None
    assert doc["speed_model"] is None
    from rich.console import Console

    monkeypatch.setattr(_output, "stdout", Console(highlight=False, width=80))
    table = run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--prompts", prompts, "--repeat", "2")
    assert table.exit_code == 0, table.stderr
    for col in ("prompt", "diffusion", "AR", "speedup", "steps/canvas", "tokens/forward", "answer tokens"):
        assert col in table.stdout
    # COLUMNS=80: no column cut to `diffu…` (the titles and captions are one line each, piped)
    assert max(len(line) for line in table.stdout.splitlines() if line[:1] in "┏┃┡│└") <= 80
    assert "…" not in table.stdout


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_bench_report_to_stdout_is_the_only_thing_there(json_flag, tiny_gguf, tiny_ar_gguf, scripted, tmp_path):
    # `-o -` with --json printed the report twice, without it the tables followed it: stdout was not JSON
    scripted()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("math\twhat is 3+5\n")
    r = run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--prompts", prompts, "--repeat", "1",
            "--no-speed-model", "-o", "-", *json_flag)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "dg-bench/5" and len(doc["runs"]) == 2
    if not json_flag:
        assert "steps/canvas" in r.stderr  # the tables are still shown, on stderr


def test_bench_with_stderr_piped_writes_nothing_there(tiny_gguf, tiny_ar_gguf, scripted, tmp_path):
    # the progress bar, shown nowhere into a pipe, still left a blank line on stderr when taken down
    scripted()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("math\twhat is 3+5\n")
    r = run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--prompts", prompts, "--repeat", "1",
            "--no-speed-model")
    assert r.exit_code == 0, r.stderr
    assert "steps/canvas" in r.stdout and r.stderr == ""


def test_tables_piped_have_their_title_and_caption_on_lines_of_their_own(tiny_gguf, tiny_ar_gguf, scripted):
    # piped, Rich centred each title and caption on its table's width (padded with spaces) and wrapped
    # a caption at that width, mid-sentence
    scripted()
    r = run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--repeat", "1", "--batch-sizes", "1,2",
            "--max-new-tokens", "8")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    for title in ("diffusion sampler per prompt", "speed model: one canvas step vs one decode step", "batch sweep"):
        assert title in lines, r.stdout
    # the caption names the self-conditioning form the runs fed back
    assert ("tokens/forward: answer tokens per forward, denoising steps and commit passes (AR: 1.00); answer tokens: "
            "diffusion/AR; self-conditioning: dense") in lines
    sweep = next(line for line in lines if "canvas, decode: one step of `batch` canvases" in line)
    assert sweep.endswith("@16 steps: the implied speedup without the commit pass"), r.stdout
    info = run("info", tiny_gguf).stdout.splitlines()
    assert "tensor types" in info and "sampler defaults (diffusion.eb_*)" in info, info


def test_bench_notes_piped_are_one_line_each_and_never_markup(tiny_gguf, tiny_ar_gguf, scripted, monkeypatch):
    # piped, a note longer than 120 columns was wrapped by Rich; its text went through Rich markup:
    # "[...]" in an error it quotes vanished, "[/x]" ended bench in MarkupError after every run
    from dgcli import bench as benchlib

    scripted()
    run_bench = benchlib.run_bench

    def with_a_note(*args, **kwargs):
        report = run_bench(*args, **kwargs)
        report.notes.append("batch 8 skipped: could not load m[/x] [bold]q.gguf")
        return report

    monkeypatch.setattr(benchlib, "run_bench", with_a_note)
    r = run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--repeat", "1", "--batch-sizes", "1,2",
            "--max-new-tokens", "8")
    assert r.exit_code == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: ")]
    assert "note: batch 8 skipped: could not load m[/x] [bold]q.gguf" in notes, r.stdout
    emulated = next(line for line in notes if line.startswith("note: batch sweep emulated"))
    assert emulated.endswith("vs b tokens (AR) on the same weights"), r.stdout


def test_bench_speed_model_over_batch_sizes(tiny_gguf, tiny_ar_gguf, scripted):
    scripted()
    r = run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--repeat", "1", "--batch-sizes", "1,2,4",
            "--max-new-tokens", "8", "--json")
    assert r.exit_code == 0, r.stderr
    sm = json.loads(r.stdout)["speed_model"]
    assert [p["batch"] for p in sm["batch_sweep"]] == [1, 2, 4]
    assert sm["canvas_length"] == ScriptedModel.canvas_length
    # the median of paired canvas/decode ratios, with its spread
    assert sm["ratio_min"] <= sm["ratio"] <= sm["ratio_max"]
    assert sm["ratio_min"] <= sm["canvas_forward_s"] / sm["decode_s"] <= sm["ratio_max"]
    assert [p["steps"] for p in sm["speedup_vs_steps"]][:3] == [1, 2, 4]
    assert "emulated" in sm["batch_method"]  # the scripted model has no multi-sequence forward


class MultiSeqModel(ScriptedModel):
    """Adds the native multi-sequence forward's API; records the shapes it was asked for."""

    def __init__(self, n_seq_max):
        super().__init__()
        self.n_seq_max, self.shapes = n_seq_max, []

    def decode_canvases(self, canvases, sc_logits=None):
        canvases = np.asarray(canvases)
        self.shapes.append(canvases.shape)
        return np.stack([self.decode_canvas(row)[: canvases.shape[1]] for row in canvases])


def test_bench_batch_sweep_uses_multi_sequence_forward(tiny_gguf, tiny_ar_gguf, scripted, monkeypatch):
    scripted()
    loaded = []

    def open_speed(path, n, threads=None, gpu_layers=0, **_):
        loaded.append(MultiSeqModel(n))
        return loaded[-1]

    monkeypatch.setattr(_models, "open_speed_model", open_speed)
    r = run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--repeat", "1", "--batch-sizes", "1,4",
            "--max-new-tokens", "8", "--json")
    assert r.exit_code == 0, r.stderr
    sm = json.loads(r.stdout)["speed_model"]
    assert sm["batch_method"].startswith("native multi-sequence")
    assert loaded[0].n_seq_max == 4 and loaded[0].closed
    C = ScriptedModel.canvas_length
    assert {(4, C), (4, 1)} <= set(loaded[0].shapes)  # b canvases vs b one-token rows
    # batch 1 is the speed model's own sample: one report never shows two different batch-1 ratios
    assert sm["batch_sweep"][0]["ratio"] == sm["ratio"]
    assert sm["ratio_min"] <= sm["ratio"] <= sm["ratio_max"]
    assert all(p["error"] is None for p in sm["batch_sweep"])


@pytest.mark.parametrize("flags,fragment", [
    (["--repeat", "0"], "invalid --repeat 0"),
    (["--batch-sizes", "1,x"], "invalid --batch-sizes"),
    (["--batch-sizes", "0"], "sizes must be integers >= 1"),
    # llama.cpp's limit: refused up front, not by the speed model's load after every generation run
    (["--batch-sizes", "1,300"], "sizes must be at most 256"),
    (["--prompts", "/nonexistent/prompts.txt"], "prompt file not found"),
])
def test_bench_bad_input(flags, fragment, tiny_gguf, tiny_ar_gguf, scripted):
    scripted()
    assert_one_line_error(run("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, *flags), fragment)



def test_serve_without_its_extra_names_the_install_that_works(monkeypatch):
    # it said `pip install 'dgcli[serve]'`: dg is installed from its checkout (`make demo`), not from an
    # index, so that line fetched nothing (or another project's package); the README says -e '.[serve]'
    monkeypatch.setitem(sys.modules, "starlette", None)  # import starlette -> ImportError
    r = run("serve", "--port", "0")
    assert_one_line_error(r, "dg serve needs its optional dependencies", "pip install -e '.[serve]'")
    assert "dgcli[serve]" not in r.stderr

# ------------------------------------------------------------------------------------------ console script


def _dg() -> str:
    exe = Path(sys.executable).parent / "dg"
    if exe.exists():
        return str(exe)
    found = shutil.which("dg")
    if not found:
        pytest.skip("the `dg` console script is not installed in this environment (pip install -e .)")
    return found


@pytest.mark.subprocess
def test_installed_console_script_info_and_errors(tiny_gguf, tmp_path):
    dg = _dg()
    env = dict(os.environ, COLUMNS="120")
    ok = subprocess.run([dg, "info", str(tiny_gguf), "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["architecture"] == "diffusion-gemma"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    for args, fragment in ((["generate", "hi", "-m", str(bad)], "truncated"),
                           (["generate", "hi", "-m", "nope"], "unknown model 'nope'"),
                           (["generate", "hi", "-m", str(tiny_gguf), "--steps", "0"], "invalid --steps 0")):
        p = subprocess.run([dg, *args], capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
        assert p.returncode == 1, (args, p.stderr)
        assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and fragment in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.parametrize("columns", ["abc", "0", "-5", ""])
@pytest.mark.subprocess
def test_a_columns_variable_that_is_no_width_is_ignored_when_piped(columns):
    """Piped, dg sizes its tables from COLUMNS: a value that is not a positive integer was a ValueError
    traceback before any command ran (even `dg --version`), or a width of 0 or less that printed
    nothing at all. Such a value is ignored, as Rich itself ignores it."""
    env = dict(os.environ, COLUMNS=columns, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-m", "dgcli.cli", "list"], capture_output=True, text=True, env=env,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "diffusiongemma-26b" in p.stdout and "demo" in p.stdout, p.stdout
