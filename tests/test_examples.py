"""The examples/ scripts run again over their own outputs: `make examples` twice, or one script twice,
gives fresh tables and figures (they passed their trace/report paths to dg without --force, so the
second run stopped at 'it exists; pass --force to replace it')."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from native_helpers import requires_native

REPO = Path(__file__).resolve().parents[1]

pytestmark = [requires_native, pytest.mark.subprocess]


def run_example(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, str(REPO / "examples" / script), "--out", str(out), "--threads", "1", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)


@pytest.mark.parametrize("script, args", [("exp_a_untrained.py", ["--steps", "4"]),
                                          ("exp_b_commit_waves.py", ["--prompt", "sort: BA"])])
def test_an_example_runs_twice_over_its_own_outputs(tmp_path, script, args):
    pytest.importorskip("matplotlib")
    for run in (1, 2):
        p = run_example(script, tmp_path, *args)
        assert p.returncode == 0, f"run {run}: {p.stderr[-2000:]}"
    assert not [f.name for f in tmp_path.iterdir() if f.name.endswith(".partial")]
