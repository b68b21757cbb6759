"""What a run reports (issue 28 items 3 and 4): an interrupted canvas adds only what it had accepted,
marked unfinished; forwards count every model pass, the commit passes included, alike in every
command and the JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dgcli.cli import _errors, _models
from dgcli.engine.diffusion import DiffusionEngine
from dgcli.params import DiffusionParams

from cli_helpers import run

END, PAD = 1, 0


class HalfSettledModel:
    """A canvas of 8 whose first step settles positions 0-3 (word ids 3-6, 20 nats ahead), leans
    towards a word at 4 (1.5 nats) and 6 (1 nat) and knows nothing at 5 and 7 (flat, argmax 0: a pad):
    the entropy bound accepts 0-3 and the next-lowest entropy, 4, but not 5, 6, 7. The second forward
    is interrupted (Ctrl-C)."""

    canvas_length, vocab_size = 8, 16
    end_token_ids, pad_token_id = (END,), PAD

    def __init__(self, interrupt_at_forward: int = 2):
        self.default_params = DiffusionParams(max_denoising_steps=10)
        self.interrupt_at_forward, self.forwards, self.n_past, self.n_ctx = interrupt_at_forward, 0, 0, 256

    def tokenize(self, text, add_bos=True, special=True):
        return [2, 3]

    def chat_prompt(self, text):
        return [2, 3]

    def detokenize(self, ids, special=False):
        return "".join(f"w{int(t)} " for t in ids)

    def reset(self):
        self.n_past = 0

    def prefill(self, tokens):
        self.n_past += len(tokens)

    def commit(self, canvas):
        self.n_past += len(canvas)

    def decode_canvas(self, canvas, sc_logits=None, sc_topk=None):
        self.forwards += 1
        if self.forwards == self.interrupt_at_forward:
            raise KeyboardInterrupt
        logits = np.zeros((8, 16), np.float32)
        logits[np.arange(4), np.arange(3, 7)] = 20.0
        logits[4, 7], logits[6, 9] = 1.5, 1.0
        return logits

    def close(self):
        pass


def test_an_interrupted_canvas_adds_only_its_settled_start():
    result = DiffusionEngine(HalfSettledModel(), sampler="numpy").generate([2, 3], max_new_tokens=64, seed=0)
    assert result.interrupted and result.steps_per_canvas == [1]
    # its argmax canvas is w3..w7, pad, w9, pad: the answer took w9 too, never accepted; now it stops at
    # the first position the step did not accept (5)
    assert result.token_ids == [3, 4, 5, 6, 7] and result.unfinished_tokens == 5
    assert result.text == "w3 w4 w5 w6 w7 " and result.n_new_tokens == 5


def test_an_interrupted_canvas_whose_first_position_is_unsettled_adds_nothing():
    class Unsure(HalfSettledModel):
        def decode_canvas(self, canvas, sc_logits=None, sc_topk=None):
            logits = super().decode_canvas(canvas)
            logits[0] = 0.0  # position 0 flat: 1-3 are accepted, and 4, but not 0
            logits[5, 3] = logits[7, 3] = 1.0
            return logits

    result = DiffusionEngine(Unsure(), sampler="numpy").generate([2, 3], max_new_tokens=64, seed=0)
    assert result.interrupted and result.token_ids == [] and result.unfinished_tokens == 0


@pytest.fixture
def half_settled(monkeypatch):
    def open_engine(path, **_):
        return DiffusionEngine(HalfSettledModel(), sampler="numpy")

    monkeypatch.setattr(_models, "open_diffusion_engine", open_engine)


def test_generate_prints_and_counts_only_the_accepted_tokens_marked_unfinished(half_settled, tiny_gguf, tmp_path):
    trace = tmp_path / "t.jsonl"
    r = run("generate", "hi", "-m", tiny_gguf, "--no-live", "--trace", trace)
    assert r.exit_code == _errors.EXIT_INTERRUPTED
    assert r.stdout == "w3 w4 w5 w6 w7 \n"  # positions never accepted (w3 at 5, w9 at 6) are not there
    summary = [line for line in r.stderr.splitlines() if "new tokens" in line]
    assert len(summary) == 1 and summary[0].startswith("5 new tokens")
    assert "interrupted; the last 5 tokens are what unfinished canvas 1 had accepted" in summary[0]
    result = json.loads(trace.read_text().splitlines()[-1])
    assert result["kind"] == "result" and result["unfinished_tokens"] == 5 and result["n_new_tokens"] == 5

    r = run("generate", "hi", "-m", tiny_gguf, "--json")
    assert r.exit_code == _errors.EXIT_INTERRUPTED
    doc = json.loads(r.stdout)
    assert doc["answer"] == "w3 w4 w5 w6 w7" and doc["result"]["unfinished_tokens"] == 5


@pytest.mark.native
def test_forwards_count_the_commit_passes_in_every_command(tmp_path):
    """`nato: QWERTY` at seed 1 is two canvases on the demo: 7 steps and the commit of the first."""
    generated = json.loads(run("generate", "nato: QWERTY", "-s", "1", "--json").stdout)["result"]
    steps = sum(generated["steps_per_canvas"])
    assert len(generated["steps_per_canvas"]) == 2
    assert generated["decoder_forwards"] == steps and generated["commit_forwards"] == 1
    assert generated["forwards"] == steps + 1
    assert generated["tokens_per_forward"] == pytest.approx(generated["n_new_tokens"] / (steps + 1))

    plain = run("generate", "nato: QWERTY", "-s", "1", "--no-live")
    assert f"{steps + 1} forwards ({steps} steps + 1 commit)" in plain.stderr
    assert f"{generated['tokens_per_forward']:.2f} tokens/forward" in plain.stderr

    compared = json.loads(run("compare", "nato: QWERTY", "-s", "1", "--json").stdout)
    d, a = compared["diffusion"]["result"], compared["autoregressive"]["result"]
    assert (d["forwards"], d["commit_forwards"]) == (steps + 1, 1)
    assert a["commit_forwards"] == 0 and a["forwards"] == a["decoder_forwards"]
    table = run("compare", "nato: QWERTY", "-s", "1", "--no-live").stdout
    rows = {cells[0]: cells[1:] for line in table.splitlines() if line.count("│") == 4
            for cells in [[c.strip() for c in line.split("│")[1:4]]]}
    assert rows["forwards"] == [str(steps + 1), str(a["forwards"])] and rows["of them commits"] == ["1", "0"], table

    prompts = tmp_path / "p.tsv"
    prompts.write_text("nato\tnato: QWERTY\n")
    bench = json.loads(run("bench", "--prompts", prompts, "--repeat", "1", "-s", "1", "--no-speed-model",
                           "--json").stdout)
    run_d = next(r for r in bench["runs"] if r["mode"] == "diffusion")
    assert run_d["commit_forwards"] == 1 and run_d["decoder_forwards"] == steps
    assert run_d["tokens_per_forward"] == pytest.approx(run_d["n_new_tokens"] / (steps + 1))
