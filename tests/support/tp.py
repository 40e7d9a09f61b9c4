"""Ranks as threads with a ``DeviceMesh`` each, for 2-D (data x tensor) parallel tests.

A ``DeviceMesh`` reads the default process group (its rank, ``new_group``), which the plain
thread tier (``tests/support/ranks.py``) never initialises. Here every rank thread initialises
its own default gloo group: ``torch.distributed``'s world is made thread-local for the run
(torch's own multi-threaded test world, ``ThreadLocalWorld``) and c10d's group registry
isolated per thread (``_set_thread_isolation_mode``), so ``init_device_mesh`` and DTensor's
collectives work as they do under ``torchrun``. Both are restored when the run ends.

The plans parallelize the tests' models with torch's own tensor parallelism: the GPT's MLP,
attention projection, token embedding and head (its fused ``qkv`` stays replicated: its rows
are ``(qkv, head, dim)``, and a chunk of them is not a set of heads), and a sequence-parallel
MLP stack whose norms are replicated DTensors.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

from shardwrap import ShardedModule
from tests.support.models import GPT
from tests.support.ranks import run_ranks

__all__ = [
    "SPStack",
    "TPRun",
    "data_rank",
    "parallelize_gpt",
    "parallelize_llama",
    "parallelize_stack",
    "run_mesh_ranks",
    "stack_batches",
    "stack_loss",
    "tp_gpt",
    "tp_llama",
    "train_plain",
    "train_tp",
]

T = TypeVar("T")

_lock = threading.Lock()


def run_mesh_ranks(
    shape: tuple[int, ...],
    names: tuple[str, ...],
    fn: Callable[[int, DeviceMesh], T],
    *,
    timeout: float = 120.0,
) -> list[T]:
    """Run ``fn(rank, mesh)`` on ``prod(shape)`` rank threads, each with a ``DeviceMesh`` of
    ``shape`` named ``names`` over its own default gloo group; results by rank."""
    world = 1
    for s in shape:
        world *= s
    store = dist.HashStore()

    def body(rank: int, _pg: dist.ProcessGroup) -> T:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            return fn(rank, init_device_mesh("cpu", shape, mesh_dim_names=names))
        finally:
            dist.destroy_process_group()

    with _lock:  # one thread-local world at a time in this process
        saved = c10d._world
        c10d._world = ThreadLocalWorld()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        try:
            return run_ranks(world, body, timeout=timeout)
        finally:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            c10d._world = saved


def tp_gpt(tied: bool = False) -> GPT:
    """The tests' GPT with sizes every tensor-parallel degree up to 4 divides (vocabulary 68,
    MLP 144, width 36)."""
    return GPT(vocab=68, width=36, heads=3, depth=3, context=16, tied=tied)


def parallelize_gpt(model: GPT, tp_mesh: DeviceMesh) -> GPT:
    """The GPT's tensor-parallel plan: vocabulary-parallel embedding and head, column- then
    row-parallel MLP, a row-parallel attention projection over the replicated attention's
    output (sliced locally, no communication in forward)."""
    plan: dict[str, object] = {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.mlp.0"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.2"] = RowwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel(input_layouts=Replicate())
    return parallelize_module(model, tp_mesh, plan)


class SPBlock(nn.Module):
    """A residual MLP block over a sequence: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, C)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class SPStack(nn.Module):
    """Blocks of :class:`SPBlock` between an input and an output projection; ``forward(x)``
    maps ``(B, T, width)`` to ``(B, T, width)``."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SPBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def parallelize_stack(model: SPStack, tp_mesh: DeviceMesh) -> SPStack:
    """Sequence parallelism between the blocks' matmuls: the norms run on this rank's part of
    the sequence (their weights are replicated DTensors), ``fc1`` gathers the sequence,
    ``fc2`` reduce-scatters it back; the stack takes and returns this rank's part of the
    sequence as a local tensor."""
    plan: dict[str, object] = {"norm": SequenceParallel(use_local_output=True)}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.fc1"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.fc2"] = RowwiseParallel(output_layouts=Shard(1))
    return parallelize_module(model, tp_mesh, plan)


def tp_llama() -> nn.Module:
    """A tiny ``transformers`` Llama whose heads (4, 2 key-value), MLP (48), width (32) and
    vocabulary (100) every tensor-parallel degree up to 4 divides; seeded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """The model's own tensor-parallel plan (its config's ``base_model_tp_plan`` and its head's),
    applied by ``transformers`` itself on ``tp_mesh``, as ``from_pretrained(tp_plan="auto")``
    applies it, without a hub."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    return apply_tensor_parallelism(model, tp_mesh, model._expand_parallel_plan(model.tp_plan))


def stack_batches(steps: int = 4, batch: int = 8, seq: int = 8, width: int = 8) -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, seq, width, generator=g), torch.randn(batch, seq, width, generator=g))
        for _ in range(steps)
    ]


def stack_loss(model: nn.Module, x: Tensor, y: Tensor, mesh: DeviceMesh | None) -> Tensor:
    """The squared error over the whole sequence; with sequence parallelism each tp rank
    computes its part of the sequence's sum (the parts add up to the loss)."""
    if mesh is not None:
        tp, t = mesh["tp"].size(), mesh["tp"].get_local_rank()
        x, y = x.chunk(tp, dim=1)[t], y.chunk(tp, dim=1)[t]
    return (model(x) - y).pow(2).sum() / (y.numel() * (mesh["tp"].size() if mesh else 1))


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's slice of the global batch and the number of slices: one per (replicate,
    dp) coordinate; the tp ranks of one slice see the same data."""
    names = mesh.mesh_dim_names or ()
    index, count = 0, 1
    for name in names:
        if name != "tp":
            index = index * mesh[name].size() + mesh[name].get_local_rank()
            count *= mesh[name].size()
    return index, count


@dataclass
class TPRun:
    """What one rank's 2-D parallel training leaves behind."""

    losses: list[float]  # global mean loss of each step
    norms: list[float]  # the gradient norm clip_grad_norm_ returned at each step
    state: dict[str, Tensor]  # full_state_dict() after the last step
    finished: Any  # what ``finish(model, optimizer, mesh)`` returned


def train_tp(
    model: nn.Module,
    parallelize: Callable[[Any, DeviceMesh], Any],
    shape: tuple[int, ...],
    names: tuple[str, ...],
    make_optimizer: Callable[[Any], Any],
    batches: list,
    loss_fn: Callable[[nn.Module, Tensor, Tensor, DeviceMesh], Tensor],
    clip: float = 1e9,
    finish: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
    **wrap: Any,
) -> list[TPRun]:
    """Parallelize a deep copy of ``model`` on every rank's ``mesh["tp"]``, wrap it over the
    mesh and train it on this rank's slice of each global batch, clipping at ``clip``.

    ``loss_fn(model, x, y, mesh)`` returns the slice's loss on every tp rank, or its part of it
    (their sum is then the slice's loss; ``stack_loss``); the global loss is the mean over
    slices either way: the sum over every rank, divided by the slices and by how many tp ranks
    hold the whole loss (``split_loss``)."""
    split_loss = wrap.pop("split_loss", False)

    def fn(rank: int, mesh: DeviceMesh) -> TPRun:
        m = ShardedModule(parallelize(copy.deepcopy(model), mesh["tp"]), process_group=mesh, **wrap)
        opt = make_optimizer(m.parameters())
        index, count = data_rank(mesh)
        per_loss = count * (1 if split_loss else mesh["tp"].size())
        losses, norms = [], []
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(m, x.chunk(count)[index], y.chunk(count)[index], mesh)
            loss.backward()
            norms.append(m.clip_grad_norm_(clip).item())
            opt.step()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / per_loss)
        state = m.full_state_dict()
        return TPRun(losses, norms, state, finish(m, opt, mesh) if finish else None)

    return run_mesh_ranks(shape, names, fn)


def train_plain(
    model: nn.Module,
    make_optimizer: Callable[[Any], Any],
    batches: list,
    loss_fn: Callable[[nn.Module, Tensor, Tensor, DeviceMesh | None], Tensor],
    clip: float = 1e9,
) -> TPRun:
    """A deep copy of ``model`` trained unwrapped, on each global batch whole."""
    ref = copy.deepcopy(model)
    opt = make_optimizer(ref.parameters())
    losses, norms = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(ref, x, y, None)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        opt.step()
        losses.append(loss.item())
    return TPRun(losses, norms, {k: v.detach().clone() for k, v in ref.state_dict().items()}, None)
