"""Hybrid sharding: shard within each shard group, replicate across groups, at every stage.

World size 4 as 2 x 2 on gloo, ranks as threads: ranks {0, 1} and {2, 3} each shard the
model; ranks {0, 2} and {1, 3} hold the same shard and average gradients after the
reduce-scatter. The groups are made by hand and passed as a ``shardwrap.Mesh`` (the
``DeviceMesh`` form, which needs the default process group, runs under torchrun in
``tests/e2e/test_torchrun.py``). Proves:

- parity with the plain model on the whole global batch at stages 1, 2 and 3 (SGD with
  momentum: parameters within 1e-5; AdamW: losses within 1e-5), and the gradient norm;
- replicas hold identical shards after training;
- a checkpoint is written once (one file per shard, not per replica) and loads at any mesh:
  hybrid 2 x 2, plain world size 4 and 1;
- a mesh whose control group does not span every rank is refused.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/comm/test_hybrid.py -q``
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from shardwrap import Mesh, ShardedModule, load_checkpoint, save_checkpoint
from tests.support.hybrid import SHARD, hybrid_mesh
from tests.support.models import GPT, Block
from tests.support.parity import GPT_BATCHES, STEPS, adamw, gpt_loss, sgd
from tests.support.ranks import run_ranks, subgroup


def _slice(t: Tensor, rank: int, world: int) -> Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def _train(m: ShardedModule, opt: torch.optim.Optimizer, rank: int, world: int, pg) -> list:  # noqa: ANN001
    losses, norms = [], []
    for x, y in GPT_BATCHES:
        opt.zero_grad()
        loss = gpt_loss(m, _slice(x, rank, world), _slice(y, rank, world))
        loss.backward()
        norms.append(m.clip_grad_norm_(1e9).item())
        opt.step()
        mean = loss.detach().clone()
        pg.allreduce([mean]).wait()
        losses.append(mean.item() / world)
    return [losses, norms]


def _reference(model: GPT, make_opt) -> tuple[list[float], list[float], dict[str, Tensor]]:  # noqa: ANN001
    ref = copy.deepcopy(model)
    opt = make_opt(ref.parameters())
    losses, norms = [], []
    for x, y in GPT_BATCHES:
        opt.zero_grad()
        loss = gpt_loss(ref, x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, ref.state_dict()


@pytest.mark.parametrize("make_opt", [sgd, adamw], ids=["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_2x2_trains_like_the_plain_model(stage: int, make_opt) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = GPT(tied=True)
    want_losses, want_norms, want_state = _reference(model, make_opt)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list, dict[str, Tensor], Tensor]:
        m = ShardedModule(
            copy.deepcopy(model), auto_wrap=Block, process_group=hybrid_mesh(pg), stage=stage
        )
        opt = make_opt(m.parameters())
        trained = _train(m, opt, rank, 4, pg)
        shard = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        return trained, m.full_state_dict(), shard

    runs = run_ranks(4, fn, timeout=60.0)
    for rank, ((losses, norms), state, _) in enumerate(runs):
        torch.testing.assert_close(losses, want_losses, atol=1e-5, rtol=0, msg=f"rank {rank}")
        torch.testing.assert_close(norms, want_norms, atol=1e-5, rtol=1e-5)
        if make_opt is sgd:
            torch.testing.assert_close(state, want_state, atol=1e-5, rtol=0)
    for rank in range(SHARD):  # replicas of one shard stay identical
        assert torch.equal(runs[rank][2], runs[rank + SHARD][2])


def test_hybrid_checkpoint_is_written_once_and_loads_at_any_mesh(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(tied=True)
    half = STEPS // 2
    ref = copy.deepcopy(model)
    ref_opt = sgd(ref.parameters())
    for x, y in GPT_BATCHES:
        ref_opt.zero_grad()
        gpt_loss(ref, x, y).backward()
        ref_opt.step()

    def train(m: ShardedModule, opt: torch.optim.Optimizer, rank: int, world: int, steps) -> None:  # noqa: ANN001
        for step in steps:
            x, y = GPT_BATCHES[step]
            opt.zero_grad()
            gpt_loss(m, _slice(x, rank, world), _slice(y, rank, world)).backward()
            opt.step()

    def save(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=hybrid_mesh(pg))
        opt = sgd(m.parameters())
        train(m, opt, rank, 4, range(half))
        save_checkpoint(tmp_path / "ckpt", m, opt, rank=rank)

    run_ranks(4, save, timeout=60.0)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert [f for f in files if f.startswith("rank-")] == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    assert [f for f in files if f.startswith("extra-")] == [f"extra-{r:05d}.pt" for r in range(4)]

    def resume(world: int, hybrid: bool):  # noqa: ANN202
        def fn(rank: int, pg: ProcessGroup | None) -> dict[str, Tensor]:
            group = hybrid_mesh(pg) if hybrid else pg
            m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=group)
            opt = sgd(m.parameters())
            extra = load_checkpoint(tmp_path / "ckpt", m, opt)
            assert extra == {"rank": rank}
            train(m, opt, rank, world, range(half, STEPS))
            return m.full_state_dict()

        return fn(0, None) if world == 1 else run_ranks(world, fn, timeout=60.0)[0]

    for world, hybrid in [(4, True), (4, False), (1, False)]:
        torch.testing.assert_close(resume(world, hybrid), ref.state_dict(), atol=1e-5, rtol=0)


def test_a_mesh_whose_control_group_misses_ranks_is_refused() -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        shard = subgroup(pg, [rank - rank % 2, rank - rank % 2 + 1], "shard")
        replicate = subgroup(pg, [rank % 2, rank % 2 + 2], "replicate")
        with pytest.raises(ValueError, match="Mesh.control spans 2 ranks but the mesh has 4"):
            Mesh(shard=shard, replicate=replicate, control=shard)
        with pytest.raises(ValueError, match="hybrid sharding needs a control group"):
            Mesh(shard=shard, replicate=replicate)

    run_ranks(4, fn, timeout=30.0)
