"""llama-cli's conventions in dg (issue 28 item 6): --n-gpu-layers, --n-predict, -n -1, -r/--stop,
-sys, dg info -m and -c, a default model from DG_MODEL, shell completion, and the demo's memory
estimate against what it uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dgcli.engine.diffusion import DiffusionEngine
from dgcli.engine.stops import first_stop, held_back, tokens_before
from dgcli.params import DiffusionParams

from cli_helpers import assert_one_line_error, run

REPO = Path(__file__).resolve().parent.parent


class Canvases:
    """A step-level model whose canvases (4 tokens) read a scripted text, a letter per token."""

    canvas_length, vocab_size = 4, 40
    end_token_ids, pad_token_id = (1,), 0

    def __init__(self, canvases):
        self.canvases, self.index, self.n_past, self.n_ctx = canvases, 0, 0, 64
        self.default_params = DiffusionParams(max_denoising_steps=4)
        self.commits = 0

    def detokenize(self, ids, special=False):
        return "".join(chr(ord("A") + int(t) - 10) for t in ids)

    def reset(self):
        self.n_past = 0

    def prefill(self, tokens):
        self.n_past += len(tokens)

    def commit(self, canvas):
        self.n_past, self.index, self.commits = self.n_past + len(canvas), self.index + 1, self.commits + 1

    def decode_canvas(self, canvas, sc_logits=None, sc_topk=None):
        logits = np.zeros((4, 40), np.float32)
        logits[np.arange(4), self.canvases[min(self.index, len(self.canvases) - 1)]] = 30.0
        return logits


def ids(text):
    return [ord(c) - ord("A") + 10 for c in text]


def test_stop_string_helpers():
    assert first_stop("ABCDEF", ["DE", "BC"]) == 1 and first_stop("ABC", ["X", ""]) == -1
    detok = Canvases([]).detokenize
    assert tokens_before(ids("ABCDEF"), detok, 3) == 3
    assert held_back("ABCTA", ["TAN", "Q"]) == 2 and held_back("ABC", ["X"]) == 0 and held_back("AB", ["ABC"]) == 2


def test_a_stop_string_ends_the_answer_before_it_even_across_canvases():
    model = Canvases([ids("ABCD"), ids("EFGH"), ids("IJKL")])
    result = DiffusionEngine(model, sampler="numpy").generate([2], max_new_tokens=12, seed=0, stop=["DEF"])
    assert result.stop_reason == "stop" and result.text == "ABC" and result.token_ids == ids("ABC")
    assert model.commits == 1  # the second canvas, where the stop string ends, is not committed
    model = Canvases([ids("ABCD"), ids("EFGH")])
    result = DiffusionEngine(model, sampler="numpy").generate([2], max_new_tokens=8, seed=0, stop=["XYZ"])
    assert result.stop_reason == "length" and result.text == "ABCDEFGH"


@pytest.mark.native
@pytest.mark.parametrize("flag", ["-r", "--reverse-prompt", "--stop"])
def test_generate_stops_at_a_reverse_prompt(flag):
    r = run("generate", "nato: QWERTY", "-s", "1", flag, "ROMEO", "--no-live")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.rstrip() == "QUEBEC WHISKEY ECHO" and "stop=stop" in r.stderr
    # a stop string that spans the two canvases: the first canvas's text holds back its start
    r = run("generate", "nato: QWERTY", "-s", "1", "--stop", "TANGO Y", "--no-live")
    assert r.exit_code == 0 and r.stdout.rstrip() == "QUEBEC WHISKEY ECHO ROMEO", r.stdout
    doc = json.loads(run("generate", "nato: QWERTY", "-s", "1", "--stop", "KEE", "--stop", "WHIS", "--json").stdout)
    assert doc["answer"] == "QUEBEC" and doc["result"]["stop_reason"] == "stop"


@pytest.mark.native
def test_chat_stops_each_answer_at_a_reverse_prompt():
    r = run("chat", "-s", "1", "-r", "TANGO", input="nato: QWERTY\n")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "QUEBEC WHISKEY ECHO ROMEO"


def test_an_empty_stop_string_is_refused(tiny_gguf):
    assert_one_line_error(run("generate", "hi", "-m", tiny_gguf, "--stop", ""), "empty --stop text")
    assert_one_line_error(run("generate", "hi", "-m", tiny_gguf, "-r", "x", "-r", ""), "empty -r text")
    assert_one_line_error(run("generate", "hi", "-m", tiny_gguf, "-sys", "x", "--raw"), "-sys needs the chat template")


@pytest.mark.native
def test_n_minus_1_runs_up_to_the_context():
    """-n -1: as many answer tokens as the context holds (llama-cli's); the demo answers long before."""
    r = run("generate", "nato: QWERTY", "-s", "1", "-n", "-1", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["max_new_tokens"] == -1 and doc["answer"] == "QUEBEC WHISKEY ECHO ROMEO TANGO YANKEE"
    # with --ignore-eos nothing ends it but the context: 1024 cells, less the prompt and a canvas of room
    r = run("generate", "sort: AB", "-s", "1", "-n", "-1", "--ignore-eos", "--steps", "1", "--json")
    result = json.loads(r.stdout)["result"]
    assert result["stop_reason"] == "context_full"
    assert result["n_prompt_tokens"] + len(result["steps_per_canvas"]) * 32 > 1024 - 2 * 32
    assert_one_line_error(run("generate", "hi", "-n", "-2"), "invalid -n -2: must be an integer >= 1, or -1")
    assert_one_line_error(run("bench", "-n", "-1"), "invalid -n -1: must be an integer >= 1")


@pytest.mark.native
def test_llama_cli_spellings_of_the_options():
    base = ["generate", "reverse: HELLO", "-s", "1", "--json"]
    short = json.loads(run(*base, "-n", "3", "-ngl", "0", "--system", "Be brief.").stdout)
    for spelled in (["--n-predict", "3", "--n-gpu-layers", "0", "-sys", "Be brief."],
                    ["--max-new-tokens", "3", "--gpu-layers", "0", "--system-prompt", "Be brief."]):
        doc = json.loads(run(*base, *spelled).stdout)
        assert (doc["max_new_tokens"], doc["system"], doc["answer"]) == (3, "Be brief.", short["answer"])


@pytest.mark.native
def test_dg_model_is_every_commands_default_model(monkeypatch, tiny_gguf):
    monkeypatch.setenv("DG_MODEL", str(tiny_gguf))
    info = json.loads(run("info", "--json").stdout)
    assert info["path"] == str(tiny_gguf)
    generated = run("generate", "hi", "-n", "2", "-s", "1", "--json")
    assert json.loads(generated.stdout)["model"]["path"] == str(tiny_gguf), generated.stderr
    assert json.loads(run("info", "demo", "--json").stdout)["path"].endswith("demo-diffusion.gguf")  # the argument wins
    monkeypatch.setenv("DG_MODEL", "nosuch")
    assert_one_line_error(run("generate", "hi"), "DG_MODEL=nosuch: unknown model 'nosuch'")


def test_dg_info_takes_m_and_defaults_to_the_demo(monkeypatch):
    monkeypatch.delenv("DG_MODEL", raising=False)
    default = json.loads(run("info", "--json").stdout)
    assert default["path"].endswith("demo-diffusion.gguf")
    by_m = json.loads(run("info", "-m", "demo-ar", "--json").stdout)
    assert by_m["path"].endswith("demo-ar.gguf")
    assert_one_line_error(run("info", "demo", "-m", "demo-ar"), "the model was given twice")
    assert_one_line_error(run("info", "-c", "-1"), "invalid -c -1")


def test_dg_info_c_counts_the_kv_cache_of_that_context(monkeypatch):
    monkeypatch.delenv("DG_MODEL", raising=False)
    plain = json.loads(run("info", "--json").stdout)
    small = json.loads(run("info", "-c", "1024", "--json").stdout)
    large = json.loads(run("info", "-c", "1000000", "--json").stdout)
    assert plain["kv_context"] is None and small["kv_context"] == 1024 and large["kv_context"] == 1000000
    assert plain["memory_needed"] < small["memory_needed"] < large["memory_needed"]
    assert json.loads(run("info", "-c", "0", "--json").stdout)["kv_context"] == 1024  # the training context
    assert "with a context of 1,000,000 tokens" in run("info", "-c", "1000000").stdout


@pytest.mark.subprocess
@pytest.mark.native
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak from Linux's /proc/self/status")
def test_the_demos_memory_estimate_is_what_a_run_uses_with_little_room(tmp_path):
    """It said 270.7 MB for a process that peaks near 80 MB; now the estimate covers the peak resident
    memory of a real run and is not far above it."""
    needed = json.loads(run("info", "--json").stdout)["memory_needed"]
    # VmHWM: this process image's peak (ru_maxrss keeps the forking parent's across exec: pytest's)
    script = ("import sys\nfrom dgcli.cli import main\nsys.argv = ['dg', 'generate', 'nato: QWERTY', '-s', '1']\n"
              "try:\n    main()\nexcept SystemExit:\n    pass\n"
              "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
              "print(int(hwm.split()[1]) * 1024, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    peak = int(r.stderr.strip().splitlines()[-1])
    assert peak <= needed <= 2 * peak, (peak, needed)


DG_SCRIPT = Path(sys.executable).with_name("dg")  # the console script: completion goes by the program's name


@pytest.mark.subprocess
@pytest.mark.skipif(not DG_SCRIPT.exists(), reason="needs dg installed as a console script (pip install -e .)")
def test_shell_completion_completes_commands_options_and_model_names(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), _DG_COMPLETE="complete_bash")

    def complete(words: str) -> list[str]:
        r = subprocess.run([str(DG_SCRIPT)], capture_output=True, text=True, timeout=60,
                           env=dict(env, COMP_WORDS=words, COMP_CWORD=str(len(words.split()) - 1)))
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert complete("dg gen") == ["generate"]
    assert {"--n-predict", "--n-gpu-layers", "--n-cpu-moe"} <= set(complete("dg generate --n-"))
    assert "gemma4-26b:Q8_0" in complete("dg generate -m gemma4") and "demo-ar" in complete("dg rm demo")
    script = subprocess.run([str(DG_SCRIPT), "--show-completion"], capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO), SHELL="/bin/bash"))
    assert "_DG_COMPLETE=complete_bash" in script.stdout and "complete -o default -F _dg_completion dg" in script.stdout
