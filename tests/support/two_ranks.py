"""Two ranks on one device: the checks ``tests/e2e/scripts/two_ranks_one_gpu.py`` runs on each
rank, and how ``tests/e2e/test_gpu_two_ranks.py`` judges what the ranks wrote.

Each check is a function of this rank, the group and the device that raises ``AssertionError``
where values are wrong. A check of shardwrap names the backend operations it issues on a GPU
(``needs``): where the backend refused one of those, the check is not run and is reported as
refused with the backend's words, so that a refusal of the backend is never taken for a fault
of shardwrap, nor the reverse; where every one was granted, any exception it raises is wrong.
Any other exception of a backend's own check is its refusal.

Every rank writes one JSON line per check as it starts and one as it ends (``status``: ``ok``,
``refused``, ``wrong``), so a run cut short (a hang, a crash) still says how far it got.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwrap import ShardedModule
from shardwrap.comm import collectives
from shardwrap.comm.compressed import (
    all_gather_quantized,
    all_reduce_quantized,
    reduce_scatter_quantized,
)
from shardwrap.comm.quantize import Codec
from tests.support.models import GPT, Block, ComplexLayer, WithBatchNorm, WithComplex
from tests.support.parity import (
    GPT_BATCHES,
    gpt_loss,
    sgd,
    train_clipped,
    train_reference,
    train_steps,
)

__all__ = ["CHECKS", "Check", "Outcome", "judge", "read", "run_checks"]

WORLD = 2
N = 1000  # elements per rank: not a multiple of the codec's block
CODEC = Codec("int8", 256)


@dataclass(frozen=True)
class Check:
    """One check: its name, the backend operations it needs (none for the backend's own), and
    its body ``(rank, group, device) -> None``."""

    name: str
    needs: tuple[str, ...]
    body: Callable[[int, dist.ProcessGroup, torch.device], None]


def _values(rank: int, n: int, device: torch.device, seed: int = 0) -> Tensor:
    """Rank ``rank``'s input: the same on every rank that asks for it, so each can compute
    every other's expected result."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g).to(device)


def _same(got: Tensor, want: Tensor, what: str) -> None:
    assert torch.equal(got.cpu(), want.cpu()), f"{what}: {got.cpu()[:4]} != {want.cpu()[:4]}"


# the backend's own operations, as shardwrap issues them on a device ----------------------


def _backend_all_gather(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    out = torch.empty(WORLD * N, device=device)
    pg._allgather_base(out, _values(rank, N, device)).wait()
    _same(out, torch.cat([_values(r, N, device) for r in range(WORLD)]), "gathered")


def _backend_reduce_scatter(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    out = torch.empty(N, device=device)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    pg._reduce_scatter_base(out, _values(rank, WORLD * N, device), opts).wait()
    chunks = [_values(r, WORLD * N, device)[rank * N : (rank + 1) * N] for r in range(WORLD)]
    want = torch.stack(chunks).sum(0) / WORLD
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def _backend_all_to_all(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    mine = torch.empty(0, device=device)  # this rank's own slot is not exchanged
    ins = [mine if q == rank else torch.full((N,), 10.0 * rank + q, device=device) for q in (0, 1)]
    outs = [mine if q == rank else torch.empty(N, device=device) for q in (0, 1)]
    pg.alltoall(outs, ins, dist.AllToAllOptions()).wait()
    peer = 1 - rank
    _same(outs[peer], torch.full((N,), 10.0 * peer + rank, device=device), "received")


def _backend_broadcast(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    t = _values(rank, N, device)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()
    _same(t, _values(0, N, device), "broadcast")


def _backend_all_reduce(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    t = _values(rank, N, device)
    pg.allreduce([t]).wait()
    torch.testing.assert_close(t, _values(0, N, device) + _values(1, N, device))


# shardwrap's collectives ---------------------------------------------------------------


def _gather(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    for dtype in (torch.float32, torch.bfloat16):  # bf16: the shard cast into its own slot
        out = torch.empty(WORLD * N, dtype=dtype, device=device)
        collectives.all_gather(out, _values(rank, N, device), pg).wait()
        want = torch.cat([_values(r, N, device) for r in range(WORLD)]).to(dtype)
        _same(out, want, f"gathered in {dtype}")


def _reduce(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    out = torch.empty(N, device=device)
    collectives.reduce_scatter(out, _values(rank, WORLD * N, device), pg).wait()
    chunks = [_values(r, WORLD * N, device)[rank * N : (rank + 1) * N] for r in range(WORLD)]
    torch.testing.assert_close(out, torch.stack(chunks).sum(0) / WORLD, atol=1e-6, rtol=0)


def _exchange(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    sizes = [3, 5]  # what rank q sends to rank q's peer: sizes differ by direction
    ins = [torch.full((sizes[rank],), float(rank), device=device) for _ in range(WORLD)]
    outs = [torch.empty(sizes[1 - rank], device=device) for _ in range(WORLD)]
    ins[rank], outs[rank] = ins[rank][:0], outs[rank][:0]
    collectives.all_to_all(outs, ins, pg).wait()
    _same(outs[1 - rank], torch.full((sizes[1 - rank],), float(1 - rank), device=device), "got")


def _gather_many(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    sizes = (N, 7)
    outs = [torch.empty(WORLD * n, device=device) for n in sizes]
    shards = [_values(rank, n, device, seed) for seed, n in enumerate(sizes)]
    collectives.all_gather_many(outs, shards, pg).wait()
    for seed, (out, n) in enumerate(zip(outs, sizes)):
        _same(out, torch.cat([_values(r, n, device, seed) for r in range(WORLD)]), "gathered")


def _reduce_many(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    sizes = (N, 7)
    outs = [torch.empty(n, device=device) for n in sizes]
    fulls = [_values(rank, WORLD * n, device, seed) for seed, n in enumerate(sizes)]
    collectives.reduce_scatter_many(outs, fulls, pg).wait()
    for seed, (out, n) in enumerate(zip(outs, sizes)):
        chunks = [_values(r, WORLD * n, device, seed)[rank * n : (rank + 1) * n] for r in (0, 1)]
        torch.testing.assert_close(out, torch.stack(chunks).sum(0) / WORLD, atol=1e-6, rtol=0)


def _gather_quantized(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    out = torch.empty(WORLD * N, device=device)
    all_gather_quantized(out, _values(rank, N, device), pg, CODEC).wait()
    want = torch.cat([CODEC.round_trip(_values(r, N, device)) for r in range(WORLD)])
    _same(out, want, "decoded")  # every slot decoded from the wire, this rank's own too


def _reduce_quantized(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    out = torch.empty(N, device=device)
    reduce_scatter_quantized(out, _values(rank, WORLD * N, device), pg, CODEC).wait()
    own = _values(rank, WORLD * N, device)[rank * N : (rank + 1) * N]
    peer = CODEC.round_trip(_values(1 - rank, WORLD * N, device)[rank * N : (rank + 1) * N])
    _same(out, (own.float() + peer).div_(WORLD), "averaged")  # the own chunk exact


def _all_reduce_quantized(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    t = _values(rank, N, device)
    all_reduce_quantized(t, pg, CODEC).wait()
    total = torch.zeros(N, device=device)
    for r in range(WORLD):
        total += CODEC.round_trip(_values(r, N, device))
    _same(t, total.div_(WORLD), "averaged")


def _train(**wrap: Any) -> Callable[[int, dist.ProcessGroup, torch.device], None]:
    """A GPT at stage 3 with SGD on both ranks, each on its half of every batch, against the
    plain model on the whole batch on this device: losses and parameters within 1e-5."""

    def body(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
        torch.manual_seed(0)
        model = GPT()

        def loss(m: Any, x: Tensor, y: Tensor) -> Tensor:
            return gpt_loss(m, x.to(device), y.to(device))

        ref = train_reference(copy.deepcopy(model).to(device), sgd, GPT_BATCHES, loss)
        sharded = ShardedModule(model, auto_wrap=Block, device=device, stage=3, **wrap)
        # each rank's loss over its half, halved; summed over the ranks on the CPU's gloo group
        losses = torch.tensor(train_steps(sharded, rank, WORLD, None, sgd, GPT_BATCHES, loss))
        dist.all_reduce(losses, group=_cpu_group())
        torch.testing.assert_close(losses, torch.tensor(ref.losses), atol=1e-5, rtol=0)
        want = {k: v.cpu() for k, v in ref.state.items()}
        torch.testing.assert_close(sharded.full_state_dict(), want, atol=1e-5, rtol=0)

    return body


def _complex_parameters(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    """Complex parameters, which a GPU's backend gathers and reduces as their real and
    imaginary parts, train with AdamW and a clipped global norm as the plain model on this
    device: norms and parameters within 1e-5."""
    torch.manual_seed(0)
    model = WithComplex()
    plain = copy.deepcopy(model).to(device)
    want_norms, _ = train_clipped(plain, 0, 1, device)
    sharded = ShardedModule(model, auto_wrap=ComplexLayer, device=device)
    norms, _ = train_clipped(sharded, rank, WORLD, device)
    torch.testing.assert_close(norms, want_norms, atol=0, rtol=1e-5)
    want = {k: v.cpu() for k, v in plain.state_dict().items()}
    torch.testing.assert_close(sharded.full_state_dict(), want, atol=1e-5, rtol=0)


def _edits_over_a_group_of_its_own(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    """A model wrapped over a group the user made (its agreements then run over that group, on
    ``device``): weights differing across ranks become rank 0's, and rank 0's edits inside
    ``gathered(modifier_rank=0)`` reach every rank."""
    group = _own_group()
    torch.manual_seed(rank)  # each rank its own weights
    sharded = ShardedModule(GPT(), auto_wrap=Block, device=device, process_group=group)
    torch.manual_seed(0)
    want = GPT().state_dict()
    _same_state(sharded.full_state_dict(), want, "weights after wrapping")
    with sharded.gathered(modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                sharded.lm_head.weight.fill_(0.5)
    want["lm_head.weight"] = torch.full_like(want["lm_head.weight"], 0.5)
    _same_state(sharded.full_state_dict(), want, "weights after rank 0's edit")


def _buffers_from_rank_zero(rank: int, pg: dist.ProcessGroup, device: torch.device) -> None:
    """A BatchNorm's running statistics, each rank's own after its forward, are rank 0's on
    both ranks after each step (``engine/step/buffers.py``: one broadcast from the device)."""
    torch.manual_seed(0)
    sharded = ShardedModule(WithBatchNorm(), auto_wrap=nn.BatchNorm1d, device=device)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4 * WORLD, 13, generator=torch.Generator().manual_seed(step))
        out = sharded(x.chunk(WORLD)[rank].to(device))
        own = sharded.net[1].running_mean.cpu().clone()  # a copy on the CPU too
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        buffers = torch.cat([b.cpu().double().reshape(-1) for b in sharded.buffers()])
        total = buffers.clone()
        dist.all_reduce(total, group=_cpu_group())
        _same(total, buffers * WORLD, f"step {step}: the buffers, summed over the ranks")
    owns = [torch.empty_like(own) for _ in range(WORLD)]
    dist.all_gather(owns, own, group=_cpu_group())
    assert not torch.equal(owns[0], owns[1]), "the ranks' own statistics were the same"


def _same_state(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    for name, value in want.items():
        _same(got[name], value, f"{what}: {name}")


@functools.cache
def _own_group() -> dist.ProcessGroup:
    """A group over both ranks on the default group's backend, made once, as a user makes one."""
    return dist.new_group(ranks=list(range(WORLD)))


@functools.cache
def _cpu_group() -> dist.ProcessGroup:
    """A gloo group over both ranks for the checks' own bookkeeping, made once."""
    return dist.new_group(backend="gloo")


GATHER, REDUCE, ALL_TO_ALL = "all_gather_into_tensor", "reduce_scatter_tensor AVG", "all_to_all"
CHECKS = [
    Check(GATHER, (), _backend_all_gather),
    Check(REDUCE, (), _backend_reduce_scatter),
    Check(ALL_TO_ALL, (), _backend_all_to_all),
    Check("broadcast", (), _backend_broadcast),
    Check("all_reduce SUM", (), _backend_all_reduce),
    Check("shardwrap all_gather", (GATHER,), _gather),
    Check("shardwrap reduce_scatter", (REDUCE,), _reduce),
    Check("shardwrap all_to_all", (ALL_TO_ALL,), _exchange),
    Check("shardwrap all_gather_many", (GATHER,), _gather_many),
    Check("shardwrap reduce_scatter_many", (REDUCE,), _reduce_many),
    Check("shardwrap int8 all_gather", (GATHER,), _gather_quantized),
    Check("shardwrap int8 reduce_scatter", (ALL_TO_ALL,), _reduce_quantized),
    Check("shardwrap int8 all_reduce", (GATHER,), _all_reduce_quantized),
    Check("shardwrap trains a GPT, buckets", (GATHER, REDUCE), _train()),
    Check("shardwrap trains a GPT, no buckets", (GATHER, REDUCE), _train(bucket_mb=0)),
    Check("shardwrap trains complex parameters", (GATHER, REDUCE), _complex_parameters),
    Check(
        "shardwrap keeps buffers rank 0's after each step",
        (GATHER, REDUCE, "broadcast"),
        _buffers_from_rank_zero,
    ),
    Check(
        "shardwrap agrees weights and edits over a group of its own",
        (GATHER, "broadcast", "all_reduce SUM"),
        _edits_over_a_group_of_its_own,
    ),
]


def run_checks(rank: int, device: torch.device, out: Path) -> None:
    """Run every check on this rank over the default group, appending its records to ``out``.

    A check whose needs the backend refused on either rank is recorded as refused without
    running, on both ranks alike (they agree over the CPU group), so no rank waits in a
    collective its peer skipped.
    """
    pg = dist.group.WORLD
    refused: dict[str, str] = {}
    with out.open("a") as log:

        def record(**fields: Any) -> None:
            log.write(json.dumps(fields) + "\n")
            log.flush()

        for check in CHECKS:
            # on the CPU shardwrap exchanges point to point instead: it needs none of them
            needs = check.needs if device.type == "cuda" else ()
            missing = [n for n in needs if n in refused]
            if _anywhere(bool(missing)):
                said = "; ".join(f"{n}: {refused.get(n, 'refused on the peer')}" for n in missing)
                record(check=check.name, status="refused", message=f"needs {said}")
                continue
            record(check=check.name, status="started")
            try:
                check.body(rank, pg, device)
            except AssertionError as e:
                record(check=check.name, status="wrong", message=str(e)[:2000])
            except Exception as e:
                if check.needs:  # shardwrap's, every operation it needs granted: its fault
                    said = f"{type(e).__name__}: {_said(e)}"
                    record(check=check.name, status="wrong", message=said)
                    continue
                # the backend's refusal, in its own words
                said = _said(e)
                refused[check.name] = said
                record(check=check.name, status="refused", message=f"{type(e).__name__}: {said}")
            else:
                record(check=check.name, status="ok")
    _cpu_group().barrier().wait()  # no rank leaves while its peer may still read from it


def _said(e: BaseException) -> str:
    """An exception's message on one line: NCCL puts its reason ("Last error: ...") below a
    first line that names only its own source file."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " / ".join(lines)[:600] or type(e).__name__


def _anywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
    return bool(t.item())


@dataclass(frozen=True)
class Outcome:
    """How a check ended, over both ranks: ``ok``, ``refused``, ``wrong`` or ``unfinished``
    (a rank started it and wrote no end, or never reached it), and what was said."""

    status: str
    message: str


def read(out: Path) -> dict[str, dict[str, Any]]:
    """A rank's last record of each check (``{}`` where it wrote none)."""
    records: dict[str, dict[str, Any]] = {}
    if out.exists():
        for line in out.read_text().splitlines():
            entry = json.loads(line)
            records[entry["check"]] = entry
    return records


def judge(ranks: list[dict[str, dict[str, Any]]], name: str, ended: str) -> Outcome:
    """The outcome of check ``name`` from each rank's records (:func:`read`); ``ended``: how
    the ranks' processes ended, for a check some rank did not finish."""
    entries = [r.get(name) for r in ranks]
    for status in ("wrong", "refused"):
        said = [
            f"rank {i}: {e['message']}"
            for i, e in enumerate(entries)
            if e is not None and e["status"] == status
        ]
        if said:
            return Outcome(status, "; ".join(said))
    if all(e is not None and e["status"] == "ok" for e in entries):
        return Outcome("ok", "")
    where = [
        f"rank {i} {'never reached it' if e is None else 'started it and wrote no end'}"
        for i, e in enumerate(entries)
        if e is None or e["status"] != "ok"
    ]
    return Outcome("unfinished", f"{', '.join(where)} ({ended})")
