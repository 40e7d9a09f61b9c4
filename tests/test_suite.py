"""The suite's own layout, read from the source: what the tests share lives in ``tests/support``,
never in another test module; every run in processes of its own (marked ``process`` or
``faults``) sits in ``tests/e2e`` and nothing else does; the benchmarks import nothing from the
tests (what both measure with lives in ``benchmarks``; ``tests/support`` imports it). And the
package's: no module is longer than 600 lines, and its imports form no cycle and go only down
its floors; importing it loads neither DTensor nor DCP, which every rank of a run would pay
for (over half a second each) without tensor parallelism or a DCP checkpoint.
Run: ``pytest tests/test_suite.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import ROOT

pytestmark = pytest.mark.stage3  # no stage involved

TESTS = ROOT / "tests"

PACKAGE = ROOT / "shardwrap"
MAX_LINES = 600
# The package's floors, lowest first: a module imports from its own folder and from lower floors
# only; checkpoint and planning share a floor and import neither of each other. Above them all:
# shardwrap/__init__.py and the public modules (hf, logbook, estimate).
FLOORS = {
    "options": 0,
    "comm": 1,
    "tiers": 2,
    "engine": 3,
    "checkpoint": 4,
    "planning": 4,
    "runs": 5,
    "integrations": 6,
}
TOP = len(FLOORS)
# engine/'s rooms, by the phase their code serves, lowest first, ruled alike: optim (optimizer
# steps, shard gradients) and shards (flat buffers) share the lowest floor and import neither of
# each other; step (a training step's hooks, order and reductions) builds on both; wrap (the
# public wrapper and building) on all. engine/__init__.py sits above them.
ROOMS = {"optim": 0, "shards": 0, "step": 1, "wrap": 2}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (``from tests import x`` counts as
    ``tests.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _module_marks(tree: ast.Module) -> set[str]:
    """The marks a module's ``pytestmark`` names."""
    return {
        n.attr
        for node in tree.body
        if isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0])
        for n in ast.walk(node.value)
        if isinstance(n, ast.Attribute)
    }


def _tiers(test: ast.FunctionDef, module: set[str]) -> set[str]:
    """The marks among ``process`` and ``faults`` that ``test`` carries, its module's included."""
    marks = set(module)
    for decorator in test.decorator_list:
        marks |= {n.attr for n in ast.walk(decorator) if isinstance(n, ast.Attribute)}
    return marks & {"process", "faults"}


def test_no_test_module_imports_another() -> None:
    for path in sorted(TESTS.rglob("*.py")):
        tests = {m for m in _imports(path) if m.split(".")[-1].startswith("test_")}
        assert not tests, f"{path.relative_to(ROOT)} imports {sorted(tests)}: move it to support"


def test_runs_in_processes_of_their_own_are_exactly_those_in_e2e() -> None:
    seen = 0
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module = _module_marks(tree)
        in_e2e = path.parent == TESTS / "e2e"
        for test in tree.body:
            if isinstance(test, ast.FunctionDef) and test.name.startswith("test_"):
                where = f"{path.relative_to(ROOT)}::{test.name}"
                assert bool(_tiers(test, module)) == in_e2e, (
                    f"{where}: marked {sorted(_tiers(test, module)) or 'neither'} of process "
                    "and faults; tests in tests/e2e carry one, no others do"
                )
                seen += in_e2e
    assert seen >= 10  # the process and fault tiers were found, and read


def test_the_peers_tier_is_exactly_the_modules_in_tests_peers() -> None:
    """``make test`` runs the peers tier apart (``-m peers``) and leaves it out of the
    in-process passes (``not peers``): a module of it without the mark would run in those
    passes too, a module marked elsewhere would leave them."""
    seen = 0
    for path in sorted(TESTS.rglob("test_*.py")):
        marked = "peers" in _module_marks(ast.parse(path.read_text()))
        in_peers = path.parent == TESTS / "peers"
        where = path.relative_to(ROOT)
        assert marked == in_peers, f"{where}: tests/peers modules, and only they, are marked peers"
        seen += in_peers
    assert seen >= 5  # the tier was found, and read


def test_benchmarks_import_nothing_from_the_tests() -> None:
    paths = sorted((ROOT / "benchmarks").rglob("*.py"))
    for path in paths:
        tests = {m for m in _imports(path) if m.split(".")[0] == "tests"}
        assert not tests, f"{path.relative_to(ROOT)} imports {sorted(tests)}: move it to benchmarks"
    assert len(paths) >= 10  # the benchmarks were found, and read


def _module_name(path: Path) -> str:
    """``shardwrap/engine/step/root.py`` -> ``shardwrap.engine.step.root``; a package is its
    folder's name."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_imports(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """The modules of ``modules`` that ``path`` imports (line, module), at module level, inside
    functions and inside ``if TYPE_CHECKING:`` blocks alike: an import for annotations only is
    still a dependency, and a cycle through one is still a cycle."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def resolve(line: int, base: str, names: list[str]) -> None:
        # ``from base import x`` imports the module base.x where there is one, else base
        subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
        found.extend((line, m) for m in subs or ([base] if base in modules else []))

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            resolve(node.lineno, base, [a.name for a in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _floor(module: str) -> tuple[int, str]:
    """A module's floor, and its folder (``""`` for the modules atop the package)."""
    folder = module.split(".")[1] if module.count(".") else ""
    if folder in FLOORS:
        return FLOORS[folder], folder
    return TOP, ""


def _room(module: str) -> tuple[int, str]:
    """An engine module's room and its floor among the rooms (``""`` atop them)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in ROOMS:
        return ROOMS[parts[2]], parts[2]
    return len(ROOMS), ""


def _wrong_way(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target`` (up a floor, or across to a folder or room of
    its own floor), or ``None``."""
    (floor, folder), (to_floor, to_folder) = _floor(module), _floor(target)
    if to_floor > floor or (to_floor == floor and to_folder != folder):
        return f"{to_folder or 'the top'}, floor {to_floor}, from {folder or 'the top'} ({floor})"
    if folder == to_folder == "engine":
        (room, name), (to_room, to_name) = _room(module), _room(target)
        if to_room > room or (to_room == room and to_name != name):
            to, at = to_name or "the top", name or "the top"
            return f"engine room {to} ({to_room}) from {at} ({room})"
    return None


def test_no_module_of_the_package_is_longer_than_600_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}; split the module by concept"


def test_the_package_imports_only_down_its_floors_and_in_no_cycle() -> None:
    paths = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(FLOORS) - {"options"}, "give each folder of shardwrap/ its floor"
    rooms = {p.name for p in (PACKAGE / "engine").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(ROOMS), "give each room of shardwrap/engine/ its floor"
    loose = [p.name for p in (PACKAGE / "engine").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"engine/ holds rooms only; put {loose} in one"
    graph: dict[str, set[str]] = {m: set() for m in paths}
    wrong = []
    for module, path in paths.items():
        for line, target in _package_imports(path, set(paths)):
            graph[module].add(target)
            why = _wrong_way(module, target)
            if why is not None:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({why})")
    assert not wrong, "imports up the floors; move the shared name down:\n" + "\n".join(wrong)
    assert sum(map(len, graph.values())) > 100  # the imports were found, and read

    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                cycle = [*path[path.index(target) :], target]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if target not in done:
                walk(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        walk(module, [module])


def test_the_integrations_are_reached_from_the_package_as_the_docs_write_them() -> None:
    """``shardwrap.hf.Trainer`` after ``import shardwrap`` alone (before: an AttributeError;
    the docs write it so), without importing transformers or Lightning before they are used."""
    script = (
        "import sys, shardwrap\n"
        "assert 'transformers' not in sys.modules and 'lightning' not in sys.modules\n"
        "print(shardwrap.hf.Trainer.__name__, shardwrap.lightning.ShardwrapStrategy.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Trainer", "ShardwrapStrategy"]


def test_importing_the_package_loads_neither_dtensor_nor_dcp() -> None:
    heavy = ("torch.distributed.tensor", "torch.distributed.checkpoint")
    script = f"import sys, shardwrap; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
