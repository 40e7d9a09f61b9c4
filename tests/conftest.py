"""Run the suite at any ZeRO stage: ``pytest --stage 2`` makes 2 the default ``stage`` of every
``ShardedModule`` the tests build; ``--stage 1 --stage 2`` runs each test once per stage, in one
session (ids end in ``default-stage1``, ``default-stage2``). ``make test`` runs the in-process
tier at stages 1 and 2 as well as at the default stage 3, leaving out the tests marked
``stage3``: those assert stage 3's own lifetimes (buffers released after forward,
``reshard_after_forward``). Tests parametrized by ``stage`` name their stages themselves and run
only in the default run."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from shardwrap import ShardedModule

LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


LEFT_BEHIND = pytest.StashKey[tuple[dict[str, str | None], bool]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[LEFT_BEHIND] = (
        {name: os.environ.get(name) for name in LAUNCHER_VARIABLES},
        dist.is_initialized(),
    )
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A test that leaves torch.distributed's default group or a launcher's variables behind,
    once its fixtures (``monkeypatch`` among them) are undone, fails by name, and its leftovers
    are undone. Left there, they broke whichever later test a worker happened to run:
    Lightning's ``Trainer`` sets ``LOCAL_RANK``; with it set, ``TrainingArguments(use_cpu=True)``
    starts a default group of this process alone (through accelerate); a later
    ``init_process_group`` then raised "trying to initialize the default process group twice"."""
    result = yield
    saved, started = item.stash[LEFT_BEHIND]
    left = [name for name, value in saved.items() if os.environ.get(name) != value]
    for name in left:
        value = saved[name]
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
    if dist.is_initialized() and not started:
        dist.destroy_process_group()
        left.append("torch.distributed's default group")
    if left:
        pytest.fail(f"{item.nodeid} left {', '.join(left)} behind; undo it in the test")
    return result


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stage",
        type=int,
        action="append",
        choices=(1, 2, 3),
        help="default ZeRO stage of the tests (3 if not given); repeat it to run each at each",
    )


def _stages(config: pytest.Config) -> list[int]:
    return sorted(set(config.getoption("--stage") or [3]))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    stages = _stages(metafunc.config)
    if len(stages) > 1:
        metafunc.parametrize(
            "default_stage", stages, indirect=True, ids=[f"default-stage{s}" for s in stages]
        )


@pytest.fixture(autouse=True)
def default_stage(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    stage = getattr(request, "param", None) or _stages(request.config)[0]
    monkeypatch.setitem(ShardedModule.__new__.__kwdefaults__, "stage", stage)
    return stage


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _stages(config) == [3]:
        return
    named = [i for i in items if "stage" in getattr(getattr(i, "callspec", None), "params", {})]
    if named:
        config.hook.pytest_deselected(items=named)
        items[:] = [i for i in items if i not in named]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Exclude what collection built (torch, transformers, every test module: most of a
    worker's heap) from the cyclic collector: each full collection then walks only what tests
    made since; little of it ever becomes garbage. The in-process session at
    stage 3 took 273 s without it, 186 s with it (2 cores, three workers)."""
    gc.freeze()
