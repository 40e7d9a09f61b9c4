"""Checked compressed training, shared by the in-process tests
(``tests/engine/test_compression.py``) and the torchrun case
(``tests/e2e/scripts/torchrun_compression.py``).

:func:`train_checked` trains a compressed ``ShardedModule`` and checks each step against what
the formats promise (``comm/quantize.py``):

- forward computes with exactly the decoded bytes of every rank's shard: the full parameters
  a module sees in forward equal, bit for bit, the shards' exact values (``full_state_dict()``)
  packed chunk by chunk and decoded, in the compute dtype;
- the gathers leave the shards as the optimizer left them;
- the reduced gradient is within the sum of the peers' per-block bounds of the exact average of
  the ranks' gradients, each made by a plain model with the decoded weights on its rank's slice;
- SGD's update lands exactly in the shards, and ``full_state_dict()`` reads exact values.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from shardwrap import Compression, ShardedModule
from shardwrap.comm.quantize import Codec
from tests.support.models import Block, make_batch

__all__ = [
    "block_bound",
    "capture",
    "decoded_params",
    "element_bound",
    "flat",
    "groups",
    "train_checked",
]

LR = 0.05
STEPS = 3
HALF_STEP = {"int8": 1 / 254, "int4": 1 / 14}


def groups(m: nn.Module) -> list[Any]:
    return [g for u in m._shardwrap_root.units for g in u.groups]


def flat(values: dict[str, Tensor], g: Any) -> Tensor:
    """A group's flat buffer (float32, padded) from per-parameter ``values``."""
    out = torch.zeros(g.layout.padded_numel)
    for name, offset, n in zip(g.names, g.layout.offsets, g.layout.numels):
        out[offset : offset + n] = values[name].reshape(-1).float()
    return out


def decoded_params(m: nn.Module, masters: dict[str, Tensor]) -> dict[str, Tensor]:
    """What every rank should compute with: each shard of the exact masters packed and
    decoded (float32)."""
    out = {}
    for g in groups(m):
        full, world = flat(masters, g), g.mesh.shard_size
        n = full.numel() // world
        if g.codec is not None:
            full = torch.cat([g.codec.round_trip(full[r * n : (r + 1) * n]) for r in range(world)])
        for name, offset, k, shape in zip(g.names, g.layout.offsets, g.layout.numels, g.shapes):
            out[name] = full[offset : offset + k].view(shape)
    return out


def capture(m: nn.Module) -> dict[str, Tensor]:
    """Record the full parameters modules see in forward, by canonical name."""
    seen: dict[str, Tensor] = {}
    for g in groups(m):
        for name, slots in zip(g.names, g.slots):
            module, attr = slots[0]

            def hook(mod: nn.Module, args: Any, name: str = name, attr: str = attr) -> None:
                seen[name] = getattr(mod, attr).detach().clone()

            module.register_forward_pre_hook(hook)
    return seen


EPS = 1e-6  # float32 rounding of the scale and the product, relative to the block's magnitude


def element_bound(x: Tensor, codec: Codec) -> Tensor:
    """Per element of ``x`` (1-D), how far its decoded value may be from it, in any format."""
    n = x.numel()
    pad = codec.blocks(n) * codec.block - n
    absmax = torch.nn.functional.pad(x.abs().float(), (0, pad)).view(-1, codec.block).amax(1)
    m = absmax.repeat_interleave(codec.block)[:n]
    if codec.fmt == "fp8":
        return x.abs() * 2**-4 + m / 448 * 2**-10 + m * EPS
    return m * (HALF_STEP[codec.fmt] + EPS)


def block_bound(x: Tensor, codec: Codec) -> Tensor:
    n = x.numel()
    pad = codec.blocks(n) * codec.block - n
    m = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, codec.block).amax(1)
    return m.repeat_interleave(codec.block)[:n] * (HALF_STEP[codec.fmt] + 1e-6)


def check_grads_within_bound(
    m: nn.Module, plain: nn.Module, decoded: dict[str, Tensor], slices: list[Any], codec: Codec
) -> None:
    """This rank's reduced shard gradient against the exact average of the ranks' gradients,
    each made by ``plain`` with the decoded weights on its rank's slice.

    With hybrid sharding (shard groups of consecutive ranks, ``tests/support/hybrid.py``) the
    bound has two terms per replica: its shard group's reduce-scatter (the peers' bounds), and
    the all-reduce across replicas, which quantizes each replica's average, own included, whose
    magnitude is at most the exact average's plus the first term."""
    plain.load_state_dict({k: decoded.get(k, v) for k, v in plain.state_dict().items()})
    per_rank = []
    for x, y in slices:
        plain.zero_grad()
        plain(x, y).backward()
        per_rank.append({k: p.grad.clone() for k, p in plain.named_parameters()})
    for g in groups(m):
        if not g.requires_grad:
            continue
        fulls = [flat(grads, g) for grads in per_rank]
        n, rank = g.shard.numel(), g.mesh.shard_rank
        shards, replicas = g.mesh.shard_size, g.mesh.replicate_size
        own = slice(rank * n, (rank + 1) * n)
        averages, errors = [], []
        for j in range(replicas):
            members = [f[own] for f in fulls[j * shards : (j + 1) * shards]]
            averages.append(torch.stack(members).mean(0))
            peers = [block_bound(x, codec) for q, x in enumerate(members) if q != rank]
            errors.append(torch.stack(peers).sum(0) / shards if peers else torch.zeros(n))
        exact = torch.stack(averages).mean(0)
        if replicas == 1:
            limit = errors[0]
        else:
            limit = sum(e + block_bound(a.abs() + e, codec) for a, e in zip(averages, errors))
            limit = limit / replicas
        limit = limit + 1e-6 * exact.abs() + 1e-7
        for pc, p in zip(g.pieces, g.shard_params):
            got = p.grad.reshape(-1)
            want = exact[pc.shard_offset : pc.shard_offset + pc.numel]
            assert ((got - want).abs() <= limit[pc.shard_offset : pc.shard_offset + pc.numel]).all()


def train_checked(
    model: nn.Module,
    rank: int,
    world: int,
    group: Any,
    compression: Compression,
    check_grads: bool | str = True,
    **wrap: Any,
) -> dict[str, Tensor]:
    """Train a compressed copy of ``model`` (a ``tests.support.models.GPT``) for ``STEPS``
    steps, checking every step (see the module docstring); ``check_grads``: at every step,
    ``"first"`` only (error feedback then carries residuals the plain gradients know nothing
    of), or not at all. Returns the final masters (``full_state_dict()``)."""
    m = ShardedModule(
        copy.deepcopy(model), process_group=group, auto_wrap=Block, compression=compression, **wrap
    )
    seen = capture(m)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    codec = m._shardwrap_root.reductions.codec
    plain = copy.deepcopy(model)  # this rank's own: ranks are threads
    for step in range(STEPS):
        x, y = make_batch(seed=step, batch=2 * world)
        slices = list(zip(x.chunk(world), y.chunk(world)))
        masters = m.full_state_dict()
        decoded = decoded_params(m, masters)
        seen.clear()
        shards = [p.detach().clone() for p in m.parameters()]
        m(*slices[rank]).backward()
        # the gathers for compute left the shards as the optimizer left them
        assert all(torch.equal(p.detach(), s) for p, s in zip(m.parameters(), shards))
        assert seen.keys() == decoded.keys()
        for name, value in seen.items():
            assert torch.equal(value, decoded[name].to(value.dtype)), name
        if check_grads is True or (check_grads == "first" and step == 0):
            check_grads_within_bound(m, plain, decoded, slices, codec)
        before = [(p.detach().clone(), p.grad.clone()) for p in m.parameters()]
        opt.step()
        for p, (value, grad) in zip(m.parameters(), before):
            assert torch.equal(p.detach(), value.add(grad, alpha=-LR))
        opt.zero_grad()
    masters = m.full_state_dict()
    for g in groups(m):  # the masters are the shards, not what forward computed with
        if g.codec is not None:
            assert not torch.equal(flat(masters, g), flat(decoded_params(m, masters), g))
    return masters
