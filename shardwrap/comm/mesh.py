"""The groups one sharded model communicates over, and its compute device.

Design note. Three groups carry every collective, and this object is the only place that
holds them:

- ``shard``: the ranks that split each flat buffer; its size is the layout's world size.
  All-gathers and reduce-scatters run on it.
- ``replicate``: for hybrid sharding, the ranks that hold the same shard (one per shard
  group). After a gradient is reduce-scattered within the shard group it is averaged across
  this group, so every replica steps identically. ``None`` without hybrid sharding.
- ``control``: spans every rank of the model; the agreed order of collectives, the
  all-ranks agreements of saves and loads, the global gradient norm. A CPU gloo group of its
  own when the model spans the default group (see :func:`resolve_mesh`).

With tensor parallelism (a ``DeviceMesh`` with a ``"tp"`` dimension) two more: ``tp``, the
tensor-parallel ``DeviceMesh`` the model's DTensor parameters live on (each tp rank's flat
groups hold its own blocks of them, sharded over ``shard`` alone), and ``model``, the ranks
that hold one copy of the model between them (``shard`` x ``tp``), over which the norms of
tensor-parallel gradients and the whole-parameter steps of shape-aware optimizers run.
``control`` then spans the tp ranks too: they run the same units in the same order, so they
agree alike.

``None`` for every group is world size 1: no process group at all, the same code path. It is
what ``process_group=None`` gives without a process group only where the environment says one
process; under a launcher that started several, wrapping is refused (each would train alone).
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .collectives import group_rank, group_size
from .failures import Group, group_timeout, report_whereabouts

__all__ = ["Mesh", "resolve_mesh"]


@dataclass(eq=False)
class Mesh:
    """The groups of one sharded model and the device its shards live on.

    Build one to shard over groups made by hand; ``ShardedModule`` builds it from a
    ``process_group`` or a ``DeviceMesh`` otherwise.

    Attributes:
        shard: ranks that split each flat buffer (``None``: one rank).
        replicate: ranks holding the same shard, across which gradients are averaged after
            the reduce-scatter (hybrid sharding); ``None`` when every rank holds its own shard.
        control: a group spanning every rank of ``shard`` x ``replicate``, for handshakes and
            agreements; ``None`` means ``shard`` (which must then span every rank).
        control_device: where the control group's tensors live (``cpu`` for gloo).
        device: where compute runs, and shards live unless an offload tier keeps them apart
            (``tiers/home.py``); ``None`` until resolved.
        tp: the 1-D tensor-parallel ``DeviceMesh`` of the model's DTensor parameters, or
            ``None`` without tensor parallelism.
        model: the ranks of ``shard`` x ``tp`` (those holding one copy of the model), ranked
            shard-major (``shard_rank * tp_size + tp_rank``); ``None`` means ``shard``.
    """

    shard: Group = None
    replicate: Group = None
    control: Group = None
    control_device: torch.device | None = None
    device: torch.device | None = None
    tp: DeviceMesh | None = None
    model: Group = None

    def __post_init__(self) -> None:
        if self.control is None and (self.replicate is not None or self.tp is not None):
            raise ValueError(
                "Mesh.control: hybrid sharding needs a control group spanning every rank (so "
                "does tensor parallelism); pass Mesh(shard=..., control=<group of all ranks>)."
            )
        if self.control is None:
            self.control = self.shard
        if self.model is None and self.tp is None:
            self.model = self.shard
        if self.tp is not None and (
            group_size(self.model) != self.shard_size * self.tp_size
            or group_rank(self.model) != self.model_rank
        ):
            raise ValueError(
                f"Mesh.model: rank {group_rank(self.model)} of {group_size(self.model)}, not "
                f"{self.model_rank} of shard {self.shard_size} x tp {self.tp_size}; pass the "
                "ranks holding one copy of the model, ranked shard rank * tp size + tp rank."
            )
        _LIVE.add(self)
        if self.control is not None and group_size(self.control) != self.world_size:
            raise ValueError(
                f"Mesh.control spans {group_size(self.control)} ranks but the mesh has "
                f"{self.world_size} (shard {self.shard_size} x replicate {self.replicate_size}); "
                "pass a control group over every rank of the mesh."
            )
        self._whereabouts: weakref.WeakMethod | None = None
        report_whereabouts(self, (self.shard, self.replicate, self.control))

    def set_whereabouts(self, whereabouts: Callable[[], str]) -> None:
        """Have a collective that fails on this mesh's groups say what ``whereabouts()`` (a
        bound method, held weakly: the model's) says this rank is doing."""
        self._whereabouts = weakref.WeakMethod(whereabouts)  # type: ignore[arg-type]

    def whereabouts(self) -> str:
        """This rank's step and phase in the model on this mesh, for the message of a
        collective that failed: what the model says, or that it is being wrapped."""
        model = self._whereabouts() if self._whereabouts is not None else None
        return model() if model is not None else "wrapping the model (ShardedModule)"

    @property
    def shard_rank(self) -> int:
        return group_rank(self.shard)

    @property
    def shard_size(self) -> int:
        return group_size(self.shard)

    @property
    def replicate_rank(self) -> int:
        return group_rank(self.replicate)

    @property
    def replicate_size(self) -> int:
        return group_size(self.replicate)

    @property
    def tp_rank(self) -> int:
        return self.tp.get_local_rank() if self.tp is not None else 0

    @property
    def tp_size(self) -> int:
        return self.tp.size() if self.tp is not None else 1

    @property
    def model_rank(self) -> int:
        """This rank's index among the ranks holding one copy of the model (``model``)."""
        return self.shard_rank * self.tp_size + self.tp_rank

    @property
    def rank(self) -> int:
        """This rank's index among all ranks of the mesh (the control group's rank)."""
        return group_rank(self.control)

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size * self.tp_size

    @property
    def writes(self) -> bool:
        """Whether this rank writes its shard's files: one replica does, the first."""
        return self.replicate_rank == 0

    def release(self) -> None:
        """Drop every group reference (at interpreter exit, see ``_LIVE``)."""
        self.shard = self.replicate = self.control = self.model = self.tp = None


def resolve_mesh(process_group: dist.ProcessGroup | Mesh | None, device: torch.device) -> Mesh:
    """The mesh for ``ShardedModule(process_group=...)``, with its compute device set.

    Accepts ``None`` (the default group when ``torch.distributed`` is initialised, else world
    size 1 where the launcher started one process), a ``ProcessGroup``, a ``DeviceMesh``
    (1-D; 2-D with dimensions ``("replicate", "shard")`` for hybrid sharding; with tensor
    parallelism ``("dp", "tp")`` or ``("replicate", "dp", "tp")``, ``"shard"`` also naming the
    sharded dimension), or a :class:`Mesh`.
    """
    if isinstance(process_group, Mesh):
        mesh = process_group
        if mesh.control_device is None:
            mesh.control_device = device
    elif isinstance(process_group, DeviceMesh):
        mesh = _from_device_mesh(process_group)
    else:
        group = _default_group(process_group)
        control, control_device = _control_group(group, device)
        mesh = Mesh(shard=group, control=control, control_device=control_device)
    mesh.device = device
    return mesh


# The dimension names a DeviceMesh may have, sharded dimension named "shard" or "dp".
MESH_NAMES = (
    ("replicate", "shard"),
    ("dp", "tp"),
    ("shard", "tp"),
    ("replicate", "dp", "tp"),
    ("replicate", "shard", "tp"),
)


def _from_device_mesh(device_mesh: DeviceMesh) -> Mesh:
    names = tuple(device_mesh.mesh_dim_names or ())
    if device_mesh.ndim == 1:
        group = device_mesh.get_group()
        control, control_device = _control_group(group, torch.device(device_mesh.device_type))
        return Mesh(shard=group, control=control, control_device=control_device)
    if names not in MESH_NAMES:
        raise ValueError(
            "process_group: a DeviceMesh for hybrid sharding must be 2-D with dimensions "
            f'("replicate", "shard"), got {device_mesh.ndim}-D with names {names or None}; for '
            '2-D parallelism ("dp", "tp") or ("replicate", "dp", "tp"), "tp" the dimension '
            'parallelize_module used; e.g. init_device_mesh("cuda", (nodes, gpus_per_node), '
            'mesh_dim_names=("replicate", "shard")).'
        )
    if device_mesh.mesh.numel() != dist.get_world_size():
        raise ValueError(
            f"process_group: the DeviceMesh spans {device_mesh.mesh.numel()} of "
            f"{dist.get_world_size()} ranks; shard over a mesh of every rank."
        )
    timeout = group_timeout(dist.group.WORLD)
    control = dist.new_group(backend="gloo", timeout=timeout)
    shard = names[-2] if names[-1] == "tp" else "shard"
    replicate = device_mesh.get_group("replicate") if names[0] == "replicate" else None
    if names[-1] != "tp":
        return Mesh(
            shard=device_mesh.get_group(shard),
            replicate=replicate,
            control=control,
            control_device=torch.device("cpu"),
        )
    return Mesh(
        shard=device_mesh.get_group(shard),
        replicate=replicate,
        control=control,
        control_device=torch.device("cpu"),
        tp=device_mesh["tp"],
        model=_model_group(device_mesh, timeout),
    )


def _model_group(device_mesh: DeviceMesh, timeout: object) -> Group:
    """The group of this rank's replica: every rank of the mesh without a replicate
    dimension, else one group per replica (creating each is collective over every rank)."""
    if device_mesh.ndim == 2:
        return dist.group.WORLD
    replicas = [r.flatten().tolist() for r in device_mesh.mesh]
    mine, _ = dist.new_subgroups_by_enumeration(replicas, timeout=timeout)
    return mine


def _default_group(process_group: dist.ProcessGroup | None) -> Group:
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "process_group takes a ProcessGroup, a DeviceMesh with dimensions "
                f'("replicate", "shard") or a shardwrap.Mesh, got {type(process_group).__name__}.'
            )
        return process_group
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            _check_one_process(alone=True)
        return dist.group.WORLD
    _check_one_process()
    return None


# What launchers set for torch.distributed's env:// initialisation: torchrun, accelerate launch
# and deepspeed's launcher set WORLD_SIZE; torchrun also LOCAL_WORLD_SIZE. Schedulers' own
# variables (SLURM_NTASKS, OMPI_COMM_WORLD_SIZE) are not read: a job step may run independent
# one-process programs under them.
_LAUNCHED_SIZES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _check_one_process(alone: bool = False) -> None:
    """No process group, or a default group of this process ``alone``, means world size 1, but
    only where the environment says one process.

    Raises:
        RuntimeError: a launcher started several processes; each would train its own copy.
    """
    for name in _LAUNCHED_SIZES:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 1:
            if alone:
                why = (
                    "torch.distributed's default group holds this process alone (it was "
                    "initialised with world_size=1)"
                )
                fix = (
                    "Initialise it with every process, leaving world_size and rank to the "
                    "launcher's environment: "
                )
            else:
                why = "torch.distributed has no process group"
                fix = "Create the group before wrapping: "
            raise RuntimeError(
                f"ShardedModule: {name}={value}: this is one of {value} processes, but {why}, "
                "so each would shard over itself alone and train its own copy of the model. "
                f"{fix}"
                'dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10)) '
                '("gloo" on CPUs); the timeout bounds how long the others wait for a hung rank '
                "(torch's default: 30 minutes with gloo). With the Hugging Face Trainer, build "
                "TrainingArguments(..., ddp_timeout=600) before wrapping (it creates the "
                "group); with accelerate, Accelerator(). To train one copy per process on "
                "purpose, pass process_group=shardwrap.Mesh()."
            )


def _control_group(group: Group, device: torch.device) -> tuple[Group, torch.device]:
    """The group for handshakes: a CPU gloo group of its own when sharding over the default group.

    NOTE: gloo runs a group's collectives FIFO on two worker threads, so a handshake on the
    data group waits behind in-flight 50 MB transfers (0.8 s of a 5 s step on the 101M GPT);
    on CUDA it would also sync the device. Creating a group is collective over the default
    group, which every rank reaches here. It gets the default group's timeout (what the user
    gave ``init_process_group``), not torch's 30-minute default for new groups. For a
    user-given group the handshakes share it.
    """
    if group is not None and dist.is_initialized() and group is dist.group.WORLD:
        return dist.new_group(backend="gloo", timeout=group_timeout(group)), torch.device("cpu")
    return group, device


# NOTE: a model that outlives destroy_process_group() (a module-level global, say) would keep
# its process groups, and so gloo's worker threads, alive into interpreter shutdown, where a
# worker freeing the tensor of a finished collective can no longer take the GIL and aborts
# the process ("terminate called without an active exception", about 1 run in 15 at two
# ranks). Dropping the references while Python is still whole lets the groups shut down then.
_LIVE: weakref.WeakSet[Mesh] = weakref.WeakSet()


@atexit.register
def _release_groups_at_exit() -> None:
    for mesh in list(_LIVE):
        mesh.release()
