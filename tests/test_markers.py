"""The kinds `make test-fast` leaves out must be marked on the tests that are of that kind: a test
that starts a process (or a pseudo-terminal) carries `subprocess` (or `pty`), here or on its module.

Read from the source: what a test calls, with the module's helpers and fixtures it names, followed
a few calls deep. A new test that spawns dg without the marker fails here instead of slowing the
edit loop down unnoticed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Tests that start a process only where something is missing, and are quick where the suite is set up.
ONLY_WHEN_MISSING = {
    "test_sampler.py": "native_sampler compiles the sampler's C++ source only where the library is not built",
}
SPAWNS = re.compile(r"subprocess\.(run|Popen|check_output|check_call|call)\(|\bos\.exec\w*\(|\bServeProcess\(|"
                    r"\.spawn\(|\bpty\.(fork|openpty)\(")


def marker_names(decorators: list[ast.expr]) -> set[str]:
    names = set()
    for node in decorators:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                names.add(sub.attr)
    return names


def module_markers(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return marker_names([node.value])
    return set()


def spawning_tests(path: Path) -> dict[str, set[str]]:
    """test name -> its markers (with the module's), for each test that starts a process."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    helpers = {node.name: ast.get_source_segment(source, node) for node in tree.body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    helpers.update({target.id: ast.get_source_segment(source, node) for node in tree.body if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Name)})

    def spawns(text: str, seen: set[str], depth: int = 0) -> bool:
        if SPAWNS.search(text):
            return True
        for name, body in helpers.items():
            if depth < 4 and name not in seen and re.search(rf"\b{re.escape(name)}\b", text):
                seen.add(name)
                if spawns(body, seen, depth + 1):
                    return True
        return False

    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            text = ast.get_source_segment(source, node) + " " + " ".join(a.arg for a in node.args.args)
            if spawns(text, {node.name}):
                out[node.name] = marker_names(node.decorator_list) | module_markers(tree)
    return out


def test_tests_that_start_processes_are_marked():
    unmarked = [f"{path.name}::{name}" for path in sorted(TESTS.glob("test_*.py"))
                if path.name not in ONLY_WHEN_MISSING and path != Path(__file__)
                for name, marks in spawning_tests(path).items() if not marks & {"subprocess", "pty"}]
    assert not unmarked, f"start a process but are not marked subprocess or pty (pyproject.toml): {unmarked}"


def test_the_check_sees_a_process_started_through_a_helper(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text("import subprocess, pytest\n\n"
                    "def _dg(*args):\n    return subprocess.run(['dg', *args])\n\n"
                    "def test_unmarked():\n    _dg('list')\n\n"
                    "@pytest.mark.subprocess\ndef test_marked():\n    _dg('list')\n\n"
                    "def test_in_process():\n    assert True\n")
    assert spawning_tests(path) == {"test_unmarked": set(), "test_marked": {"subprocess"}}
