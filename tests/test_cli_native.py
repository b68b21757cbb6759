"""`dg` end to end through the native layer (our patched llama.cpp) on tiny random GGUFs.

Skipped, with the reason, until `python native/build.py` has installed the bindings. A random model
is the seed's EXP A: uniform entropy, one token accepted per step, no early stop.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dgcli import cli
from dgcli.cli import _models

AR_ENGINE = importlib.util.find_spec("dgcli.engine.autoregressive") is not None
pytestmark = pytest.mark.native
needs_ar = pytest.mark.skipif(not AR_ENGINE, reason="dgcli.engine.autoregressive not available yet")

runner = CliRunner()


def dg(*args):
    return runner.invoke(cli.app, [str(a) for a in args])


def test_generate_json_on_a_random_model_commits_one_token_per_step(tiny_gguf, tmp_path):
    trace = tmp_path / "t.jsonl"
    r = dg("generate", "what is 3+5", "-m", tiny_gguf, "--steps", "8", "--max-new-tokens", "32", "--seed", "0",
           "--threads", "1", "--json", "--trace", trace)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    res = doc["result"]
    steps = [e for e in doc["trace"] if e["kind"] == "step"]
    assert res["mode"] == "diffusion" and res["decoder_forwards"] == len(steps)
    assert all(e["n_accepted"] >= 1 for e in steps)
    assert [json.loads(line) for line in trace.read_text().splitlines()] == doc["trace"]
    # Untrained: entropy near uniform, so adaptive stopping does not fire before the cap.
    if res["stop_reason"] != "end_token":
        assert res["steps_per_canvas"] == [8] * len(res["steps_per_canvas"])


@pytest.mark.subprocess
def test_generate_plain_through_the_console_script(tiny_gguf):
    exe = Path(sys.executable).parent / "dg"
    if not exe.exists():
        pytest.skip("the `dg` console script is not installed (pip install -e .)")
    p = subprocess.run([str(exe), "generate", "hi", "-m", str(tiny_gguf), "--steps", "4", "--max-new-tokens", "16",
                        "--seed", "1", "--threads", "1"], capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL, env=dict(os.environ, COLUMNS="120"))
    assert p.returncode == 0, p.stderr
    assert "canvas 1  step 1/4" in p.stderr and "tokens/forward" in p.stderr


def test_prompt_longer_than_context_with_the_real_model(tiny_gguf, monkeypatch):
    from dgcli.engine.diffusion import DiffusionEngine

    opened = []

    def open_small_context(p, threads=None, gpu_layers=0, **_):
        # llama.cpp rounds n_ctx up (to 256 here): the message must quote the context actually used.
        opened.append(DiffusionEngine(str(p), n_threads=1, n_ctx=64))
        return opened[-1]

    monkeypatch.setattr(_models, "open_diffusion_engine", open_small_context)
    r = dg("generate", "word " * 200, "-m", tiny_gguf)
    n_ctx = opened[0].model.n_ctx
    assert n_ctx < 600
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and f"exceeds the context of {n_ctx} tokens" in r.stderr


@needs_ar
def test_compare_and_bench_on_the_tiny_pair(tiny_gguf, tiny_ar_gguf):
    r = dg("compare", "hi", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--steps", "4", "--max-new-tokens", "16",
           "--threads", "1", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["autoregressive"]["result"]["tokens_per_forward"] == 1.0
    assert doc["diffusion"]["result"]["decoder_forwards"] >= 1
    b = dg("bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "--repeat", "1", "--max-new-tokens", "16",
           "--steps", "4", "--batch-sizes", "1,2", "--threads", "1", "--json")
    assert b.exit_code == 0, b.stderr
    sm = json.loads(b.stdout)["speed_model"]
    assert sm["canvas_forward_s"] > 0 and sm["decode_s"] > 0 and [p["batch"] for p in sm["batch_sweep"]] == [1, 2]


def test_self_cond_top_k_flag_reaches_the_engine(tiny_gguf, tmp_path):
    # The tiny vocabulary is fed back densely by default; --self-cond-top-k 2 leaves mass out, and the
    # trace shows how much.
    dense = dg("generate", "hi", "-m", tiny_gguf, "--steps", "3", "--max-new-tokens", "16", "--seed", "0",
               "--threads", "1", "--json")
    sparse = dg("generate", "hi", "-m", tiny_gguf, "--steps", "3", "--max-new-tokens", "16", "--seed", "0",
                "--threads", "1", "--json", "--self-cond-top-k", "2")
    assert dense.exit_code == 0 and sparse.exit_code == 0, (dense.stderr, sparse.stderr)
    dense_mass = [s["sc_dropped_mass"] for s in json.loads(dense.stdout)["trace"] if s["kind"] == "step"]
    sparse_mass = [s["sc_dropped_mass"] for s in json.loads(sparse.stdout)["trace"] if s["kind"] == "step"]
    assert dense_mass == [0.0, 0.0, 0.0]
    assert sparse_mass[0] == 0.0 and all(m > 0.0 for m in sparse_mass[1:])
    bad = dg("generate", "hi", "-m", tiny_gguf, "--self-cond-top-k", "-1")
    assert bad.exit_code == 1 and "invalid --self-cond-top-k -1" in bad.stderr
