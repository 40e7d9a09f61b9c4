"""Error feedback's residuals in a checkpoint, so that a compressed run resumes exactly.

Design note. With ``Compression(grads=..., error_feedback=True)`` each rank keeps, per trainable
flat group, what rounding cut from what it sent, and adds it to the next reduction
(``engine/step/reduce.py``: ``Reductions.residuals``, full-size, for the reduce-scatter; with hybrid
sharding ``replica_residuals``, shard-size, for the all-reduce across replicas). They are part
of the training state as much as the optimizer's: a run resumed without them departs from the
uninterrupted one at its first step. They differ on every rank (each rank's own rounding), so
each rank writes its own file, ``residuals-RANK.safetensors``, as it writes its ``extra``:
``reduce/I`` and ``replicas/I`` for the group at position ``I`` of the reduction order.

A residual is what this rank owes each peer's chunk of one flat layout: it means something only
for the same ranks over the same groups. So a load restores them where the saved mesh (shard and
replicate sizes) and groups (each group's parameter names, in reduction order) are the model's.
Anywhere else (another world size, ``auto_wrap`` or hybrid layout) they start at zero, as in a
fresh run, and the load warns, saying so: the first reduction then lacks the rounding carried
over from before the save, as a run without error feedback would lack it for one step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..comm.mesh import Mesh
from ..engine.step.reduce import Reductions

__all__ = [
    "Expected",
    "expected_residuals",
    "residual_layout",
    "residuals_of",
    "restore",
    "start_at_zero",
]


def residuals_of(reductions: Reductions) -> list[tuple[str, Tensor]]:
    """This rank's residuals, by key (1-D each); none before the first reduction, without
    error feedback, or on one rank."""
    out = [(f"reduce/{i}", t) for i, t in enumerate(reductions.residuals) if t is not None]
    out += [
        (f"replicas/{i}", t) for i, t in enumerate(reductions.replica_residuals) if t is not None
    ]
    return out


def residual_layout(reductions: Reductions, mesh: Mesh) -> dict[str, Any]:
    """What residuals are relative to: the metadata's ``residuals`` entry (with tensor
    parallelism, the tp degree too: the flat layouts hold its blocks)."""
    layout: dict[str, Any] = {
        "shard": mesh.shard_size,
        "replicate": mesh.replicate_size,
        "groups": [list(g.names) for g in reductions.order],
    }
    if mesh.tp_size > 1:
        layout["tp"] = mesh.tp_size
    return layout


Expected = dict[str, tuple[int, torch.dtype, torch.device]]  # key -> elements, dtype, device


def expected_residuals(
    reductions: Reductions, mesh: Mesh, saved: dict[str, Any] | None
) -> Expected | None:
    """The residuals a checkpoint may hold for this model, by key, and where each lives (the
    group's compute device, as the reductions make them); ``None`` where the model keeps none
    or ``saved`` (the metadata's entry) was made for another mesh or other groups."""
    if not reductions.error_feedback or saved is None:
        return None
    if saved != residual_layout(reductions, mesh):
        return None
    expected: Expected = {}
    for i, g in enumerate(reductions.order):
        expected[f"reduce/{i}"] = (g.layout.padded_numel, g.grad_dtype, g.home.device)
        expected[f"replicas/{i}"] = (g.shard.numel(), g.grad_dtype, g.home.device)
    return expected


def start_at_zero(reductions: Reductions, mesh: Mesh, saved: dict[str, Any], where: str) -> str:
    """The warning for residuals saved for another mesh or other groups than the model's."""
    mine = residual_layout(reductions, mesh)
    how = (
        f"shard size {saved['shard']} x replicate {saved['replicate']} over "
        f"{len(saved['groups'])} groups, this model reduces at shard size {mine['shard']} x "
        f"replicate {mine['replicate']} over {len(mine['groups'])}"
    )
    if (saved["shard"], saved["replicate"]) == (mine["shard"], mine["replicate"]):
        how = "other groups than this model reduces (another auto_wrap or layout)"
    return (
        f"load_checkpoint: {where} holds error feedback's residuals saved at {how}: a residual "
        "is what one rank owes its peers' chunks of one layout, so they start at zero here, as "
        "in a fresh run (the first reduction lacks the rounding carried over from before the "
        "save). Resume at the world size and auto_wrap it was saved with to continue exactly."
    )


def restore(reductions: Reductions, loaded: dict[str, Tensor]) -> None:
    """Make ``loaded`` (by key, read and checked) the residuals; every other one starts at zero
    (made at the next reduction)."""
    for kind, residuals in (
        ("reduce", reductions.residuals),
        ("replicas", reductions.replica_residuals),
    ):
        for i in range(len(residuals)):
            residuals[i] = loaded.get(f"{kind}/{i}")
