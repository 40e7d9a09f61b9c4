"""Run the suite at any ZeRO stage: ``pytest --stage 2`` makes 2 the default ``stage`` of every
``ShardedModule`` the tests build. ``make test`` runs the in-process tier at stages 1 and 2 as
well as at the default stage 3, leaving out the tests marked ``stage3``: those assert stage 3's
own lifetimes (buffers released after forward, ``reshard_after_forward``). Tests parametrized
by ``stage`` name their stages themselves and run only in the default run."""

from __future__ import annotations

import pytest

from shardwrap import ShardedModule


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stage", type=int, default=3, choices=(1, 2, 3), help="default ZeRO stage of the tests"
    )


@pytest.fixture(autouse=True)
def default_stage(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    stage = request.config.getoption("--stage")
    monkeypatch.setitem(ShardedModule.__new__.__kwdefaults__, "stage", stage)
    return stage


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--stage") == 3:
        return
    named = [i for i in items if "stage" in getattr(getattr(i, "callspec", None), "params", {})]
    if named:
        config.hook.pytest_deselected(items=named)
        items[:] = [i for i in items if i not in named]
