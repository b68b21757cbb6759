"""benchmarks/gpu_check.py's pieces that need no GPU (the whole check runs with --cpu-dry-run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("dg_gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_check  # its dataclasses look their module up while being defined
_spec.loader.exec_module(gpu_check)


def test_partial_offload_settings_fit_the_model():
    # the real-size model: as asked
    assert gpu_check.partial_settings("15,-1", 30) == [15, -1]
    assert gpu_check.partial_settings("30", 30) == [30]
    # the dry run's two layers: 15 would be refused by the loader's check, half the layers is timed
    assert gpu_check.partial_settings("15,-1", 2) == [1, -1]
    assert gpu_check.partial_settings("", 2) == []


def test_each_step_saves_the_table_so_far(tmp_path):
    """A device run killed mid-check still leaves what it measured in $OUT."""
    import json

    check = gpu_check.Check(out=tmp_path, budget_s=60)
    check.step("one", lambda: check.add("one", "quantity", 1.5, "note"))
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [r["value"] for r in doc["rows"]] == ["1.5"]
    assert "| one | quantity | 1.5 | note |" in (tmp_path / "gpu-check.md").read_text()

    def failing():
        raise RuntimeError("no such device")

    assert check.step("two", failing) is False
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert doc["failed"] == ["two"] and doc["rows"][-1]["value"] == "RuntimeError"


@pytest.mark.subprocess
def test_sigterm_mid_check_writes_the_table_and_stops_the_writers(tmp_path):
    """The device tool's time limit arrives as SIGTERM: the check unwinds, kills its GGUF writers,
    removes their files and writes the table with a 'stopped' row, exit 143."""
    import json
    import os
    import signal
    import subprocess

    workdirs_before = set(Path("/tmp").glob("dg-gpu-check-*"))
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-dry-run", "--skip-tests",
                             "--n-layer", "2", "--reps", "1", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    for line in proc.stdout:
        if "] write ..." in line:  # the first step has begun: the writers are running
            break
    proc.send_signal(signal.SIGTERM)
    proc.stdout.read()
    assert proc.wait(timeout=60) == 143
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    sections = [r["section"] for r in doc["rows"]]
    assert "stopped" in sections and sections[-1] == "total"
    assert "stopped" in doc["failed"]
    assert set(Path("/tmp").glob("dg-gpu-check-*")) <= workdirs_before  # its temp dir is gone


def test_the_sampler_rate_says_which_seconds_it_divides_by(tiny_gguf, tmp_path, monkeypatch):
    # the row read "tok/s (one canvas, prefill + steps + commit)" beside "N tokens in total_s", but the
    # rate leaves the prefill out: over the seconds the note gave, the figure was too high
    from dgcli.runtime.model import DiffusionModel

    monkeypatch.setattr(gpu_check, "CANVAS", 16)
    check = gpu_check.Check(out=tmp_path, budget_s=60)
    with DiffusionModel(str(tiny_gguf)) as model:
        gpu_check.generate_once(check, model, "numpy")
    row = next(r for r in check.rows if r.quantity.startswith("tok/s"))
    assert "after the prefill" in row.quantity and "prefill +" not in row.quantity
    tokens, seconds = row.note.split(" tokens in ")[0], row.note.split(" tokens in ")[1].split(" s")[0]
    assert float(row.value) == pytest.approx(int(tokens) / float(seconds), rel=0.2, abs=0.2)
