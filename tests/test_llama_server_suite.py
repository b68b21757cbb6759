"""llama-server's own tests (tools/server/tests/unit/test_chat_completion.py and test_completion.py of
the vendored llama.cpp, read from the sdist native/build.py builds from) run against `dg serve` in
their external-server mode (DEBUG_EXTERNAL=1, PORT), every path under /v1, no model downloads.
Every failure must be listed, with its reason, in docs/serve.md's table: a new failure fails this
test, and so does a listed failure that now passes (the table must then shrink)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from native_helpers import requires_native
from serve_helpers import ServeProcess
from vendored import extract_vendored

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("unit/test_chat_completion.py", "unit/test_completion.py")
NEEDED = ("starlette", "uvicorn", "openai", "requests", "filelock")
pytestmark = [requires_native, pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in NEEDED),
    reason=f"llama-server's tests need {', '.join(NEEDED)}: pip install -e '.[test]'")]

# llama-server's tests as a client of an external server: no model downloads (wget only does those),
# and every path under /v1, where dg serve answers
PLUGIN = '''
import sys, types
sys.modules.setdefault("wget", types.ModuleType("wget"))
import utils

def _v1_url(self, path, host=None):
    host = host or self.server_host.split(",")[0].strip()
    return f"http://{host}:{self.server_port}{path if path.startswith('/v1/') else '/v1' + path}"

utils.ServerPreset.load_all = staticmethod(lambda: None)
utils.ServerProcess.make_url = _v1_url
'''
ROW = re.compile(r"^\| `(test_\w+\.py)::(test_\w+)` \| (\d+) of (\d+) \|")


def documented_failures() -> dict[tuple[str, str], tuple[int, int]]:
    text = (ROOT / "docs" / "serve.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            rows[(match.group(1), match.group(2))] = (int(match.group(3)), int(match.group(4)))
    return rows


@pytest.mark.subprocess
def test_llama_servers_own_tests_pass_or_fail_for_a_documented_reason(tmp_path):
    suite = extract_vendored("tools/server/tests", tmp_path / "suite")
    (suite / "dg_external.py").write_text(PLUGIN, encoding="utf-8")
    report = tmp_path / "report.xml"
    with ServeProcess("--parallel", "4") as server:
        env = dict(os.environ, DEBUG_EXTERNAL="1", PORT=server.root.rsplit(":", 1)[1],
                   PYTHONPATH=str(suite), LLAMA_CACHE=str(tmp_path / "no-models"))
        run = subprocess.run([sys.executable, "-m", "pytest", "-p", "dg_external", "-p", "no:cacheprovider",
                              "-o", "addopts=", "-q", f"--junitxml={report}", *SUITES], cwd=suite, env=env,
                             capture_output=True, text=True, timeout=1800)
        log = list(server.stderr_lines)
    assert report.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    failed, total = Counter(), Counter()
    for case in ET.parse(report).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        key = (case.get("classname").split(".")[-1] + ".py", case.get("name").split("[")[0])
        total[key] += 1
        failed[key] += case.find("failure") is not None or case.find("error") is not None
    assert sum(total.values()) > 80, run.stdout[-3000:]  # the suites ran
    documented = documented_failures()
    found = {key: (failed[key], total[key]) for key in total if failed[key]}
    assert found == documented, (
        "llama-server's tests and docs/serve.md disagree:\n"
        + "\n".join(f"{f}::{t}: {found.get((f, t))} failing, documented {documented.get((f, t))}"
                    for f, t in sorted(set(found) | set(documented)) if found.get((f, t)) != documented.get((f, t))))
    assert not any("Traceback" in line or "internal error" in line for line in log), log[-20:]
