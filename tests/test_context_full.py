"""A full context ends a generation like its length limit would: the answer so far, the JSON and the
trace are kept, with the stop reason `context_full` (it used to be `error: context full` and nothing)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dgcli import cli
from native_helpers import requires_native

pytestmark = requires_native
runner = CliRunner()


def test_diffusion_keeps_every_canvas_that_fit(tiny_gguf):
    # end tokens ignored, so that the 256-token context (llama.cpp's minimum) fills whatever the random
    # model writes
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.params import DiffusionParams

    with DiffusionEngine(tiny_gguf, n_threads=1, n_ctx=64) as engine:
        n_ctx, canvas = engine.model.n_ctx, engine.model.canvas_length
        result = engine.generate("hi", params=DiffusionParams(max_denoising_steps=2), max_new_tokens=100 * n_ctx,
                                 seed=0, ignore_eos=True)
        assert result.stop_reason == "context_full" and not result.interrupted
        canvases = len(result.steps_per_canvas)
        # every canvas that fit: the prompt, the committed canvases and the last one's forward
        assert result.n_prompt_tokens + canvases * canvas <= n_ctx < result.n_prompt_tokens + (canvases + 2) * canvas
        assert engine.model.n_past + canvas <= n_ctx


def test_autoregressive_keeps_the_tokens_that_fit(tiny_ar_gguf):
    from dgcli.engine.autoregressive import AutoregressiveEngine

    with AutoregressiveEngine(tiny_ar_gguf, n_threads=1, n_ctx=64) as engine:
        n_ctx = engine.model.n_ctx
        result = engine.generate("hi", max_new_tokens=100 * n_ctx, ignore_eos=True)
        assert result.stop_reason == "context_full"
        assert result.n_prompt_tokens + result.n_new_tokens == n_ctx + 1  # the last token needs no forward


def test_generate_json_and_trace_are_kept_when_the_context_fills(tiny_gguf, tiny_ar_gguf, tmp_path):
    # the reproducer (`-n 2000` on the demo: error: context full, nothing printed); the demo
    # now ends such a prompt with a canvas of padding, so the random model and a 256-token context here,
    # its end tokens ignored (whether it writes one is its luck)
    trace = tmp_path / "t.jsonl"
    r = runner.invoke(cli.app, ["generate", "--json", "--trace", str(trace), "-n", "100000", "-c", "256",
                                "--steps", "2", "--seed", "0", "--ignore-eos", "-m", str(tiny_gguf), "hi"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["result"]["stop_reason"] == "context_full"
    assert doc["result"]["n_new_tokens"] > 0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines == doc["trace"]
    assert [e["canvas"] for e in lines if e["kind"] == "canvas"] == list(range(len(doc["result"]["steps_per_canvas"])))
    both = runner.invoke(cli.app, ["compare", "--json", "-n", "100000", "-c", "256", "--steps", "2", "--seed", "0",
                                   "--ignore-eos", "-m", str(tiny_gguf), "--ar-model", str(tiny_ar_gguf), "hi"])
    assert both.exit_code == 0, both.stderr
    sides = json.loads(both.stdout)
    assert [sides[s]["result"]["stop_reason"] for s in ("diffusion", "autoregressive")] == ["context_full"] * 2
    assert sides["ignore_eos"] is True


def test_compare_passes_ignore_eos_to_both_engines(tiny_gguf, tiny_ar_gguf, monkeypatch):
    """--ignore-eos reaches both engines (whether a random model writes an end token in a few tokens is its
    luck, so the engines' own arguments are checked), and without the flag neither gets it."""
    from dgcli.engine.autoregressive import AutoregressiveEngine
    from dgcli.engine.diffusion import DiffusionEngine

    seen = []
    for engine_class in (DiffusionEngine, AutoregressiveEngine):
        def recording(self, *args, _original=engine_class.generate, _name=engine_class.__name__, **kwargs):
            seen.append((_name, kwargs.get("ignore_eos", False)))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(engine_class, "generate", recording)
    for flag in (["--ignore-eos"], []):
        r = runner.invoke(cli.app, ["compare", "--json", "-n", "4", "--steps", "2", "--seed", "3", *flag,
                                    "-m", str(tiny_gguf), "--ar-model", str(tiny_ar_gguf), "hi"])
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["ignore_eos"] is bool(flag)
    assert seen == [("DiffusionEngine", True), ("AutoregressiveEngine", True),
                    ("DiffusionEngine", False), ("AutoregressiveEngine", False)]
