"""Meta-device initialisation: materialise a model built on ``meta`` one unit at a time.

Design note. For a model built under ``with torch.device("meta"):`` the wrapper calls a
:class:`Materializer` for each unit, in pre-order, just before it builds that unit's flat
groups; the groups keep this rank's shard and the full tensors are freed, so memory stays
near one unit whatever the size of the model. Per unit:

1. The parameters the unit owns and the buffers of its own modules (its subtree minus
   nested units) get real storage on the target device. Floating tensors are filled with
   NaN, so whatever no initialiser writes is detected; other dtypes are zero-filled and
   count as written once their version counter moved (any in-place write bumps it).
2. The initialisers that construction would run on those tensors run again, children
   before parents: every module whose subtree holds one of them, ancestors of the unit
   included, gets ``param_init_fn(module)``, else its ``reset_parameters()`` or
   ``_reset_parameters()``. Meanwhile every other tensor of the model is a meta stand-in,
   so writes outside this unit are dropped and nothing sharded is touched. A tied
   parameter is real only in its canonical slot (its first name in ``named_parameters()``),
   so it is initialised by the module that holds that name, as with plain construction
   where tying keeps the first module's parameter.
3. Anything left unwritten raises ``ValueError`` on every rank, naming each tensor.

An initialiser may materialise a module itself with ``module.to_empty(device=...)`` (FSDP's
``param_init_fn`` idiom) before writing it. While initialisers run, ``to_empty`` leaves every
tensor where it is: this unit's are real already (blank, or written by an initialiser that ran
before: a container's ``to_empty`` after its children's initialisers), the other units' stay
meta stand-ins however far it recurses. So what it then leaves unwritten is caught as above,
instead of keeping whatever new memory held (different on each rank), and no other unit is
materialised.

Every rank initialises every unit in full from the same seed, which rank 0 draws from its
default generator (:func:`agree_seed`), reseeded per unit: the full parameters are the same
on every rank and at every world size.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ...comm.collectives import Group, all_reduce, group_rank

__all__ = ["Materializer", "ParamInitFn", "agree_seed", "check_param_init_fn", "is_meta"]

ParamInitFn = Callable[[nn.Module], None]
Slot = tuple[nn.Module, str]
Entry = tuple[str, nn.Parameter, list[Slot]]

# NOTE: the default generators are process-wide. Ranks run as threads of one process (the
# fast test tier) must not interleave their draws, so every draw made here holds this lock.
_RNG_LOCK = threading.Lock()


def is_meta(module: nn.Module) -> bool:
    """Whether ``module`` has a parameter or buffer on the meta device."""
    return any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers())


def check_param_init_fn(module: nn.Module, param_init_fn: ParamInitFn | None) -> None:
    """``param_init_fn`` initialises a meta-device model; for any other it is a mistake."""
    if param_init_fn is None:
        return
    if not callable(param_init_fn):
        raise TypeError(
            f"param_init_fn must be a callable (module) -> None, got {type(param_init_fn).__name__}"
        )
    if not is_meta(module):
        raise ValueError(
            "ShardedModule: param_init_fn initialises a model built on the meta device, but "
            "this model's parameters are already materialised. Drop param_init_fn, or build "
            "the model under `with torch.device('meta'):`."
        )


def agree_seed(group: Group, device: torch.device) -> int:
    """The seed every rank initialises from: one draw from rank 0's default generator.

    The other ranks draw and discard one number once they know it, so every rank's generator
    advances alike (and, as threads of one process, never before rank 0 has drawn). One
    small all-reduce.
    """
    rank = group_rank(group)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == 0:
        with _RNG_LOCK:
            seed.fill_(_draw())
    all_reduce(seed, group).wait()
    if rank != 0:
        with _RNG_LOCK:
            _draw()
    return int(seed.item())


def _draw() -> int:
    return int(torch.randint(2**62, (1,)).item())


class Materializer:
    """Materialises and initialises a meta-device model one unit at a time (see module docs).

    Args:
        root: the model; its parameters on the meta device.
        units: the unit modules in pre-order, root first.
        device: where materialised tensors go.
        seed: the same on every rank (:func:`agree_seed`); unit ``i`` runs seeded ``seed + i``.
        param_init_fn: called on each module instead of its ``reset_parameters()``; it must
            initialise that module's tensors in place and not communicate.
    """

    def __init__(
        self,
        root: nn.Module,
        units: list[nn.Module],
        device: torch.device,
        seed: int,
        param_init_fn: ParamInitFn | None = None,
    ) -> None:
        self.root = root
        self.units = units
        self.device = device
        self.seed = seed
        self.param_init_fn = param_init_fn
        self._unit_ids = {id(u) for u in units}
        self._names = {id(m): name for name, m in root.named_modules()}
        # Every tensor slot of the model, with a meta tensor shaped like what it holds now.
        self._stand_ins: list[tuple[dict[str, Tensor | None], str, Tensor]] = [
            (table, key, _stand_in(t))
            for m in root.modules()
            for table in (m._parameters, m._buffers)
            for key, t in table.items()
            if t is not None
        ]

    def __call__(self, index: int, entries: list[Entry]) -> list[Entry]:
        """Materialise and initialise unit ``index``: the parameters it owns, its buffers.

        Args:
            index: the unit's position in ``units``.
            entries: ``(name, parameter, slots)`` of each meta parameter the unit owns.

        Returns:
            ``entries`` with each parameter replaced, in every slot, by its real one.

        Raises:
            ValueError: a tensor no initialiser wrote (wholly or in part), naming each.
        """
        region = self._region(self.units[index])
        params = [
            (name, _param_like(_blank(p, self.device), p), slots) for name, p, slots in entries
        ]
        buffers = self._buffers(region)
        fresh = [p for _, p, _ in params] + [b for *_, b, new in buffers if new]
        versions = {id(t): t._version for t in fresh}
        replaced, now = self._initialise(index, region, params, buffers)
        if replaced:
            raise ValueError(
                f"ShardedModule: an initialiser replaced parameter(s) {replaced} of the "
                "meta-device model with new tensors; initialise parameters in place "
                "(torch.nn.init functions, tensor.copy_)."
            )
        unwritten = []
        for name, p, slots in params:
            for m, attr in slots:
                m._parameters[attr] = p
            if _unwritten(p, versions[id(p)]):
                unwritten.append(f"parameter '{name}' (in {type(slots[0][0]).__name__})")
        for (name, m, key, b, new), after in zip(buffers, now):
            m._buffers[key] = after  # an initialiser may also assign a new buffer
            if new and (
                after is None or after.is_meta or (after is b and _unwritten(b, versions[id(b)]))
            ):
                unwritten.append(f"buffer '{name}' (in {type(m).__name__})")
        if unwritten:
            raise ValueError(self._unwritten_message(unwritten))
        return params

    def _buffers(self, region: list[nn.Module]) -> list[tuple[str, nn.Module, str, Tensor, bool]]:
        """``(name, module, key, tensor, new)`` of each buffer of the region's modules: a meta
        buffer gets a blank real tensor (``new``), one per buffer however many slots hold it."""
        made: dict[int, Tensor] = {}
        found = []
        for m in region:
            for key, b in m._buffers.items():
                if b is None:
                    continue
                new = b.is_meta
                if new:
                    if id(b) not in made:
                        made[id(b)] = _blank(b, self.device)
                    b = made[id(b)]
                found.append((self._name(m, key), m, key, b, new))
        return found

    def _initialise(
        self,
        index: int,
        region: list[nn.Module],
        params: list[Entry],
        buffers: list[tuple[str, nn.Module, str, Tensor, bool]],
    ) -> tuple[list[str], list[Tensor | None]]:
        """Run the initialisers with this unit's tensors real and every other one a stand-in.

        Returns:
            The names of parameters an initialiser replaced, and what each buffer slot holds.
        """
        targets = {id(m) for m in region} | {id(slots[0][0]) for _, _, slots in params}
        saved = [(table, key, table[key]) for table, key, _ in self._stand_ins]
        try:
            for table, key, stand_in in self._stand_ins:
                table[key] = stand_in
            for _, p, slots in params:
                owner, attr = slots[0]
                owner._parameters[attr] = p
            for _, m, key, b, _ in buffers:
                m._buffers[key] = b
            with _seeded(self.seed + index, self.device), torch.no_grad(), _ToEmptyKeeps():
                for m in self._init_order(targets):
                    self._init_module(m)
            replaced = [n for n, p, slots in params if _held(slots[0]) is not p]
            return replaced, [m._buffers[key] for _, m, key, _, _ in buffers]
        finally:
            for table, key, held in saved:
                table[key] = held

    def _region(self, unit: nn.Module) -> list[nn.Module]:
        """The unit's own modules: its subtree, minus the subtrees of nested units."""
        found: dict[int, nn.Module] = {}

        def walk(m: nn.Module) -> None:
            found[id(m)] = m
            for child in m.children():
                if id(child) not in self._unit_ids and id(child) not in found:
                    walk(child)

        walk(unit)
        return list(found.values())

    def _init_order(self, targets: set[int]) -> list[nn.Module]:
        """Every module whose subtree holds a target module, children before parents."""
        order: dict[int, nn.Module] = {}

        def visit(m: nn.Module) -> bool:
            hit = id(m) in targets
            for child in m.children():
                hit = visit(child) or hit
            if hit:
                order.setdefault(id(m), m)
            return hit

        visit(self.root)
        return list(order.values())

    def _init_module(self, module: nn.Module) -> None:
        if self.param_init_fn is not None:
            self.param_init_fn(module)
            return
        reset = getattr(module, "reset_parameters", None) or getattr(
            module, "_reset_parameters", None
        )
        if callable(reset):
            reset()

    def _name(self, module: nn.Module, key: str) -> str:
        prefix = self._names[id(module)]
        return f"{prefix}.{key}" if prefix else key

    def _unwritten_message(self, unwritten: list[str]) -> str:
        if self.param_init_fn is not None:
            fix = (
                "param_init_fn(module) is called on every module, children first, and must "
                "initialise that module's own parameters and buffers in place. It is given the "
                "module's tensors already on the device (NaN until written), not on meta: a "
                "param_init_fn that materialises and initialises only where tensors are meta "
                "(`if any(t.is_meta ...): module.to_empty(...); module.reset_parameters()`) "
                "initialises nothing here; call the initialisers without that test."
            )
        else:
            fix = (
                "Give those modules a reset_parameters() that initialises all their tensors in "
                "place, or pass ShardedModule(..., param_init_fn=fn) with fn(module) doing it "
                "for each module (for a transformers model: param_init_fn=model._init_weights)."
            )
        return (
            "ShardedModule: meta-device initialisation left these tensors unwritten, wholly or "
            f"in part, so their values would be garbage: {', '.join(unwritten)}. {fix} A "
            "buffer computed in __init__ has no value on the meta device: recompute it there too."
        )


def _stand_in(t: Tensor) -> Tensor:
    meta = torch.empty_like(t, device="meta")
    return _param_like(meta, t) if isinstance(t, nn.Parameter) else meta


def _param_like(data: Tensor, p: Tensor) -> nn.Parameter:
    """A parameter over ``data`` that trains as ``p`` does: ``requires_grad``, ``grad_dtype``,
    and what the user gave ``p`` (tags such as ``p._no_weight_decay``, gradient hooks)."""
    param = nn.Parameter(data, p.requires_grad)
    param.grad_dtype = p.grad_dtype
    for key, value in vars(p).items():
        if key != "_is_param":
            setattr(param, key, value)
    for hook in (p._backward_hooks or {}).values():
        param.register_hook(hook)
    for hook in (p._post_accumulate_grad_hooks or {}).values():
        param.register_post_accumulate_grad_hook(hook)
    return param


def _blank(t: Tensor, device: torch.device) -> Tensor:
    """A tensor like ``t`` on ``device``: NaN if floating (so unwritten values show), else 0."""
    fill = float("nan") if t.is_floating_point() or t.is_complex() else 0
    return torch.full(t.shape, fill, dtype=t.dtype, device=device)


# The function ``Module.to_empty`` maps over the tensors (``torch.empty_like(t, device=...)``).
_TO_EMPTY = next(
    (c for c in nn.Module.to_empty.__code__.co_consts if isinstance(c, CodeType)), None
)


class _ToEmptyKeeps(TorchFunctionMode):
    """While initialisers run, ``Module.to_empty`` gives each tensor back as it is (see the
    module's note); every other call runs as usual."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func is torch.empty_like and sys._getframe(1).f_code is _TO_EMPTY:
            return args[0]
        return func(*args, **(kwargs or {}))


def _held(slot: Slot) -> Tensor | None:
    module, attr = slot
    return module._parameters[attr]


def _unwritten(t: Tensor, version: int) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return t._version == version


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed the CPU generator (and ``device``'s), restoring both afterwards."""
    accelerator = [device] if device.type == "cuda" else []
    with _RNG_LOCK, torch.random.fork_rng(devices=accelerator, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        if accelerator:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield
