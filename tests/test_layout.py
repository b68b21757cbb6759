"""dgcli's layout: its modules import each other without circles and only downwards (the package map
in docs/design.md), no package hides one of its modules, and no module outgrows what a reader takes in.

The imports are read from the source (every `import` and `from ... import`, those inside functions
included), so an import that runs only on some path counts too; those under `if TYPE_CHECKING:`
never run and do not count (a type named in an annotation only). Importing `a.b.c` also runs the
packages `a` and `a.b` (their `__init__`), so those count as imported, except the importer's own
packages, which Python has already started when it gets there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dgcli"
MAX_MODULE_LINES = 700

# What each part of dgcli must not import (a module or package, and everything under it): the lower
# layers know nothing of the ones built on them, and only tests, benchmarks and training use the
# test builders. modelfile/info.py predicts a load, so it reads the runtime's placement rules and
# this machine's CPU and GPUs; the rest of modelfile is below the runtime.
_ABOVE_RUNTIME = ("dgcli.engine", "dgcli.convert", "dgcli.server", "dgcli.cli", "dgcli.bench", "dgcli.registry",
                  "dgcli.hub", "dgcli.testing")
NOT_IMPORTED_BY = {
    "dgcli.errors": ("dgcli",),
    "dgcli.units": ("dgcli",),
    "dgcli.params": ("dgcli.modelfile", "dgcli.templates", "dgcli.runtime", *_ABOVE_RUNTIME),
    "dgcli.modelfile": ("dgcli.templates", *_ABOVE_RUNTIME),
    "dgcli.modelfile.header": ("dgcli.runtime",),
    "dgcli.modelfile.hparams": ("dgcli.runtime",),
    "dgcli.modelfile.layout": ("dgcli.runtime",),
    "dgcli.templates": ("dgcli.modelfile", "dgcli.runtime", *_ABOVE_RUNTIME),
    "dgcli.runtime": _ABOVE_RUNTIME,
    "dgcli.engine": ("dgcli.convert", "dgcli.server", "dgcli.cli", "dgcli.bench", "dgcli.registry", "dgcli.hub",
                     "dgcli.testing"),
    "dgcli.convert": ("dgcli.templates", "dgcli.runtime", "dgcli.engine", "dgcli.server", "dgcli.cli",
                      "dgcli.testing"),
    "dgcli.server": ("dgcli.cli", "dgcli.testing"),
    "dgcli.cli": ("dgcli.testing",),
    "dgcli.bench": ("dgcli.cli", "dgcli.server", "dgcli.testing"),
    "dgcli.hub": ("dgcli.engine", "dgcli.runtime", "dgcli.cli", "dgcli.server", "dgcli.testing"),
    "dgcli.registry": ("dgcli.engine", "dgcli.runtime", "dgcli.cli", "dgcli.server", "dgcli.testing"),
}


def dgcli_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file for every module of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The dgcli modules that importing `module` runs: every `import` and `from ... import` in its body
    (relative ones resolved), with the packages above each. `from package import name` needs the
    package's __init__ when `name` is not a module of its own, even the importer's own package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    targets: set[str] = set()

    def with_packages(name: str) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            if target in modules and target not in own_packages:
                targets.add(target)

    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    type_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                 for stmt in node.body for sub in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                with_packages(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            with_packages(source)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    with_packages(f"{source}.{alias.name}")
                elif source in modules:  # a name the package's __init__ defines
                    targets.add(source)
    targets.discard(module)
    return targets


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the dgcli modules importing it runs (see the module docstring)."""
    return {module: imported_modules(module, path, modules) for module, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph(dgcli_modules()))
    assert not cycles, "import circles among dgcli modules: " + "; ".join(" <-> ".join(c) for c in cycles)


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for every import NOT_IMPORTED_BY forbids (the package itself, when
    forbidden whole, may still be the importer's own: `dgcli.errors` is under `dgcli`)."""
    out = []
    for module, targets in sorted(graph.items()):
        for part, forbidden in NOT_IMPORTED_BY.items():
            if not under(module, part):
                continue
            for target in sorted(targets):
                if target != "dgcli" and any(under(target, f) for f in forbidden) and not under(target, part):
                    out.append(f"{module} -> {target}")
    return out


def test_imports_go_down_the_layers():
    violations = layer_violations(import_graph(dgcli_modules()))
    assert not violations, "imports against the package map (docs/design.md): " + ", ".join(violations)


def test_the_layer_check_sees_the_runtime_importing_the_engine():
    graph = {"dgcli.runtime.model": {"dgcli.engine", "dgcli.engine.sampler", "dgcli.errors"},
             "dgcli.engine.sampler": {"dgcli.runtime.forward"}}
    assert layer_violations(graph) == ["dgcli.runtime.model -> dgcli.engine", "dgcli.runtime.model -> dgcli.engine.sampler"]


def test_the_cycle_finder_sees_a_circle_through_a_package_init(tmp_path):
    pkg = tmp_path / "dgcli"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from dgcli.high import thing\n")
    (pkg / "low" / "leaf.py").write_text("")
    (pkg / "high.py").write_text("def thing():\n    from dgcli.low.leaf import x\n")
    cycles = import_cycles(import_graph(dgcli_modules(pkg)))
    assert cycles == [["dgcli.high", "dgcli.low"]]
    (pkg / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dgcli.low.leaf import x\n")
    assert import_cycles(import_graph(dgcli_modules(pkg))) == []


def test_no_package_hides_a_module_of_its_own():
    """A name a package's __init__ defines (a def, class or assignment) that is also one of its modules
    replaces that module as the package's attribute once __init__ has run: `from package import name`
    then gets the function, or the module, depending on who imported first."""
    modules = dgcli_modules()
    hidden = []
    for package, path in modules.items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                continue
            hidden += [f"{package}.{name}" for name in names if f"{package}.{name}" in modules]
    assert not hidden, f"defined in a package's __init__ and also a module: {hidden}"


@pytest.mark.parametrize("module", sorted(dgcli_modules()))
def test_modules_stay_readable_in_size(module):
    lines = len(dgcli_modules()[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines (at most {MAX_MODULE_LINES}): split it by concern"


def test_files_named_beside_a_module_are_there():
    """`Path(__file__).with_name("worker.py")` and the like: a module that finds a file beside it by name
    (the template worker, run by its text; the server's page) still finds it after a move."""
    missing = []
    for module, path in dgcli_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "with_name"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                if not (path.parent / node.args[0].value).exists():
                    missing.append(f"{module}: {node.args[0].value}")
    assert not missing, f"named beside their module but not there: {missing}"

