"""The benchmark scripts as modules, for the tests of their logic (the benchmarks import nothing
from the tests; the tests load them as their scripts run)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support.launch import ROOT

__all__ = ["load_benchmark"]


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as its script runs: its folder first on the path while it
    loads, where it finds ``_launch`` and ``compare``."""
    folder = str(ROOT / "benchmarks")
    spec = importlib.util.spec_from_file_location(name, f"{folder}/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses look their module up
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module
