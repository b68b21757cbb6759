"""A seeded subset of the malformed-GGUF fuzz harness (fuzz/fuzz_gguf.py): every run must end as a
clean one-line error or a completed run; no crash, hang, memory runaway or traceback.

The whole harness (750 mutants, about 1,500 runs) is a script, not part of the default run:
`python fuzz/fuzz_gguf.py` prints the table the README quotes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.native
@pytest.mark.parametrize("seed", [1])
def test_seeded_fuzz_subset_has_no_crash_hang_memory_or_traceback(tmp_path, seed):
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, str(REPO / "fuzz" / "fuzz_gguf.py"), "--sample", "16", "--seed", str(seed),
                           "--timeout", "120", "--quiet", "--json", str(out), "--keep", str(tmp_path / "bad")],
                          capture_output=True, text=True, timeout=1800, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.exists(), proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) >= 16
    bad = [r for r in runs if r["outcome"] not in ("clean", "completed")]
    assert not bad, proc.stdout[-4000:]
    assert {r["category"] for r in runs} >= {"hparam"}
