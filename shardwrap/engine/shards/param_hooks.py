"""A shard parameter's gradient hooks (``p.register_hook``), given to its gathered view.

Design note. A shard parameter is in no graph (its gathered view is), so autograd never calls
its hooks: each is registered on the view instead (``FlatGroup._hook_views``), where it sees
this rank's gradient of the whole parameter before the reduction. Two differences from a
leaf are made up for here:

- A view the forward did not use gets no gradient, and autograd calls its hooks with ``None``,
  where a plain model's unused parameter's hooks are never called (a hook ``g * mask`` would
  raise): they are not called then.
- ``torch.autograd.graph.register_multi_grad_hook`` in mode ``"all"`` calls the user's
  function once every tensor it was given has its gradient in: at a backward's first call it
  counts the tensors' gradient nodes (a leaf's accumulator) that the backward runs, and waits
  for that many calls. A shard parameter's nodes never run, so the function was never called.
  Each view given such a hook is counted among the nodes it waits for, and the hook is called
  with ``None`` too, since it counts every call.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator
from types import CodeType
from typing import Any

import torch
from torch import Tensor

__all__ = ["hook_view"]


def _nested_code(code: CodeType, *names: str) -> CodeType | None:
    """The code of the function ``names`` nests in ``code``'s, one level per name."""
    found: CodeType | None = code
    for name in names:
        consts = found.co_consts if found is not None else ()
        found = next((c for c in consts if isinstance(c, CodeType) and c.co_name == name), None)
    return found


# The hook ``register_multi_grad_hook(tensors, fn)`` (mode "all") puts on each tensor. At a
# backward's first call it counts the calls to wait for before calling ``fn``: one for each node
# of ``grad_fns`` (the tensors' gradient nodes, a leaf's accumulator) that the backward runs.
_MULTI_GRAD_ALL = _nested_code(
    inspect.unwrap(torch.autograd.graph.register_multi_grad_hook).__code__,
    "get_inner_hook",
    "inner_hook",
)


class _NodesAndViews(list):
    """A ``register_multi_grad_hook``'s ``grad_fns``, iterated with the gradient nodes of the
    views that stand in for its tensors. A view's node is held weakly: it is counted while its
    graph lives (a backward that does not run it counts it out, as it does a parameter's
    accumulator), and a trained model does not keep one for each forward it ran."""

    def __init__(self, nodes: list[Any]) -> None:
        super().__init__(nodes)
        self.views: list[weakref.ref[Any]] = []
        self.prune_at = 16  # dead references are dropped once this many are held (twice the live)

    def add(self, node: Any) -> None:
        self.views.append(weakref.ref(node))
        if len(self.views) >= self.prune_at:
            self.views = [ref for ref in self.views if ref() is not None]
            self.prune_at = max(16, 2 * len(self.views))

    def __iter__(self) -> Iterator[Any]:
        yield from super().__iter__()
        yield from (node for node in (ref() for ref in self.views) if node is not None)


def _counts_views(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is one of ``register_multi_grad_hook``'s (mode ``"all"``), which counts
    each call, one with no gradient (``None``) too."""
    return _MULTI_GRAD_ALL is not None and getattr(hook, "__code__", None) is _MULTI_GRAD_ALL


def _count_view(hook: Callable[..., Any], view: Tensor) -> None:
    """Where ``hook`` is one of ``register_multi_grad_hook``'s (mode ``"all"``), count the
    gradient node of ``view``, which now calls it, among those it waits for.

    It counts its tensors' nodes that a backward runs, and a shard parameter's (or, registered
    before wrapping, the original parameter's) accumulator never runs: it would wait for no
    call, and never call its function. Each view counts once per forward that made it, as it
    calls the hook once: ``fn`` runs once per backward, with each parameter's gradient as
    ``p.register_hook`` sees it (``None`` for one its group's backward gave none), as on the
    plain model. Where the hook sees a parameter's gradient in parts (its unit called twice
    in a forward at stage 3, its piece in the loss as well), ``fn`` gets the last part. A
    view whose node is torch's own (not weakly referable) is left uncounted."""
    if not _counts_views(hook):
        return
    cells = dict(zip(_MULTI_GRAD_ALL.co_freevars, hook.__closure__ or ()))
    cell = cells.get("grad_fns")
    if cell is None or view.grad_fn is None:
        return
    if not isinstance(cell.cell_contents, _NodesAndViews):
        cell.cell_contents = _NodesAndViews(cell.cell_contents)
    try:
        cell.cell_contents.add(view.grad_fn)
    except TypeError:
        pass


def hook_view(view: Tensor, hooks: tuple[Callable[..., Any], ...]) -> None:
    """Register a shard parameter's gradient ``hooks`` on its gathered ``view`` (see the
    module's note)."""
    for hook in hooks:
        if _counts_views(hook):
            view.register_hook(hook)
            _count_view(hook, view)
        else:
            view.register_hook(_given_a_gradient(hook))


def _given_a_gradient(hook: Callable[[Tensor], Any]) -> Callable[[Tensor | None], Any]:
    """``hook``, not called where there is no gradient (``None``)."""

    def called(grad: Tensor | None) -> Any:
        return None if grad is None else hook(grad)

    return called
