"""The architecture, written once: which of qtp's packages may import which, checked on every module.

Every module of ``qtp/`` is read with ``ast``; each import (at module level or inside a function, absolute
or relative) is resolved to the qtp *unit* it reaches, and an import against ``ALLOWED`` fails the test
with the file, the line, the import and the rule. The direction is shared/ARCHITECTURE.md's:
runtime -> protocol + codec + store -> coordinator -> xa; recovery uses the coordinator, never messaging;
the transaction manager knows nothing of messaging (the node attaches itself, as recovery registers
itself). The ``qtp`` command's modules never import one another; what they share is in ``qtp._render``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

QTP = Path(__file__).resolve().parent.parent / "qtp"
ANY = frozenset({"*"})

ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "_failures": frozenset(),  # what a retrying loop says while its work fails: below every layer that loops
    "_version": frozenset(),  # the version string alone
    "config": frozenset({"errors"}),
    "xa": frozenset({"errors"}),
    "coordinator": frozenset({"errors", "config", "xa", "_failures"}),
    "recovery": frozenset({"errors", "config", "xa", "coordinator", "_render", "_failures"}),
    "wsrm": frozenset(),
    "wsrm.protocol": frozenset({"errors"}),
    "wsrm.codec": frozenset({"errors", "wsrm.protocol"}),
    "wsrm.store": frozenset({"errors", "wsrm.protocol"}),
    "wsrm.runtime": frozenset({"errors", "config", "xa", "coordinator", "wsrm.protocol", "wsrm.codec", "wsrm.store",
                               "_render", "_version", "_failures"}),
    "coupled": frozenset({"errors", "config", "xa", "coordinator", "wsrm.store", "wsrm.runtime", "_render"}),
    "reconcile": frozenset({"errors", "_failures"}),
    "embedded": frozenset({"errors"}),
    "_render": frozenset({"errors", "config"}),
    "qtp": frozenset({"errors", "coordinator", "recovery", "wsrm.runtime", "_version"}),  # the public API re-exported
    "cli": frozenset({"errors", "_version"}),  # loads the command modules by name (importlib), never by import
    "__main__": frozenset({"cli"}),
    "db_cli": frozenset({"errors", "embedded"}),
    "status_cli": frozenset({"errors", "config", "_render", "recovery", "wsrm.runtime", "coupled"}),
    "testing": ANY,  # test and campaign tooling, above everything
    "demo": ANY,     # the show cases, above everything
}
COMMAND_MODULES = {"qtp.coupled.cli", "qtp.db_cli", "qtp.reconcile.cli", "qtp.recovery.cli", "qtp.status_cli", "qtp.wsrm.runtime.cli"}


@dataclass(frozen=True)
class Import:
    module: str   # the importing module
    target: str   # the qtp module (or package) it reaches
    path: Path
    line: int


def module_name(path: Path, root: Path = QTP) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The unit of a qtp module: its subpackage (``wsrm.X`` for the messaging layers), its own name for a
    top-level module, ``qtp`` for the package root."""
    parts = module.split(".")[1:]
    if not parts:
        return "qtp"
    if parts[0] == "wsrm" and len(parts) > 1:
        return f"wsrm.{parts[1]}"
    return parts[0]


def imports_of(path: Path, root: Path = QTP) -> list[Import]:
    """Every import of qtp in the module at ``path``, wherever it stands, resolved to a module name."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = {module_name(p, root) for p in root.rglob("*.py")}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found += [Import(module, t, path, node.lineno) for t in dict.fromkeys(targets)
                  if t == "qtp" or t.startswith("qtp.")]
    return found


def violations(root: Path = QTP) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        for imp in imports_of(path, root):
            source, target = unit(imp.module), unit(imp.target)
            allowed = ALLOWED.get(source)
            if allowed is None:
                problems.append(f"{imp.path}:{imp.line}: {imp.module} belongs to no unit of the table; add "
                                f"{source!r} to ALLOWED in tests/test_layers.py")
            elif target != source and allowed is not ANY and target not in allowed:
                problems.append(f"{imp.path}:{imp.line}: {imp.module} imports {imp.target}: {source} may import "
                                f"only {', '.join(sorted(allowed)) or 'nothing of qtp'}")
            if imp.module in COMMAND_MODULES and imp.target in COMMAND_MODULES - {imp.module}:
                problems.append(f"{imp.path}:{imp.line}: command module {imp.module} imports command module "
                                f"{imp.target}; share code through qtp._render instead")
    return problems


def test_every_import_goes_the_allowed_way():
    assert violations() == []


def test_the_check_reads_every_module_and_their_imports():
    modules = list(QTP.rglob("*.py"))
    found = [imp for path in modules for imp in imports_of(path)]
    assert len(modules) >= 80 and len(found) > 200
    assert {unit(module_name(p)) for p in modules} <= set(ALLOWED)
    inner = [i for i in found if i.module == "qtp.wsrm.runtime._node" and i.target == "qtp.config"]
    assert inner, "imports inside functions are read too"


@pytest.mark.parametrize(("source", "line", "rule"), [
    ("qtp/coordinator/_m.py", "def f():\n    from qtp.wsrm.runtime import Node\n", "coordinator may import only"),
    ("qtp/recovery/cli.py", "from qtp.wsrm.runtime.cli import x\n", "recovery may import only"),
    ("qtp/wsrm/runtime/cli.py", "from qtp.recovery.cli import _table\n", "command module"),
    ("qtp/wsrm/protocol/_m.py", "from ..codec import encode\n", "wsrm.protocol may import only"),
    ("qtp/xa/_m.py", "import qtp.coordinator._log\n", "xa may import only"),
])
def test_the_checker_refuses_a_wrong_import(tmp_path, source, line, rule):
    """The checker itself, on a small tree with one import against the table (the old circles among them)."""
    root = tmp_path / "qtp"
    for package in ("coordinator", "recovery", "xa", "wsrm", "wsrm/runtime", "wsrm/protocol", "wsrm/codec"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    for existing in ("wsrm/runtime/cli.py", "recovery/cli.py"):
        (root / existing).write_text("")
    (tmp_path / source).write_text(line)
    found = violations(root)
    assert any(rule in problem for problem in found), found


def test_the_same_tree_with_allowed_imports_passes(tmp_path):
    root = tmp_path / "qtp"
    (root / "wsrm" / "runtime").mkdir(parents=True)
    for init in (root, root / "wsrm", root / "wsrm" / "runtime"):
        (init / "__init__.py").write_text("")
    (root / "wsrm" / "runtime" / "_m.py").write_text("from qtp.coordinator import install\nimport qtp.errors\n")
    assert violations(root) == []


# ------------------------------------------------------------------ no circle inside the runtime

RUNTIME = "qtp.wsrm.runtime"


def runtime_cycles(root: Path = QTP) -> list[list[str]]:
    """The import circles among the runtime's modules (every import counts, wherever it stands: one inside a
    function or under TYPE_CHECKING is a dependency too). The node assembles the workers; no worker reaches
    another by importing it back."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / "wsrm" / "runtime").rglob("*.py")):
        module = module_name(path, root)
        graph.setdefault(module, set())
        for imp in imports_of(path, root):
            if imp.target.startswith(RUNTIME + ".") and imp.target != module:
                graph[module].add(imp.target)
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            cycles.append(trail[trail.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, trail + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def test_no_runtime_module_imports_itself_back():
    assert runtime_cycles() == []


def test_the_cycle_check_finds_a_circle_put_back(tmp_path):
    """The Sender reaching the Receiver again, and the Receiver the Sender: the circle the ports removed."""
    root = tmp_path / "qtp"
    runtime = root / "wsrm" / "runtime"
    runtime.mkdir(parents=True)
    for init in (root, root / "wsrm", runtime):
        (init / "__init__.py").write_text("")
    (runtime / "_sender.py").write_text("def f():\n    from qtp.wsrm.runtime._receiver import Receiver\n")
    (runtime / "_receiver.py").write_text("from qtp.wsrm.runtime._sender import Sender\n")
    (runtime / "_node.py").write_text("from qtp.wsrm.runtime._sender import Sender\n")
    cycles = runtime_cycles(root)
    assert len(cycles) == 1 and set(cycles[0]) == {"qtp.wsrm.runtime._receiver", "qtp.wsrm.runtime._sender"}
