"""A DDP script's habits on a sharded model: each works as under DDP, or is refused at its line.

Proves, in process (the same script under ``torchrun`` against DDP itself:
``tests/e2e/test_from_ddp.py``):

- ``model.state_dict()`` and ``optimizer.state_dict()`` hand out this rank's pieces as
  ``ShardPiece`` tensors that know the whole tensor's shape and their element range; saving
  one (``torch.save``, also of a ``.cpu()`` or ``.clone()`` of it) raises naming
  ``full_state_dict``, ``full_optimizer_state_dict`` and ``save_checkpoint``, before the file
  is opened (a checkpoint it would replace is kept), for elementwise
  and shape-aware optimizers and at world size 1; in memory they load back (the optimizer's
  state plain again), and training then goes on exactly as if they had never been taken;
- ``model.module`` is the model (a submodule named ``module`` stays reachable);
- ``DistributedDataParallel(model)`` around it is refused, naming the fix, before its first
  collective (``copy.deepcopy(model)`` makes a sharded copy: ``test_copies.py``); DDP around a
  module holding the sharded model is refused at its first forward, on every rank, and one
  told to leave the sharded parameters alone trains like the plain model;
- attributes set on parameters before wrapping (``p._no_weight_decay = True``) stay on them;
- gradient hooks on parameters, registered before or after wrapping, see this rank's gradient
  of the whole parameter and change what is averaged, as under DDP, at every stage;
- an L2 penalty summed over ``model.parameters()`` outside forward trains as on the plain model;
- ``model.require_backward_grad_sync = False`` keeps gradients local, reduced once at the last
  micro-batch, in parity with the unwrapped model at every stage; it reads ``False`` inside
  ``no_sync()``; ranks that set it differently raise on every rank (before: they waited on each
  other until the timeout); an optimizer step before the synced backward is refused, changing
  nothing;
- ``model.num_parameters()`` counts the whole model where ``p.numel()`` counts pieces;
- weights drawn with a seed per rank are replaced by rank 0's, with a warning, and training
  then matches the unwrapped model built with rank 0's seed, as under DDP;
- a forward on rank 0 alone (evaluation under ``if master_process:``) raises on every rank at
  that forward, naming it and the fix;
- ``torch.save(model)`` of the model object is refused before the file is opened;
- ``torch.distributed`` collectives of a parameter, its ``.grad`` or a state dict's value (a
  hand-written ``average_gradients`` loop, a broadcast of the parameters) are refused before
  they send;
- buffers (BatchNorm's statistics) are rank 0's on every rank after each synchronised step, as
  DDP's, checked against DDP itself after every forward (also hybrid, with ``no_sync()``) and on
  a ``transformers`` ResNet.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_from_ddp.py -q``
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from shardwrap import ShardedModule
from shardwrap.engine.optim.pieces import ShardPiece
from tests.support.hybrid import hybrid_mesh
from tests.support.models import GPT, Block, make_batch
from tests.support.parity import gpt_loss, sgd, train_reference, train_sharded
from tests.support.ranks import run_ranks

MICRO, STEPS = 3, 2


def _run(world_size: int, fn: Any) -> list[Any]:
    return [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=60.0)


def _refused(obj: object) -> str:
    with pytest.raises(TypeError) as info:
        torch.save(obj, io.BytesIO())
    return str(info.value)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_state_dicts_hold_pieces_that_refuse_to_be_saved(
    world_size: int, kind: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = GPT(tied=True)
    x, y = make_batch(0, 4)

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=3e-3)
        return torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02)

    def fn(rank: int, pg: ProcessGroup | None) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = optimizer(list(m.parameters()))
        n = 4 // world_size
        m(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).backward()
        opt.step()
        sd, osd = m.state_dict(), opt.state_dict()
        root = m._shardwrap_root
        params = nn.Module.state_dict(m, keep_vars=True)
        for key in ("wte.weight", "lm_head.weight", "ln_f.weight"):  # lm_head: tied to wte
            piece, param = sd[key], root.param_of[id(params[key])]
            assert isinstance(piece, ShardPiece) and piece.full_shape == param.shape
            layout_piece = param.group.pieces[param.index]
            assert (piece.start, piece.stop) == (layout_piece.start, layout_piece.stop)
        for obj in (sd, {"model": sd}, sd["wte.weight"].cpu(), sd["ln_f.weight"].clone()):
            message = _refused(obj)
            assert "model.full_state_dict(rank0_only=True)" in message
            assert "shardwrap.full_optimizer_state_dict" in message
            assert "shardwrap.save_checkpoint" in message
        # refused before the file is opened: the checkpoint it would replace is kept
        path = tmp_path / f"ckpt-{rank}.pt"
        path.write_bytes(b"the previous checkpoint")
        with pytest.raises(TypeError, match="model.full_state_dict"):
            torch.save({"model": sd, "iter_num": 1}, path)
        assert path.read_bytes() == b"the previous checkpoint"
        torch.save({"model": m.full_state_dict()}, path)  # anything else saves as before
        assert torch.load(path)["model"].keys() == sd.keys()
        held = [v for entry in osd["state"].values() for v in entry.values() if v.ndim > 0]
        assert held and all(isinstance(v, ShardPiece) for v in held)
        assert "full_optimizer_state_dict" in _refused({"optimizer": osd})
        # the optimizer's own state stays plain: its step pays nothing for the pieces
        assert all(type(v) is Tensor for s in opt.state.values() for v in s.values())
        # in memory, both load back (copy.deepcopy keeps them pieces)
        kept_model, kept_opt = copy.deepcopy(sd), copy.deepcopy(osd)
        assert isinstance(kept_model["wte.weight"], ShardPiece)
        m.load_state_dict(kept_model)
        opt.load_state_dict(kept_opt)
        assert all(type(v) is Tensor for s in opt.state.values() for v in s.values())

    _run(world_size, fn)


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_dicts_loaded_back_train_on_as_if_never_saved(world_size: int) -> None:
    torch.manual_seed(0)
    model = GPT()
    batches = [make_batch(s, 4) for s in range(4)]

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        n = 4 // world_size

        def train(m: nn.Module, opt: torch.optim.Optimizer, part: list) -> None:
            for x, y in part:
                m(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).backward()
                opt.step()
                opt.zero_grad()

        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        train(m, opt, batches[:2])
        kept = copy.deepcopy({"model": m.state_dict(), "optimizer": opt.state_dict()})
        train(m, opt, batches[2:])
        resumed = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=3e-3)
        resumed.load_state_dict(kept["model"])
        resumed_opt.load_state_dict(kept["optimizer"])  # before its first step
        train(resumed, resumed_opt, batches[2:])
        return m.full_state_dict(), resumed.full_state_dict()

    for state, resumed in _run(world_size, fn):
        torch.testing.assert_close(resumed, state, atol=0, rtol=0)


class Wrapper(nn.Module):
    """A model holding its network as a submodule named ``module``."""

    def __init__(self) -> None:
        super().__init__()
        self.module = GPT()

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        return self.module(idx, targets)


def test_module_is_the_model_unless_the_model_names_a_submodule_so() -> None:
    torch.manual_seed(0)
    model, wrapper = GPT(), Wrapper()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        assert m.module is m and hasattr(m, "module")
        raw_model = m.module  # DDP: the model it wraps, with its methods and attributes
        assert raw_model.lm_head is m.lm_head
        w = ShardedModule(copy.deepcopy(wrapper), auto_wrap=Block, process_group=pg)
        assert isinstance(w.module, GPT) and w.module is not w

    run_ranks(2, fn, timeout=30.0)


def test_ddp_around_the_sharded_model_is_refused_before_it_communicates() -> None:
    """A migrated script that keeps its ``DDP(model)`` line: DDP's start-up broadcast would
    overwrite rank 1's pieces with rank 0's and its all-reduce average pieces of different
    ranges (parameters 0.6 off after three steps, before). Refused as DDP is built, before
    its first collective: every rank's pieces are unchanged, and the model trains on."""
    torch.manual_seed(0)
    model = GPT()
    idx, targets = make_batch(0, 4)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        before = m.full_state_dict()
        pieces = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(TypeError) as raised:
            DistributedDataParallel(m, process_group=pg)
        message = str(raised.value)
        assert message.startswith("DistributedDataParallel(model) around a ShardedModule")
        assert "drop the DDP(...) line" in message and '("replicate", "shard")' in message
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), pieces, strict=True))
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()

    run_ranks(2, fn, timeout=30.0)


class Outer(nn.Module):
    """A plain module around a network sharded on its own (``outer.body =
    ShardedModule(outer.body)``), with a head of its own. Each of the network's layers is a unit
    holding one parameter, so every rank's pieces have the same shapes and DDP's constructor
    accepts them (pieces of unequal shapes fail there, in DDP's words)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False)
        )
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x)).square().mean()


def _outer(pg: ProcessGroup, outer: Outer) -> Outer:
    m = copy.deepcopy(outer)
    m.body = ShardedModule(m.body, auto_wrap=nn.Linear, process_group=pg)
    return m


def test_ddp_around_a_module_holding_the_sharded_model_is_refused_at_its_first_forward() -> None:
    """``DDP(outer)`` with ``outer.body`` sharded: DDP's start-up broadcast copies rank 0's
    pieces over rank 1's, and its all-reduce would average pieces of different ranges (before:
    training went on from the overwritten pieces without a word). Refused at the first forward
    DDP runs, on every rank, before a gather, naming the module and both fixes. The ranks'
    forwards take turns: DDP marks the one it runs for the whole process, and these ranks are
    threads of one."""
    torch.manual_seed(0)
    outer, x = Outer(), torch.randn(4, 8)
    turns = threading.Lock()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _outer(pg, outer)
        ddp = DistributedDataParallel(m, process_group=pg)
        stats = m.body._shardwrap_root.stats
        before = stats.calls.copy()
        with turns, pytest.raises(TypeError) as raised:
            ddp(x.chunk(2)[rank])
        assert stats.calls == before
        message = str(raised.value)
        assert message.startswith(
            "DistributedDataParallel around a module that holds a ShardedModule (at 'body'): "
            "DDP replicates the ShardedModule's parameters (0.weight, 2.weight)"
        )
        assert "ShardedModule(model, auto_wrap=...) in place of" in message
        assert "_set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in " in message
        assert "n.startswith('body.')" in message

    run_ranks(2, fn, timeout=30.0)


def test_ddp_told_to_leave_the_sharded_parameters_alone_trains_like_the_plain_model() -> None:
    """The other way out: DDP replicates the outer module's own parameters, the ShardedModule
    shards its own; three AdamW steps on half the batch per rank match the plain model's on
    the whole batch."""
    torch.manual_seed(0)
    outer = Outer()
    batches = [torch.randn(4, 8) for _ in range(3)]
    plain = copy.deepcopy(outer)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for x in batches:
        plain(x).backward()
        opt.step()
        opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        m = _outer(pg, outer)
        sharded = [n for n, _ in m.named_parameters() if n.startswith("body.")]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, sharded)
        ddp = DistributedDataParallel(m, process_group=pg)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        for x in batches:
            ddp(x.chunk(2)[rank]).backward()
            opt.step()
            opt.zero_grad()
        return m.body.full_state_dict(), {k: v.clone() for k, v in m.head.state_dict().items()}

    for body, head in run_ranks(2, fn, timeout=30.0):
        torch.testing.assert_close(body, plain.body.state_dict(), atol=1e-6, rtol=0)
        torch.testing.assert_close(head, plain.head.state_dict(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("world_size", [1, 2])
def test_saving_the_model_object_is_refused_before_the_file_is_opened(
    world_size: int, tmp_path: Path
) -> None:
    """``torch.save(model, "model.pt")`` (the model object, a habit of older scripts), also
    inside a dict, and ``pickle.dumps(model)``: refused naming ``save_checkpoint`` and
    ``full_state_dict``, and the file it would replace is kept (it was pickling's "Can't pickle
    <class ...Sequential>: it's not the same object", after ``torch.save`` had emptied the
    file). ``copy.copy(model)`` still makes a shallow copy."""
    torch.manual_seed(0)
    model = GPT()

    def fn(rank: int, pg: ProcessGroup | None) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        path = tmp_path / f"model-{rank}.pt"
        path.write_bytes(b"the last good save")
        for save in (
            lambda: torch.save(m, path),
            lambda: torch.save({"model": m, "step": 3}, path),
            lambda: pickle.dumps(m),
        ):
            with pytest.raises(TypeError) as raised:
                save()
            message = str(raised.value)
            assert message.startswith("torch.save(model) of a ShardedModule")
            assert "shardwrap.save_checkpoint(path, model, optimizer)" in message
            assert "state = model.full_state_dict() on every rank" in message
            assert path.read_bytes() == b"the last good save"
        assert copy.copy(m).blocks is m.blocks  # a shallow copy still works, as on any module

    _run(world_size, fn)


def test_parameters_and_their_data_refuse_to_be_saved_before_the_file_is_opened(
    tmp_path: Path,
) -> None:
    """``torch.save({n: p.data for n, p in model.named_parameters()}, path)`` on rank 0 (and
    the parameters themselves) would write rank 0's pieces under the whole parameters' names:
    refused on every rank, naming ``full_state_dict`` and ``save_checkpoint``, before the file
    it would replace is opened (before: ``.data`` was saved as if whole without a word, and the
    parameters raised pickling's "cannot pickle 'weakref.ReferenceType' object" after the file
    was emptied). A copy of a piece (an EMA) is a plain tensor and saves."""
    torch.manual_seed(0)
    model = GPT()

    def fn(rank: int, pg: ProcessGroup | None) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        path = tmp_path / f"weights-{rank}.pt"
        path.write_bytes(b"the last good save")
        for held in (
            {n: p.data for n, p in m.named_parameters()},
            dict(m.named_parameters()),
            [m.wte.weight.data],
        ):
            with pytest.raises(TypeError) as raised:
                torch.save(held, path)
            message = str(raised.value)
            assert re.match(r"pickling [\w.]+ \(torch.save\), this rank's piece of it", message)
            assert "model.full_state_dict(rank0_only=True)" in message
            assert "shardwrap.save_checkpoint(path, model, optimizer)" in message
            assert path.read_bytes() == b"the last good save"
        with pytest.raises(TypeError, match="pickling wte.weight"):
            pickle.dumps(m.wte.weight.data)
        ema = [p.detach().clone() for p in m.parameters()]
        torch.save(ema, path)
        torch.testing.assert_close(torch.load(path), ema, atol=0, rtol=0)

    _run(2, fn)


def _decay_groups(m: nn.Module) -> list[dict[str, Any]]:
    """Weight-decay groups built from a tag on the parameters, as Mamba's training scripts
    do."""
    params = list(m.parameters())
    plain = [p for p in params if not getattr(p, "_no_weight_decay", False)]
    tagged = [p for p in params if getattr(p, "_no_weight_decay", False)]
    return [{"params": plain, "weight_decay": 0.5}, {"params": tagged, "weight_decay": 0.0}]


def _tagged(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with tags on three parameters (a deep copy drops a parameter's
    attributes, so they are set on each copy)."""
    model = copy.deepcopy(model)
    for p in (model.wpe.weight, model.blocks[0].ln_1.weight):
        p._no_weight_decay = True
    model.lm_head.weight.lr_scale = 0.5
    return model


def test_attributes_set_on_parameters_stay_on_them() -> None:
    """A tag set on a parameter before wrapping is on its shard parameter (before, it was
    dropped: an optimizer built from the tags decayed every parameter, and training departed
    from DDP's without a word); the tagged groups train as the plain model's."""
    torch.manual_seed(0)
    model = GPT()
    batches = [make_batch(s, 4) for s in range(2)]
    plain = _tagged(model)
    opt = torch.optim.SGD(_decay_groups(plain), lr=0.1, momentum=0.9)
    for idx, targets in batches:
        plain(idx, targets).backward()
        opt.step()
        opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(_tagged(model), auto_wrap=Block, process_group=pg)
        assert m.wpe.weight._no_weight_decay and m.blocks[0].ln_1.weight._no_weight_decay
        assert m.lm_head.weight.lr_scale == 0.5
        assert not hasattr(m.wte.weight, "_no_weight_decay")
        opt = torch.optim.SGD(_decay_groups(m), lr=0.1, momentum=0.9)
        for idx, targets in batches:
            m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    for state in run_ranks(2, fn, timeout=30.0):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-5, rtol=0)


def _new_rows_only(vocab: int) -> Any:
    """A gradient hook that trains only the embedding's last four rows (new tokens), as
    fine-tuning scripts that add tokens do."""
    mask = torch.zeros(vocab, 1)
    mask[-4:] = 1.0
    return lambda g: g * mask


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_hooks_on_parameters_fire_as_under_ddp(stage: int) -> None:
    """``p.register_hook(fn)`` sees this rank's gradient of the whole parameter and what it
    returns is averaged, as DDP's: a mask registered before wrapping keeps the embedding's
    other rows exactly as they were, a scale registered after wrapping scales, and training
    matches the plain model's with the same hooks (before: both were dropped without a word,
    every row trained). A post-accumulate-grad hook registered before wrapping stays too."""
    torch.manual_seed(0)
    model = GPT()
    batches = [make_batch(s, 4) for s in range(STEPS)]
    rows = model.wte.weight.shape[0] - 4
    plain = copy.deepcopy(model)
    plain.wte.weight.register_hook(_new_rows_only(rows + 4))
    plain.blocks[0].ln_1.weight.register_hook(lambda g: g * 0.5)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for idx, targets in batches:
        plain(idx, targets).backward()
        opt.step()
        opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], int]:
        m = copy.deepcopy(model)
        m.wte.weight.register_hook(_new_rows_only(rows + 4))
        landed: list[int] = []
        m.ln_f.weight.register_post_accumulate_grad_hook(lambda p: landed.append(1))
        m = ShardedModule(m, auto_wrap=Block, process_group=pg, stage=stage)
        m.blocks[0].ln_1.weight.register_hook(lambda g: g * 0.5)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for idx, targets in batches:
            m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict(), len(landed)

    for state, landed in run_ranks(2, fn, timeout=60.0):
        assert landed == STEPS
        kept, trained = state["wte.weight"].split([rows, 4])
        assert torch.equal(kept, model.wte.weight[:rows])
        assert not torch.equal(trained, model.wte.weight[rows:])
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_penalty_summed_over_the_parameters_trains_as_on_the_plain_model(stage: int) -> None:
    """``loss + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())``, a DDP script's L2
    penalty outside forward: each rank's pieces get their elements' gradients, and three SGD
    steps match the plain model's on the whole batch."""
    torch.manual_seed(0)
    model = GPT()
    batches = [make_batch(s, 4) for s in range(STEPS)]

    def penalised(m: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
        return m(idx, targets) + 1e-2 * sum(p.pow(2).sum() for p in m.parameters())

    ref = train_reference(model, sgd, batches, penalised)
    for run in train_sharded(model, 2, sgd, batches, penalised, auto_wrap=Block, stage=stage):
        torch.testing.assert_close(run.state, ref.state, atol=1e-6, rtol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_collectives_on_pieces_and_their_gradients_are_refused_before_sending(stage: int) -> None:
    """Lines of a script that synchronises by hand, left in: the ``average_gradients`` loop
    (``dist.all_reduce(p.grad.data)``, then a division by the world size) and a broadcast of
    every parameter (or its ``data``), or of every value of ``model.state_dict()`` (Horovod's
    ``broadcast_parameters``), from rank 0. Each rank's ``.grad``, parameter and state dict value
    are its pieces, so they
    would add or copy different elements, or wait forever where the pieces' sizes differ
    (before: the ranks hung at the first gradient whose pieces differed in size). Each
    is refused on every rank before anything is sent, naming the fix, and training then goes
    on exactly as the plain model's."""
    torch.manual_seed(0)
    model = GPT()
    batches = [make_batch(s, 4) for s in range(STEPS)]
    ref = train_reference(model, sgd, batches, gpt_loss)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=Block, stage=stage)
        opt = sgd(m.parameters())
        for idx, targets in batches:
            m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            for p in m.parameters():
                with pytest.raises(TypeError, match="average_gradients loop"):
                    dist.all_reduce(p.grad.data, group=pg)
                for sent in (p, p.data):
                    with pytest.raises(TypeError, match=r"gathered\(modifier_rank=0\)"):
                        dist.broadcast(sent, 0, group=pg)
            opt.step()
            opt.zero_grad()
        for value in m.state_dict().values():
            with pytest.raises(TypeError, match=r"load_state_dict\(full\)"):
                dist.broadcast(value, 0, group=pg)
        return m.full_state_dict()

    for state in run_ranks(2, fn, timeout=60.0):
        torch.testing.assert_close(state, ref.state, atol=1e-6, rtol=0)


# gradient accumulation -------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_require_backward_grad_sync_accumulates_and_reduces_once(stage: int) -> None:
    torch.manual_seed(0)
    model = GPT()
    batches = [[make_batch(10 * s + i, 4) for i in range(MICRO)] for s in range(STEPS)]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for micro in batches:
        for x, y in micro:
            (ref(x, y) / MICRO).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[int], dict[str, Tensor]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=stage)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        assert m.require_backward_grad_sync
        with m.no_sync():
            assert not m.require_backward_grad_sync
        assert m.require_backward_grad_sync
        reduced = []
        for micro in batches:
            for i, (x, y) in enumerate(micro):
                m.require_backward_grad_sync = i == MICRO - 1  # nanoGPT's line
                before = m.comm_stats.calls.get("reduce_scatter", 0)
                (m(x.chunk(2)[rank], y.chunk(2)[rank]) / MICRO).backward()
                reduced.append(m.comm_stats.calls.get("reduce_scatter", 0) - before)
            opt.step()
            opt.zero_grad()
        return reduced, m.full_state_dict()

    for reduced, state in run_ranks(2, fn, timeout=60.0):
        for step in range(STEPS):
            *accumulated, last = reduced[step * MICRO : (step + 1) * MICRO]
            assert accumulated == [0] * (MICRO - 1) and last > 0, reduced
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("closure", [False, True], ids=["", "closure"])
def test_a_step_before_the_synced_backward_is_refused_changing_nothing(
    stage: int, closure: bool
) -> None:
    """``opt.step()`` after a backward under ``no_sync()`` (or
    ``require_backward_grad_sync=False``), before the synced one: the accumulated gradients are
    unreduced and outside ``.grad``, so the step would apply weight decay alone (before: SGD
    moved every weight by its decay, without a word, and ``zero_grad()`` then dropped the
    gradients). It raises on every rank, naming ``no_sync``, and changes neither the weights nor
    the optimizer; the step after the synced backward then matches the plain model's, also
    where that backward runs in a closure given to the step (as Lightning runs it)."""
    torch.manual_seed(0)
    model = GPT()
    micro = [make_batch(i, 4) for i in range(2)]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for x, y in micro:
        (ref(x, y) / 2).backward()
    ref_opt.step()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=stage)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        before = m.full_state_dict()
        (x, y), (x2, y2) = micro
        with m.no_sync():
            (m(x.chunk(2)[rank], y.chunk(2)[rank]) / 2).backward()
            with pytest.raises(RuntimeError, match=r"SGD.step\(\) after a backward under"):
                opt.step()
        m.require_backward_grad_sync = False
        with pytest.raises(RuntimeError, match="Step after the synced backward"):
            opt.step()
        m.require_backward_grad_sync = True
        assert opt.state == {}
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)

        def synced() -> Tensor:
            loss = m(x2.chunk(2)[rank], y2.chunk(2)[rank]) / 2
            loss.backward()
            return loss

        if closure:
            opt.step(synced)
        else:
            synced()
            opt.step()
        return m.full_state_dict()

    for state in run_ranks(2, fn, timeout=60.0):
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_closure_leaving_gradients_unreduced_is_refused_before_the_update(stage: int) -> None:
    """A step given a closure was not checked (the closure computes the gradients inside the
    step): one whose backward ran under ``no_sync()``, or given after such a backward, stepped
    on none of them, momentum and decay alone, without a word. Now the closure is followed by
    the check, which raises on every rank before the update, naming ``no_sync``."""
    torch.manual_seed(0)
    model = GPT()
    x, y = make_batch(0, 4)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=stage)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        before = m.full_state_dict()

        def unsynced() -> Tensor:
            with m.no_sync():
                loss = m(x.chunk(2)[rank], y.chunk(2)[rank])
                loss.backward()
            return loss

        refused = r"SGD.step\(\) after a backward under"
        with pytest.raises(RuntimeError, match=refused):
            opt.step(unsynced)  # the closure's own backward under no_sync
        loss = unsynced()
        with pytest.raises(RuntimeError, match=refused):
            opt.step(closure=lambda: loss)  # given after one
        assert opt.state == {}
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)

    run_ranks(2, fn, timeout=60.0)


def test_a_gradient_norm_between_no_sync_backwards_is_refused_naming_when_to_take_it() -> None:
    """Between backwards under ``no_sync()`` the gradients are unreduced, outside ``.grad``:
    ``clip_grad_norm_`` there returned 0.0 (the norm of the zeros standing in), and its
    in-place scaling made the next backward raise that a ``.grad`` was changed. Now the norm
    raises, on every rank, saying to take it after the synced backward; there it is the plain
    model's."""
    torch.manual_seed(0)
    model = GPT()
    micro = [make_batch(i, 4) for i in range(2)]
    ref = copy.deepcopy(model)
    for x, y in micro:
        (ref(x, y) / 2).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)

    def fn(rank: int, pg: ProcessGroup) -> Tensor:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        (x, y), (x2, y2) = micro
        with m.no_sync():
            (m(x.chunk(2)[rank], y.chunk(2)[rank]) / 2).backward()
            for clip in (torch.nn.utils.clip_grad_norm_, lambda ps, n: m.clip_grad_norm_(n)):
                with pytest.raises(RuntimeError, match="after the synced backward"):
                    clip(m.parameters(), 1.0)
        (m(x2.chunk(2)[rank], y2.chunk(2)[rank]) / 2).backward()
        return torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)

    for norm in run_ranks(2, fn, timeout=60.0):
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_ranks_that_differ_in_grad_sync_raise_on_every_rank(stage: int) -> None:
    torch.manual_seed(0)
    model = GPT()
    x, y = make_batch(0, 4)

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=stage)
        m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        m.require_backward_grad_sync = rank == 0
        with pytest.raises(RuntimeError, match="gradient synchronisation differs") as info:
            m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        return str(info.value)

    # a short timeout: a wait for a reduction that never comes fails the test, not a hang
    for message in run_ranks(2, fn, timeout=20.0):
        assert "require_backward_grad_sync" in message and "every rank" in message


# counting, seeds, evaluation -------------------------------------------------------------


def test_num_parameters_counts_the_whole_model() -> None:
    torch.manual_seed(0)
    model = GPT(tied=True)
    model.wpe.weight.requires_grad_(False)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embeddings = model.wte.weight.numel() + model.wpe.weight.numel()

    def fn(rank: int, pg: ProcessGroup) -> int:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        assert m.num_parameters() == total
        assert m.num_parameters(only_trainable=True) == trainable
        assert m.num_parameters(exclude_embeddings=True) == total - embeddings
        return sum(p.numel() for p in m.parameters())  # this rank's pieces

    pieces = run_ranks(2, fn, timeout=30.0)
    assert sum(pieces) == total and all(n < total for n in pieces)


def test_a_seed_per_rank_starts_every_rank_from_rank_0s_weights() -> None:
    models = []
    for rank in range(2):
        torch.manual_seed(1337 + rank)  # nanoGPT's seed per rank
        models.append(GPT())
    ref = copy.deepcopy(models[0])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = [make_batch(s, 4) for s in range(2)]
    for x, y in batches:
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(models[rank], auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in batches:
            m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    with pytest.warns(UserWarning, match="rank 0's were copied to every rank") as warned:
        states = run_ranks(2, fn, timeout=30.0)
    assert "wte.weight" in str(warned[0].message)
    for state in states:
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("change", ["flipped", "transposed"])
def test_the_same_values_in_another_order_on_one_rank_are_rank_0s_after_wrapping(
    change: str,
) -> None:
    """Rank 1's weight holds rank 0's values reordered (rows flipped, a square matrix
    transposed): its sum and norm agree, so only their order tells them apart. Every rank
    starts from rank 0's, with the warning (before: no warning, and each rank kept its own
    pieces of the two, a weight neither rank had)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))

    def fn(rank: int, pg: ProcessGroup) -> Tensor:
        m = copy.deepcopy(model)
        if rank == 1:
            w = m[0].weight
            with torch.no_grad():
                w.copy_(w.flip(0) if change == "flipped" else w.t().clone())
        wrapped = ShardedModule(m, process_group=pg)
        return wrapped.full_state_dict()["0.weight"]

    with pytest.warns(UserWarning, match=r"\['0\.weight'\]\); rank 0's were copied"):
        weights = run_ranks(2, fn, timeout=30.0)
    for weight in weights:
        torch.testing.assert_close(weight, model[0].weight.detach(), atol=0, rtol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_evaluation_on_rank_0_alone_raises_at_that_forward(stage: int) -> None:
    torch.manual_seed(0)
    model = GPT()
    x, y = make_batch(0, 4)

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=stage)
        opt = torch.optim.AdamW(m.parameters())
        m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        opt.step()
        opt.zero_grad()
        out_of_step = pytest.raises(RuntimeError, match="ranks are at different steps")
        if rank == 0:  # if master_process: estimate_loss()
            with torch.no_grad(), out_of_step as info:
                m(x, y)
        else:  # the next step's forward meets it
            with out_of_step as info:
                m(x.chunk(2)[rank], y.chunk(2)[rank])
        return str(info.value)

    for message in run_ranks(2, fn, timeout=30.0):
        assert "rank 0: forward pass 2, gathering unit 0 (GPT) for a forward without grad" in (
            message
        )
        assert "if master_process:" in message and "docs/ddp.md" in message


@pytest.mark.parametrize(
    "name, fix",
    [
        ("join", "DistributedSampler(dataset, drop_last=True)"),
        ("join_hook", "every rank runs as many passes"),
        ("register_comm_hook", "MixedPrecision(reduce_dtype=torch.bfloat16)"),
        ("_set_static_graph", "drop it"),
    ],
)
def test_ddp_methods_without_a_namesake_raise_naming_what_to_do(name: str, fix: str) -> None:
    """``with model.join():`` (uneven inputs), ``model.register_comm_hook(...)``: an
    ``AttributeError`` naming DDP's method and what to write instead (before: only that the
    model has no such attribute), and ``hasattr`` still says ``False``."""
    m = ShardedModule(GPT(), auto_wrap=Block)
    with pytest.raises(AttributeError) as raised:
        getattr(m, name)
    message = str(raised.value)
    assert message.startswith(f"GPT.{name}: DistributedDataParallel's {name}() has no namesake")
    assert fix in message
    assert not hasattr(m, name)


def test_uneven_inputs_raise_on_every_rank_where_a_rank_out_of_batches_goes_on() -> None:
    """What DDP's ``join()`` is for: rank 1 has one batch fewer and goes on to gather the full
    state dict while rank 0 runs its last forward. Both ranks raise, naming where each is."""
    torch.manual_seed(0)
    model = GPT()
    x, y = make_batch(0, 4)

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with pytest.raises(RuntimeError, match="ranks are at different steps") as info:
            for _ in range(3 - rank):
                m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
                opt.step()
                opt.zero_grad()
            m.full_state_dict()
        return str(info.value)

    for message in run_ranks(2, fn, timeout=30.0):
        assert "rank 0: forward pass 3" in message
        assert "rank 1: forward pass 2, calling full_state_dict" in message


class ConvNet(nn.Module):
    """Two convolutions with BatchNorm (running statistics and a batch count in buffers) and a
    constant buffer no forward changes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(6, 6, 3), nn.BatchNorm2d(6), nn.ReLU())
        self.head = nn.Linear(6, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x: Tensor) -> Tensor:  # x: (B, 3, H, W)
        return self.head(self.b(self.a(x)).mean((2, 3))) * self.scale


def _buffers(m: nn.Module) -> dict[str, Tensor]:
    return {n.removeprefix("module."): b.clone() for n, b in m.named_buffers()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_buffers_are_rank_zeros_on_every_rank_after_each_step_as_under_ddp(
    world_size: int,
) -> None:
    """BatchNorm's running statistics, each rank's own from its own batch during a step, are
    rank 0's on every rank after each step's last backward, as DDP copies rank 0's buffers
    before the forward that follows a synchronised one: an evaluation on every rank runs the
    model rank 0 saves, exactly DDP's. Three steps of two micro-batches (the first under
    ``no_sync()``, which shares nothing), against DDP itself on the same batches, after every
    forward; at 4 ranks with hybrid sharding (2 x 2) too. The constant buffer is never sent."""
    torch.manual_seed(0)
    model = ConvNet()
    batches = [[torch.randn(2 * world_size, 3, 8, 8) * (1 + s) for _ in range(2)] for s in range(3)]
    probe = torch.randn(2 * world_size, 3, 8, 8)

    def train(m: nn.Module, rank: int, count: Any) -> tuple[list[Any], Tensor]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        seen = []
        for micro in batches:
            for i, x in enumerate(micro):
                with m.no_sync() if i == 0 else contextlib.nullcontext():
                    loss = m(x.chunk(world_size)[rank]).square().mean()
                    seen.append((loss.item(), _buffers(m)))
                    loss.backward()
                seen.append(count())
            opt.step()
            opt.zero_grad()
        m.eval()
        with torch.no_grad():
            return seen, m(probe.chunk(world_size)[rank])

    def fn(rank: int, pg: ProcessGroup) -> tuple[Any, Any, dict[str, Tensor]]:
        ddp = DistributedDataParallel(copy.deepcopy(model), process_group=pg)
        group = hybrid_mesh(pg) if world_size == 4 else pg
        m = ShardedModule(copy.deepcopy(model), auto_wrap=nn.Sequential, process_group=group)
        stats = m.comm_stats
        ours = train(m, rank, lambda: stats.bytes.get("broadcast", 0))
        return train(ddp, rank, lambda: None), ours, m.full_state_dict()

    results = run_ranks(world_size, fn, timeout=60.0)
    rank0 = results[0][0][0][-2][1]  # rank 0's buffers after its last forward, under DDP
    for rank, ((ddp_seen, ddp_out), (seen, out), state) in enumerate(results):
        for (ddp_loss, ddp_buffers), (loss, buffers) in zip(ddp_seen[::2], seen[::2], strict=True):
            assert loss == pytest.approx(ddp_loss, abs=1e-6)
            torch.testing.assert_close(buffers, ddp_buffers, atol=1e-6, rtol=0)
        torch.testing.assert_close(out, ddp_out, atol=1e-6, rtol=0)
        torch.testing.assert_close({k: state[k] for k in rank0}, rank0, atol=1e-6, rtol=0)
        # Sent after each synchronised backward only, the same bytes each time: the two
        # BatchNorms' statistics (float32) and counts (int64), not the constant buffer. On a
        # hybrid mesh the first rank of each shard group takes them across replicas first.
        hops = 2 if world_size == 4 and rank % 2 == 0 else 1
        per_step = (2 * 2 * 6 * 4 + 2 * 8) * hops
        assert seen[1::2] == [s * per_step for s in (0, 1, 1, 2, 2, 3)]
    first, second = (r[0][0][-2][1]["a.1.running_mean"] for r in results[:2])
    assert (first - second).abs().max() > 1e-3  # the ranks' own statistics did differ


def test_a_transformers_resnet_trains_and_evaluates_on_every_rank_as_under_ddp() -> None:
    """A ``transformers`` ResNet (BatchNorm in every stage, 18 buffers) built from a config,
    its stages as units: three SGD steps on each rank's half of the batch, then an evaluation
    on every rank, give DDP's logits and buffers exactly."""
    from transformers import ResNetConfig, ResNetForImageClassification
    from transformers.models.resnet.modeling_resnet import ResNetStage

    torch.manual_seed(0)
    config = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    model = ResNetForImageClassification(config)
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(8, 3, 16, 16, generator=generator) for _ in range(3)]
    labels = [torch.randint(3, (8,), generator=generator) for _ in range(3)]
    probe = torch.randn(8, 3, 16, 16, generator=generator)

    def train(m: nn.Module, rank: int) -> tuple[Tensor, dict[str, Tensor]]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in zip(images, labels, strict=True):
            m(pixel_values=x.chunk(2)[rank], labels=y.chunk(2)[rank]).loss.backward()
            opt.step()
            opt.zero_grad()
        m.eval()
        with torch.no_grad():
            return m(pixel_values=probe.chunk(2)[rank]).logits, _buffers(m)

    def fn(rank: int, pg: ProcessGroup) -> tuple[Any, Any]:
        ddp = DistributedDataParallel(copy.deepcopy(model), process_group=pg)
        m = ShardedModule(copy.deepcopy(model), auto_wrap=ResNetStage, process_group=pg)
        return train(ddp, rank), train(m, rank)

    for (ddp_logits, ddp_buffers), (logits, buffers) in run_ranks(2, fn, timeout=60.0):
        assert len(buffers) == 18
        torch.testing.assert_close(logits, ddp_logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(buffers, ddp_buffers, atol=1e-6, rtol=0)
