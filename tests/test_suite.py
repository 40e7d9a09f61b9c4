"""The suite's own layout, read from the source: what the tests share lives in ``tests/support``,
never in another test module; every run in processes of its own (marked ``process`` or
``faults``) sits in ``tests/e2e`` and nothing else does; the benchmarks import nothing from the
tests but the tracked-allocation measure, until the package offers it.
Run: ``pytest tests/test_suite.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.launch import ROOT

pytestmark = pytest.mark.stage3  # no stage involved

TESTS = ROOT / "tests"
# benchmark -> the modules of tests it still imports: the tracked-allocation measure
BENCHMARKS_IMPORT = {
    "_worker.py": {"tests.support.memory"},
    "estimate.py": {"tests.support.memory"},
}


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
        module = {
            n.attr
            for node in tree.body
            if isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0])
            for n in ast.walk(node.value)
            if isinstance(n, ast.Attribute)
        }
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


def test_benchmarks_import_nothing_from_the_tests_but_the_tracked_allocation_measure() -> None:
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tests = {m for m in _imports(path) if m.split(".")[0] == "tests"}
        allowed = BENCHMARKS_IMPORT.get(path.name, set())
        assert {m for m in tests if not any(m.startswith(a) for a in allowed)} == set(), path
