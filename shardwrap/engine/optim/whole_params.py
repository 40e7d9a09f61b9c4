"""Optimizers that read a parameter's shape step whole parameters, each on one owner rank.

Design note. An elementwise optimizer (SGD, Adam, AdamW, ...) steps each rank's piece of a
parameter exactly as it would step the whole one, so shardwrap hands it the pieces and nothing
else happens. An optimizer that reads a parameter's shape (Muon orthogonalises each matrix's
update; Adafactor factors the second moment into row and column means and scales by the
parameter's norm) needs the whole parameter. For those, every parameter the optimizer steps is
given an *owner* rank among the ranks that shard it: the rank holding most of it, so that the
least moves, while owned elements stay within 1.1x an even split (``ownership.owners``).
Around each step:

1. before it (a step pre-hook, the optimizer's last): each rank sends the owners its pieces of
   their parameters' values and gradients, in one all-to-all; the owner's shard parameter then
   *is* the whole parameter (``p.data`` and ``p.grad`` in the parameter's shape) and every other
   rank's has no ``.grad``, so torch's optimizer steps it on the owner alone and skips it
   elsewhere;
2. after it (a step post-hook, the optimizer's first): the owners send each rank its pieces of
   the new values, in one all-to-all, and every shard parameter is its piece again.

The optimizer's state is made on the owner, in the parameter's shape: 1/N of it per rank, as
balanced as the parameters' sizes allow. There the whole gradient is typed as a gradient
sharded over no one (a ``ShardGrad`` of no group, in the parameter's home), so its norms are
its own, and state made like it or like the parameter is made where a piece's would be: in
the disk tier's files. The whole values and gradient themselves are the step's working set,
in memory. A parameter a rank holds whole is stepped in place.
Per step this moves, three times (values and gradients in, values out), the part of each
parameter that its owner does not hold, against the ``2 (N-1)/N`` of all elements that the
step's gathers and reductions move.

A tensor-parallel parameter (split in blocks over the tp ranks) is stepped whole too: its
owner is one of the ranks holding one copy of the model (shard x tp, the mesh's ``model``
group), its pieces are ranges of its blocks stacked one after the other (``shards/split.py``),
and the owner turns the stacked values into the whole parameter and back around the step. A
parameter every tp rank holds whole is owned within each tp rank's shard group, as without
tensor parallelism (each tp rank steps its copy alike).

Which optimizers are which: torch's own are known (``ELEMENTWISE``, ``WHOLE``, ``REFUSED``); a
subclass that keeps its base's ``step`` is what its base is; any other class is *undeclared*:
it steps the pieces, with a warning at its first step naming :func:`declare_optimizer`, since
shardwrap cannot tell whether it reads shapes. What finds them is a pair of torch's
process-wide step hooks, registered while any sharded model lives: they must see an
optimizer's first step whenever it was built, to never let a shape-aware one step pieces. An
optimizer over other parameters costs one dictionary lookup per step; its kind is looked up
once. The exchanges themselves are the optimizer's own step hooks, kept innermost (its last
pre-hook, its first post-hook), so the user's step hooks, which torch runs after the
process-wide pre-hooks and before the process-wide post-hooks, see the pieces.
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from ...comm.collectives import all_to_all
from ...tiers.offload import HOME_ATTR, before_step
from ...tiers.shard_param import raw_data, set_raw_data
from .adoption import adopt_before_state_dicts
from .dcp_pieces import dcp_filling_empty_state
from .loaded_state import check_held_state, watch
from .ownership import Entry, Plan, held, make_entries, make_plans, span
from .pieces import PIECE_ATTR, adopt_optimizer, inner_optimizer
from .shard_grad import WHOLE_STEP, as_shard_grad
from .unreduced import refuse_unreduced

__all__ = [
    "PIECE_ATTR",
    "declare_optimizer",
    "declare_optimizer_name",
    "install",
    "release",
    "stepped_whole",
    "steps_whole",
]

ELEMENTWISE: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "RMSprop",
        "NAdam",
        "RAdam",
        "Adamax",
        "Adadelta",
        "ASGD",
        "Rprop",
    )
    if hasattr(torch.optim, name)
)
WHOLE: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name)
)
REFUSED: dict[type[Optimizer], str] = {
    torch.optim.SparseAdam: (
        "it steps sparse gradients only, and a sharded model's gradients are dense shards. "
        "Use Adam or AdamW (dense), or keep the sparse embedding out of the sharded model"
    ),
    torch.optim.LBFGS: (
        "it takes each step from dot products and a line search over the gradient of every "
        "parameter at once, which no rank holds; its pieces would give each rank a different "
        "step. Train with an elementwise optimizer (AdamW) or a shape-aware one (Muon, "
        "Adafactor), or run LBFGS on the unwrapped model"
    ),
}

_declared: dict[type, bool] = {}  # class -> reads shapes
_declared_names: dict[str, bool] = {}  # "module.QualName" of a class -> reads shapes
_warned: set[type] = set()


def declare_optimizer(cls: type[Optimizer], *, reads_shapes: bool) -> None:
    """Say how an optimizer class of your own treats a parameter, so shardwrap steps it right.

    Args:
        cls: the optimizer class (its subclasses that keep its ``step`` are declared too).
        reads_shapes: ``True`` if its update of a parameter depends on the parameter's shape or
            on other elements of it (per-row or per-matrix normalisation, factored moments, its
            norm): each parameter is then stepped whole on one rank. ``False`` if it treats
            every element on its own (like AdamW): it steps this rank's pieces.

    Raises:
        TypeError: ``cls`` is not a ``torch.optim.Optimizer`` subclass, or ``reads_shapes`` not
            a bool (``"False"`` is a true value: read as one it would declare the opposite).
    """
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(
            f"declare_optimizer takes an optimizer class, got {cls!r}: e.g. "
            "shardwrap.declare_optimizer(MyOptimizer, reads_shapes=True)"
        )
    if not isinstance(reads_shapes, bool):
        raise TypeError(
            f"declare_optimizer: reads_shapes must be True or False, got {reads_shapes!r}; e.g. "
            f"shardwrap.declare_optimizer({cls.__name__}, reads_shapes=True)"
        )
    _declared[cls] = reads_shapes


def declare_optimizer_name(name: str, *, reads_shapes: bool) -> None:
    """As :func:`declare_optimizer`, for a class named ``"module.QualName"`` (where it is
    defined): an integration declares another library's optimizers without importing it."""
    _declared_names[name] = bool(reads_shapes)


def steps_whole(cls: type) -> bool:
    """Whether shardwrap steps each parameter of optimizer class ``cls`` whole, on its owner
    (torch's Muon and Adafactor, classes declared with ``reads_shapes=True``)."""
    return _kind(cls) == "whole"


def _kind(cls: type) -> str:
    """``"pieces"``, ``"whole"``, ``"refused"`` or ``"undeclared"``."""
    for base in cls.__mro__:
        if base is Optimizer or base is object:
            break
        kind = _known(base)
        if kind is not None:
            if base is not cls and _step(cls) is not _step(base):
                return "undeclared"  # a subclass with a step of its own
            return kind
    return "undeclared"


def _known(cls: type) -> str | None:
    """What ``cls`` itself is: declared (as a class, or by name), else one of torch's."""
    declared = _declared.get(cls, _declared_names.get(f"{cls.__module__}.{cls.__qualname__}"))
    if declared is not None:
        return "whole" if declared else "pieces"
    if cls in REFUSED:
        return "refused"
    if cls in WHOLE:
        return "whole"
    return "pieces" if cls in ELEMENTWISE else None


def _step(cls: type) -> Any:
    """``cls.step`` as defined. NOTE: torch wraps the ``step`` of an optimizer's class in a
    profiling hook when the class's first instance is made, so a subclass that keeps its base's
    ``step`` holds a wrapper of it."""
    return inspect.unwrap(getattr(cls, "step", None))


# the process-wide hooks ----------------------------------------------------------------

_UNSEEN = object()
_steps: weakref.WeakKeyDictionary[Optimizer, Any] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_models = 0  # sharded models alive, which the hooks serve
_handles: list[RemovableHandle] = []


def install() -> None:
    """Register the step hooks while a sharded model lives (a model calls this when built and
    :func:`release` when freed; the hooks go with the last one)."""
    global _models
    with _lock:
        if _models == 0:
            adopt_before_state_dicts(stepped_whole)
            _handles.append(register_optimizer_step_pre_hook(_before_step))
            _handles.append(register_optimizer_step_post_hook(_after_step))
        _models += 1


def release() -> None:
    """A sharded model was freed; with the last one, the step hooks are removed."""
    global _models
    with _lock:
        _models -= 1
        if _models == 0:
            for handle in _handles:
                handle.remove()
            _handles.clear()
            _steps.clear()


def _pieces(optimizer: Optimizer) -> Iterator[nn.Parameter]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if hasattr(p, PIECE_ATTR):
                yield p


def _before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> Any:
    checked = refuse_unreduced(optimizer, args, kwargs)
    _with_grads[optimizer] = [
        getattr(p, PIECE_ATTR)[:2] for p in _pieces(optimizer) if p.grad is not None
    ]
    whole = stepped_whole(optimizer)
    if whole is not None:
        whole.innermost(optimizer)
    else:
        check_held_state(optimizer)
    return checked


def stepped_whole(optimizer: Optimizer) -> _WholeStep | None:
    """How ``optimizer`` steps its shard parameters whole, or ``None`` where it steps pieces.

    Raises:
        ValueError: a refused optimizer (LBFGS) over shard parameters.
    """
    whole = _steps.get(optimizer, _UNSEEN)
    if whole is _UNSEEN:
        whole = _steps[optimizer] = _classify(optimizer)
        if whole is None and next(_pieces(optimizer), None) is not None:
            watch(optimizer, _piece_name)  # state loaded into it: of this rank's pieces?
    return whole


def _piece_name(p: nn.Parameter) -> str | None:
    """The name of shard parameter ``p``; ``None`` for any other parameter."""
    piece = getattr(p, PIECE_ATTR, None)
    group = piece[0]() if piece is not None else None
    return group.names[piece[1]] if group is not None else None


def _after_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    whole = _steps.get(optimizer)
    stepped = _with_grads.pop(optimizer, [])
    if whole is not None and whole.idle:  # DCP's step that changes nothing (see before)
        return
    for ref in _groups_of(optimizer):
        group = ref()
        if group is not None:
            group.steps += 1
            group.mark_stale()  # a fused step changes the shard without counting it
    for ref, index in stepped:  # torch's optimizers change only what has a gradient
        group = ref()
        if group is not None:
            group.stepped[index] = group.steps


# per optimizer about to step: its pieces with a gradient, (their flat group weakly, index)
_with_grads: weakref.WeakKeyDictionary[Optimizer, list[tuple[Any, int]]] = (
    weakref.WeakKeyDictionary()
)

# per optimizer: its parameter groups' sizes, and the flat groups of its pieces (weakly: an
# optimizer outliving its model must not keep the model)
_groups: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[int, ...], list[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _groups_of(optimizer: Optimizer) -> list[Any]:
    """References to the flat groups whose pieces ``optimizer`` steps (looked up again when
    its parameter groups change size: ``add_param_group``)."""
    key = tuple(len(g["params"]) for g in optimizer.param_groups)
    known = _groups.get(optimizer)
    if known is None or known[0] != key:
        refs = {id(ref()): ref for ref, *_ in (getattr(p, PIECE_ATTR) for p in _pieces(optimizer))}
        known = _groups[optimizer] = (key, list(refs.values()))
    return known[1]


def _classify(optimizer: Optimizer) -> _WholeStep | None:
    """The whole-parameter step for ``optimizer``, or ``None`` where it steps pieces as is.

    Raises:
        ValueError: a refused optimizer over shard parameters, before it changes anything.
    """
    if next(_pieces(optimizer), None) is None or inner_optimizer(optimizer) is not optimizer:
        return None  # a wrapper (Lookahead) steps through its inner optimizer, classified apart
    cls = type(optimizer)
    kind = _kind(cls)
    if kind == "refused":
        base = next(b for b in cls.__mro__ if b in REFUSED)
        raise ValueError(
            f"{cls.__name__} cannot train a sharded model: {REFUSED[base]}. Nothing was changed."
        )
    if kind == "undeclared" and cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"shardwrap cannot tell whether {cls.__name__} reads parameter shapes: it steps each "
            "rank's piece of a parameter (a matrix's piece has shape (1, k)), which equals the "
            "unwrapped model's step only for an elementwise optimizer. Declare it once before "
            f"training: shardwrap.declare_optimizer({cls.__name__}, reads_shapes=True) to step "
            "each parameter whole on one rank (per-row or per-matrix updates, factored moments, "
            "a parameter's own norm), or reads_shapes=False for an elementwise one, or one "
            "whose only other reads are norms over all parameters (global clipping, SAM), "
            "which are global on pieces (silences this warning).",
            stacklevel=4,
        )
    whole = _WholeStep(optimizer) if kind == "whole" else None
    adopt_optimizer(optimizer, None if whole is None else whole.owns)  # its state dicts' pieces
    return whole


# the whole-parameter step --------------------------------------------------------------


class _WholeStep:
    """Steps ``optimizer``'s shard parameters whole, each on its owner rank."""

    def __init__(self, optimizer: Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._params_key: tuple[int, ...] = ()
        self._entries: dict[int, Entry] = {}
        self._homed = False  # whether any of them lives in an offload tier
        self._key: tuple[int, ...] = ()
        self._plans: list[Plan] = []
        # what ``after`` puts back: (param, its piece or None where untouched, its .grad)
        self._restore: list[tuple[nn.Parameter, Tensor | None, Tensor | None]] = []
        self._copied: list[tuple[Tensor, Tensor]] = []  # (owner's piece, its part of the whole)
        # owned entries whose whole is not their stacked values (tp blocks split off dim 0):
        # (entry, its stacked values, refreshed from the whole after the step)
        self._stacked: list[tuple[Entry, Tensor]] = []
        # stepped or loaded, on every rank alike: some rank may hold state (see ``before``)
        self._settled = False
        self._idle = False  # this step exchanges and changes nothing
        optimizer.register_load_state_dict_post_hook(self._loaded)
        self._hooks = (
            optimizer.register_step_pre_hook(lambda o, args, kwargs: self.before(args, kwargs)),
            optimizer.register_step_post_hook(lambda o, args, kwargs: self.after()),
        )

    def innermost(self, optimizer: Optimizer) -> None:
        """Make the exchange the innermost of ``optimizer``'s step hooks: the user's own (a
        clipping pre-hook, an average kept in a post-hook, ``zero_grad`` after the step) run
        around it and see the pieces, as every other call does. Called by the process-wide
        pre-hook, which runs before any of the optimizer's own."""
        pre, post = self._hooks
        optimizer._optimizer_step_pre_hooks.move_to_end(pre.id)  # type: ignore[attr-defined]
        optimizer._optimizer_step_post_hooks.move_to_end(post.id, last=False)  # type: ignore[attr-defined]

    def _loaded(self, optimizer: Optimizer) -> None:
        self._settled = True

    @property
    def idle(self) -> bool:
        """Whether the step just taken exchanged and changed nothing."""
        return self._idle

    def before(self, args: Any, kwargs: Any) -> None:
        optimizer = self._optimizer()
        assert optimizer is not None
        # args[0] is the optimizer itself; DCP's state-dict functions step with closure=None
        if any(a is not None for a in (*args[1:], *kwargs.values())):
            raise ValueError(
                f"{type(optimizer).__name__}.step(closure) on a sharded model: the closure's "
                "backward would run after shardwrap gathered the gradients to their owners. "
                "Call the closure yourself, then step(): loss = closure(); opt.step()"
            )
        self._undo()  # a step that raised left its parameters whole
        entries = self.entries()
        self._idle = self._settled and dcp_filling_empty_state()
        if self._idle:
            # DCP fills an optimizer's empty state by a step with zero gradients, where the
            # state is empty: on the ranks that own none of its parameters alone, once any rank
            # holds state. No rank would join their exchange; as on the unwrapped model, whose
            # state is not empty then, nothing is stepped.
            for e in entries.values():
                self._restore.append((e.param, None, e.param.grad))
                e.param.grad = None
            return
        if self._homed:
            before_step(optimizer, args, kwargs)  # the disk tier's files are checked first
        stepped = [e for e in entries.values() if e.param.grad is not None]
        key = tuple(id(e) for e in stepped)
        if key != self._key:
            self._plans, self._key = make_plans(stepped), key
        # One handshake per model first: a rank whose optimizer steps elementwise goes on to
        # its next forward, and both raise at once naming what each does, where the exchange
        # would have waited for it until the timeout.
        owners = [getattr(e.param.grad, "_shardwrap_owner", None) for e in stepped]
        enters = {id(o.enter): o.enter for o in owners if o is not None}
        for enter in enters.values():
            enter(WHOLE_STEP)
        with torch.no_grad():
            for plan in self._plans:
                self._gather(plan)

    def entries(self) -> dict[int, Entry]:
        """Every shard parameter of the optimizer, by ``id``, with its pieces and owner (made
        again when the optimizer's parameters change)."""
        optimizer = self._optimizer()
        assert optimizer is not None
        params = list(_pieces(optimizer))
        key = tuple(id(p) for p in params)
        if key != self._params_key:
            # NOTE: a parameter keeps its owner when others join (add_param_group): its state
            # lives on its owner, and a new owner would start it afresh beside the stale one.
            kept = {id(e.param): e.owner for e in self._entries.values()}
            self._entries, self._params_key = make_entries(params, kept), key
            self._homed = any(hasattr(p, HOME_ATTR) for p in params)
        return self._entries

    def owns(self, param: nn.Parameter) -> bool:
        """Whether this rank steps ``param`` whole (and so holds its state)."""
        e = self.entries()[id(param)]
        return e.owner == e.rank

    def after(self) -> None:
        if self._idle:
            self._undo()
            return
        self._settled = self._settled or bool(self._key)  # a parameter was stepped
        with torch.no_grad():
            for e, values in self._stacked:  # the stepped whole, in stacked order again
                values.copy_(e.split.stacked(e.param.detach()))
            for plan in self._plans:
                self._scatter(plan)
            for piece, values in self._copied:
                piece.view(-1).copy_(values)
        self._undo()

    def _undo(self) -> None:
        for p, data, grad in self._restore:
            p.grad = None
            if data is not None:
                set_raw_data(p, data)
            p.grad = grad
        self._restore, self._copied, self._stacked = [], [], []

    def _gather(self, plan: Plan) -> None:
        """Give each owned parameter its whole values and gradient; hide the others' gradients."""
        r, dtype, device = plan.rank, plan.dtype, plan.device
        wire = torch.promote_types(dtype, plan.grad_dtype)  # carries values and gradients exactly
        ins = []
        for es in plan.sends:
            n, at = held(es, r), 0
            buf = torch.empty(2 * n, dtype=wire, device=plan.wire)
            for e in es:
                k = span(e, r)
                buf[at : at + k].copy_(e.param.detach().view(-1))
                buf[n + at : n + at + k].copy_(e.param.grad.view(-1))
                at += k
            ins.append(buf)
        outs = [
            torch.empty(2 * held(es, q), dtype=wire, device=plan.wire)
            for q, es in enumerate(plan.recvs)
        ]
        all_to_all(outs, ins, plan.group, plan.stats).wait()
        owned: dict[int, tuple[Tensor, Tensor]] = {}  # (values, grads) in stacked order
        copies: set[int] = set()  # owned, not held whole: filled from the peers' pieces
        for e in plan.entries:
            p, piece, grad = e.param, raw_data(e.param), e.param.grad
            if e.owner != r:
                self._restore.append((p, None, grad))
                p.grad = None
                continue
            if span(e, r) == e.numel:  # held whole here: stepped in place
                values, grads = piece.view(-1), grad.view(-1)
            else:
                values = torch.empty(e.numel, dtype=dtype, device=device)
                grads = torch.empty(e.numel, dtype=plan.grad_dtype, device=device)
                a, b = e.pieces[r]
                values[a:b].copy_(piece.view(-1))
                grads[a:b].copy_(grad.view(-1))
                copies.add(id(e))
                self._copied.append((piece, values[a:b]))
            owned[id(e)] = values, grads
            self._restore.append((p, piece, grad))
        for q, es in enumerate(plan.recvs):
            n, at = held(es, q), 0
            for e in es:
                a, b = e.pieces[q]
                values, grads = owned[id(e)]
                values[a:b].copy_(outs[q][at : at + b - a])
                grads[a:b].copy_(outs[q][n + at : n + at + b - a])
                at += b - a
        for e in plan.entries:
            if id(e) not in owned:
                continue
            values, grads = owned[id(e)]
            p = e.param
            p.grad = None
            set_raw_data(p, e.split.unstacked(values))
            p.grad = as_shard_grad(e.split.unstacked(grads), e.grad_owner)
            if not e.split.identity:
                self._stacked.append((e, values))

    def _scatter(self, plan: Plan) -> None:
        """Send each rank its pieces of the owned parameters' new values, and take ours."""
        r, dtype, wire = plan.rank, plan.dtype, plan.wire
        stacked = {id(e): values for e, values in self._stacked}
        ins = []
        for q, es in enumerate(plan.recvs):
            buf, at = torch.empty(held(es, q), dtype=dtype, device=wire), 0
            for e in es:
                a, b = e.pieces[q]
                values = stacked.get(id(e))
                values = e.param.detach().view(-1) if values is None else values
                buf[at : at + b - a].copy_(values[a:b])
                at += b - a
            ins.append(buf)
        outs = [torch.empty(held(es, r), dtype=dtype, device=wire) for es in plan.sends]
        all_to_all(outs, ins, plan.group, plan.stats).wait()
        for q, es in enumerate(plan.sends):
            at = 0
            for e in es:
                k = span(e, r)
                e.param.detach().view(-1).copy_(outs[q][at : at + k])
                at += k
