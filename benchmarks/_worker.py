"""One benchmark run: build the model, wrap it with one method, train, measure.

Runs under torchrun (one process per rank); rank 0 prints one JSON line with the result.

    torchrun --standalone --nproc_per_node=2 benchmarks/_worker.py shardwrap-s3 '{"width": 1024}'

Methods (every one trains with the same torch optimizer, ``"optimizer"`` in the config):

- ``shardwrap-s1``, ``shardwrap-s2``, ``shardwrap-s3``: ``ShardedModule(model,
  auto_wrap=Block, stage=s)``; ``shardwrap`` is ``shardwrap-s3``.
- ``fsdp2``: PyTorch's ``fully_shard`` on every block, then on the root;
  ``fsdp2-noreshard``: the same with ``reshard_after_forward=False``.
- ``ddp``: ``DistributedDataParallel``.
- ``single``: an unsharded copy per rank with no communication at all (the compute floor).
- ``deepspeed-s1``, ``deepspeed-s2``, ``deepspeed-s3``: DeepSpeed ZeRO at that stage, the
  AdamW passed in as its client optimizer, gradient clipping off (DeepSpeed's default clips at
  1.0). On CPU its ``cpu`` accelerator (``DS_ACCELERATOR=cpu``) over gloo; needs the ``bench``
  extra.

Compressed communication (``benchmarks/compressed.py`` compares it): ``compress_params`` and
``compress_grads`` in the config give shardwrap ``Compression(params=..., grads=...,
error_feedback=...)``; ``zeropp`` gives DeepSpeed's ZeRO++ options, any of ``qwz``
(``zero_quantized_weights``), ``qgz`` (``zero_quantized_gradients``) and ``hpz``
(``zero_hpz_partition_size`` of ``hpz_size``), comma-separated.

Optimizers (``"optimizer"`` in the config), torch's defaults but for the learning rate:

- ``adamw``: ``torch.optim.AdamW`` over every parameter.
- ``muon``: ``torch.optim.Muon`` over the matrices (``p.ndim == 2``) and ``torch.optim.AdamW``
  over the rest, as torch's documentation advises; shardwrap steps Muon's matrices whole, each
  on one owner rank. DeepSpeed instead trains with its own Muon (``"optimizer": {"type":
  "Muon"}`` in its config: its ``MuonWithAuxAdam``, which tags the same matrices), with
  ``ns_method`` ``"standard"``: the same quintic Newton-Schulz iteration in bf16 as torch's
  (DeepSpeed's default, ``"gram"``, is a cheaper iteration in fp16).
- ``adafactor``: ``torch.optim.Adafactor`` over every parameter (not with DeepSpeed, which
  would hand it flat 1-D partitions).

Each timed step is split into phases, per rank (``phases_s_per_rank``, medians over the timed
steps): ``forward_backward``; ``step`` (the optimizer step, DeepSpeed's ``engine.step``); for
each torch optimizer ``<name> exchange in``, ``<name> update`` and ``<name> exchange out``: the
time before its own step pre-hook runs (shardwrap's step hooks run first: for a shape-aware
optimizer the all-to-all that brings each owner its parameters' values and gradients), inside
its step, and after its own post-hook (shardwrap's send back the new values); and
``newton_schulz``, the time inside Muon's Newton-Schulz iteration (torch's, or DeepSpeed's
``muon_update``, which includes its momentum update); ``owner all-to-all``, the time inside
shardwrap's two all-to-alls of a shape-aware step (the rest of the exchange is copies).

Models (``"model"`` in the config): ``gpt``, the GPT of ``examples/train_gpt.py``, or ``t5``,
Hugging Face's ``T5ForConditionalGeneration`` (``depth`` encoder and ``depth`` decoder blocks,
the block ``T5Block``, no dropout) fed each sequence as both encoder and decoder input. Both
read bytes (vocabulary 256) and train next-byte prediction.

Precisions (``"precision"`` in the config); every method keeps fp32 master weights and AdamW
state, and the loss is computed in fp32 from the logits:

- ``fp32``: everything in fp32.
- ``bf16``: shardwrap with ``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)``,
  FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every
  ``fully_shard`` call, DDP and ``single`` under ``torch.autocast(dtype=bfloat16)`` around
  forward and loss, DeepSpeed with ``bf16`` enabled and ``communication_data_type`` fp32.

Memory on CPU is the resident-set high-water mark above the resident set just before the
model was built (after the process group is set up, the method's library and the optimizer's
``torch._dynamo`` imported; what wrapping imports lazily counts, for every method alike); on
GPU, ``max_memory_allocated``.
``build_peak_mb_per_rank`` is the same peak taken when wrapping has ended, before the first
step: where it equals ``peak_mb_per_rank``, building the unsharded model and wrapping it set the
peak, not training. Bytes per step count the buffers handed to collectives (all-gather output,
reduce-scatter input, all-reduce, reduce and broadcast tensor), the same convention for every
method. ``step_times`` are each timed step's wall time on the slowest rank; ``cpu_step_times``
its CPU time on the busiest rank (``time.process_time``: every thread of the process, the
backend's included), which other work on a shared machine disturbs less than wall time.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _launch import end_ranks  # noqa: E402  (this folder, as the script's)
from compare import (  # noqa: E402
    ALIASES,
    METHODS,
    OPTIMIZERS,
    PRECISIONS,
)

from benchmarks._memory import StorageTracker  # noqa: E402
from examples.train_gpt import GPT, Block  # noqa: E402
from shardwrap import CommStats, MixedPrecision, ShardedModule  # noqa: E402

MODELS = ("gpt", "t5")
WRAPS = ("block", "root")
# DeepSpeed's ZeRO++ options by the short names of the config's ``zeropp``.
ZEROPP = {"qwz": "zero_quantized_weights", "qgz": "zero_quantized_gradients", "hpz": ""}


@dataclass(frozen=True)
class Config:
    """What every method trains; defaults are the issue's reference configuration."""

    model: str = "gpt"
    """``gpt`` or ``t5`` (see the module docstring)."""
    depth: int = 8
    width: int = 1024
    heads: int = 16
    context: int = 64
    batch: int = 2
    warmup: int = 2
    steps: int = 6
    lr: float = 1e-4
    seed: int = 0
    precision: str = "fp32"
    """``fp32``, or ``bf16``: bf16 compute on fp32 master weights, gradients reduced in fp32."""
    optimizer: str = "adamw"
    """``adamw``, ``muon`` or ``adafactor`` (see the module docstring)."""
    wrap: str = "block"
    """``block``: every block its own unit (shardwrap's ``auto_wrap``, FSDP2's ``fully_shard`` per
    block); ``root``: the whole model one unit (no ``auto_wrap``, ``fully_shard`` on the root
    alone). DDP and ``single`` ignore it. ``benchmarks/step_overhead.py`` varies it."""
    compress_params: str | None = None
    """shardwrap's ``Compression(params=...)``: ``int8`` or ``fp8``; ``None``: full width."""
    compress_grads: str | None = None
    """shardwrap's ``Compression(grads=...)``: ``int8`` or ``int4``; ``None``: full width."""
    error_feedback: bool = True
    """shardwrap's ``Compression(error_feedback=...)``, where ``compress_grads`` is set."""
    zeropp: str = ""
    """DeepSpeed ZeRO++ options, comma-separated: ``qwz``, ``qgz``, ``hpz``."""
    hpz_size: int = 2
    """``zero_hpz_partition_size`` where ``zeropp`` holds ``hpz``."""
    track: bool = False
    """Also count every storage created from building the model through the warm-up steps
    (``benchmarks/_memory.py``) and report the peak of live bytes after wrapping: the CPU's
    counterpart of ``max_memory_allocated``. Its Python hook slows those steps, so only timed
    steps, untracked, are timed; it needs two warm-up steps (the second is a steady step)."""

    def __post_init__(self) -> None:
        if self.track and self.warmup < 2:
            raise ValueError(f"track needs at least 2 warm-up steps, got {self.warmup}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.wrap not in WRAPS:
            raise ValueError(f"wrap must be one of {WRAPS}, got {self.wrap!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        unknown = set(filter(None, self.zeropp.split(","))) - set(ZEROPP)
        if unknown:
            raise ValueError(f"zeropp options are among {tuple(ZEROPP)}, got {sorted(unknown)}")


@dataclass
class Trainer:
    """A wrapped model and the two calls of a training step after its forward."""

    model: nn.Module
    backward: Callable[[Tensor], None]
    step: Callable[[], None]
    """The optimizer step, gradients zeroed afterwards."""


def rss_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def peak_mb(device: torch.device, rss_before: float) -> float:
    """This rank's peak memory so far (see the module docstring), in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return rss_mb("VmHWM") - rss_before


class ByteCounter:
    """Counts bytes handed to torch.distributed's collectives while installed."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.params = 0
        self.paused = False
        self._saved: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        def wrap(name: str, size: Callable[..., int]) -> None:
            original = getattr(dist, name)
            self._saved[name] = original

            def counted(*args: Any, **kwargs: Any) -> Any:
                if not self.paused:
                    self.bytes += size(*args, *kwargs.values())
                    self.calls += 1
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        wrap("all_gather_single", lambda out, *a: nbytes(out))
        wrap("all_gather_into_tensor", lambda out, *a: nbytes(out))
        wrap("all_gather", lambda outs, *a: sum(map(nbytes, outs)))
        wrap("reduce_scatter_single", lambda out, inp, *a: nbytes(inp))
        wrap("reduce_scatter_tensor", lambda out, inp, *a: nbytes(inp))
        wrap("reduce_scatter", lambda out, inputs, *a: sum(map(nbytes, inputs)))
        wrap("all_reduce", lambda t, *a: nbytes(t))
        wrap("reduce", lambda t, *a: nbytes(t))
        wrap("broadcast", lambda t, *a: nbytes(t))


def make_model(cfg: Config) -> tuple[nn.Module, type[nn.Module]]:
    """The model, built on CPU from ``cfg.seed``, and its block class."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "gpt":
        model = GPT(
            vocab=256, width=cfg.width, heads=cfg.heads, depth=cfg.depth, context=cfg.context
        )
        return model, Block
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    t5 = T5Config(
        vocab_size=256,
        d_model=cfg.width,
        d_kv=cfg.width // cfg.heads,
        d_ff=4 * cfg.width,
        num_layers=cfg.depth,
        num_heads=cfg.heads,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(t5), T5Block


def logits_of(model: nn.Module, cfg: Config, inputs: Tensor) -> Tensor:
    """(B, T) byte ids to (B, T, 256) logits."""
    if cfg.model == "t5":
        return model(input_ids=inputs, decoder_input_ids=inputs).logits
    return model(inputs)


class Phases:
    """Seconds spent per phase of the current step (see the module docstring)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def end_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(self.seconds)
        self.seconds = {}

    def medians(self) -> dict[str, float]:
        names = dict.fromkeys(name for step in self.steps for name in step)
        return {n: statistics.median(s.get(n, 0.0) for s in self.steps) for n in names}

    def time_newton_schulz(self) -> None:
        """Time every Newton-Schulz iteration of torch's Muon and every DeepSpeed Muon update."""
        import torch.optim._muon as torch_muon

        def timed(module: Any, name: str) -> None:
            original = getattr(module, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                out = original(*args, **kwargs)
                self.add("newton_schulz", time.perf_counter() - t0)
                return out

            setattr(module, name, wrapper)

        timed(torch_muon, "_zeropower_via_newtonschulz")
        if "deepspeed" in sys.modules:
            from deepspeed.runtime.zero.muon import original_muon

            timed(original_muon, "muon_update")


PHASES = Phases()


def optimizers(params: list[nn.Parameter], cfg: Config) -> dict[str, torch.optim.Optimizer]:
    """The torch optimizers of ``cfg.optimizer`` over ``params``, by name."""
    if cfg.optimizer == "adamw":
        return {"adamw": torch.optim.AdamW(params, lr=cfg.lr)}
    if cfg.optimizer == "adafactor":
        return {"adafactor": torch.optim.Adafactor(params, lr=cfg.lr)}
    return {
        "muon": torch.optim.Muon([p for p in params if p.ndim == 2], lr=cfg.lr),
        "adamw": torch.optim.AdamW([p for p in params if p.ndim != 2], lr=cfg.lr),
    }


def timed_step(name: str, opt: torch.optim.Optimizer) -> Callable[[], None]:
    """``opt.step()``, its time split into exchange in, update and exchange out: its own step
    hooks run after shardwrap's pre-hook and before shardwrap's post-hook."""
    marks: dict[str, float] = {}
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("pre", time.perf_counter()))
    opt.register_step_post_hook(lambda *_: marks.__setitem__("post", time.perf_counter()))

    def step() -> None:
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        PHASES.add(f"{name} exchange in", marks["pre"] - t0)
        PHASES.add(f"{name} update", marks["post"] - marks["pre"])
        PHASES.add(f"{name} exchange out", t1 - marks["post"])

    return step


def plain(model: nn.Module, cfg: Config) -> Trainer:
    opts = optimizers(list(model.parameters()), cfg)
    steps = [timed_step(name, opt) for name, opt in opts.items()]

    def step() -> None:
        for one in steps:
            one()
        for opt in opts.values():
            opt.zero_grad()

    return Trainer(model, Tensor.backward, step)


def build(method: str, cfg: Config, device: torch.device, counter: ByteCounter) -> Trainer:
    model, block = make_model(cfg)
    counter.params = sum(p.numel() for p in model.parameters())
    bf16 = cfg.precision == "bf16"
    if method.startswith("shardwrap-s"):
        stage = int(method[-1])
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # Without compression and at stage 3, no keyword: A/B runs also benchmark older commits.
        extra: dict[str, Any] = {} if stage == 3 else {"stage": stage}
        if cfg.compress_params or cfg.compress_grads:
            from shardwrap import Compression

            extra["compression"] = Compression(
                params=cfg.compress_params,
                grads=cfg.compress_grads,
                error_feedback=cfg.error_feedback,
            )
        wrapped = ShardedModule(
            model.to(device),
            auto_wrap=block if cfg.wrap == "block" else None,
            mixed_precision=mixed if bf16 else None,
            **extra,
        )
        return plain(wrapped, cfg)
    if method in ("fsdp2", "fsdp2-noreshard"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        reshard = method == "fsdp2"
        for module in model.modules() if cfg.wrap == "block" else ():
            if isinstance(module, block):
                fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model.to(device), mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        return plain(model, cfg)
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model.to(device), device_ids=[device] if device.type == "cuda" else None
        )

        def hook(state, bucket):  # noqa: ANN001, ANN202 (DDP inspects the real annotation)
            buf = bucket.buffer()  # counted by the ByteCounter's all_reduce
            buf.div_(dist.get_world_size())
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, hook)
        return plain(ddp, cfg)
    if method == "single":
        return plain(model.to(device), cfg)
    if method.startswith("deepspeed-s"):
        import deepspeed

        if cfg.optimizer == "adafactor":
            raise ValueError(
                "Adafactor is not benchmarked under DeepSpeed: ZeRO hands its client optimizer "
                "flat 1-D partitions, whose factored moments are not Adafactor's; choose adamw "
                "or muon (DeepSpeed's own Muon)"
            )
        muon = {
            "optimizer": {
                "type": "Muon",
                "params": {"lr": cfg.lr, "momentum": 0.95, "ns_method": "standard"},
            }
        }
        engine, *_ = deepspeed.initialize(
            model=model.to(device),
            **(
                {"model_parameters": model.parameters()}
                if cfg.optimizer == "muon"
                else {"optimizer": torch.optim.AdamW(model.parameters(), lr=cfg.lr)}
            ),
            config={
                **(muon if cfg.optimizer == "muon" else {}),
                "train_micro_batch_size_per_gpu": cfg.batch,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": int(method[-1]), **zeropp(cfg)},
                "zero_allow_untested_optimizer": True,
                "bf16": {"enabled": bf16},
                **({"communication_data_type": "fp32"} if bf16 else {}),
            },
        )
        return Trainer(engine, engine.backward, engine.step)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def zeropp(cfg: Config) -> dict[str, Any]:
    """The ``zero_optimization`` entries of the ZeRO++ options in ``cfg.zeropp``."""
    chosen = set(filter(None, cfg.zeropp.split(",")))
    entries: dict[str, Any] = {ZEROPP[o]: True for o in chosen - {"hpz"}}
    if "hpz" in chosen:
        entries["zero_hpz_partition_size"] = cfg.hpz_size
    return entries


class _TimedWait:
    """A collective in flight whose ``wait()`` adds the time from its issue to its end to the
    phase ``owner all-to-all``."""

    def __init__(self, pending: Any, issued: float) -> None:
        self._pending, self._issued = pending, issued

    def wait(self) -> None:
        self._pending.wait()
        PHASES.add("owner all-to-all", time.perf_counter() - self._issued)


def count_owner_exchange() -> CommStats:
    """Count the bytes each rank sends in the all-to-alls that step shape-aware optimizers
    (``shardwrap.engine.optim.whole_params``) on a statistics object of their own (the model's
    ``comm_stats`` counts them too, among its other collectives), and time them (issue to end
    of ``wait()``; the copies around them are not in it)."""
    from shardwrap.engine.optim import whole_params

    stats = CommStats()
    original = whole_params.all_to_all

    def counted(outs: list[Tensor], ins: list[Tensor], group: Any, *_: Any) -> _TimedWait:
        issued = time.perf_counter()
        return _TimedWait(original(outs, ins, group, stats), issued)

    whole_params.all_to_all = counted
    return stats


def setup_deepspeed() -> None:
    """Import DeepSpeed and attach it to the process group, before memory is measured."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # falls back to gloo without oneCCL
    os.environ.setdefault("MAX_JOBS", "1")  # its first run compiles a communication op
    import deepspeed

    deepspeed.init_distributed(dist.get_backend())


def run(method: str, cfg: Config) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    counter = ByteCounter()
    counter.install()  # before DeepSpeed, which keeps references to some collectives
    if method.startswith("deepspeed-s"):
        setup_deepspeed()
    exchange = count_owner_exchange()
    PHASES.time_newton_schulz()
    if cfg.model == "t5":
        import transformers  # noqa: F401 (library code is no method's memory)
    # NOTE: torch.optim imports torch._dynamo when the first optimizer is built, 73 MB of
    # library code that every method pays alike; imported here, it stays out of the peak.
    importlib.import_module("torch._dynamo")
    dist.barrier()
    rss_before = rss_mb("VmRSS")
    tracker = StorageTracker() if cfg.track else None
    if tracker is not None:
        tracker.__enter__()
    trainer = build(method, cfg, device, counter)
    built = peak_mb(device, rss_before)
    if tracker is not None:
        tracker.reset_peak()  # the unsharded model each rank built is gone
    model = trainer.model
    gen = torch.Generator().manual_seed(cfg.seed + rank)
    autocast = torch.autocast(
        device.type,
        dtype=torch.bfloat16,
        enabled=cfg.precision == "bf16" and method in ("ddp", "single"),
    )
    times, cpu_times, losses = [], [], []
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            if tracker is not None:
                tracker.__exit__(None, None, None)
            counter.bytes = counter.calls = 0
            exchange.reset()
            if method.startswith("shardwrap"):
                model.comm_stats.reset()
        tokens = torch.randint(256, (cfg.batch, cfg.context + 1), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, cpu0 = time.perf_counter(), time.process_time()
        with autocast:
            logits = logits_of(model, cfg, tokens[:, :-1])  # (B, T, 256), bf16 under bf16
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        trainer.backward(loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        trainer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        PHASES.add("forward_backward", t1 - t0)
        PHASES.add("step", t2 - t1)
        PHASES.end_step(keep=step >= cfg.warmup)
        elapsed = torch.tensor([t2 - t0, time.process_time() - cpu0])
        counter.paused = True  # the benchmark's own reduction is not the method's traffic
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
        counter.paused = False
        losses.append(loss.item())
        if step >= cfg.warmup:
            times.append(elapsed[0].item())
            cpu_times.append(elapsed[1].item())
    by_kind: dict[str, float] = {}
    calls_by_kind: dict[str, float] = {}
    if method.startswith("shardwrap"):
        comm_bytes = sum(model.comm_stats.bytes.values())
        comm_calls = sum(model.comm_stats.calls.values())
        by_kind = {k: b / cfg.steps for k, b in model.comm_stats.bytes.items()}
        calls_by_kind = {k: c / cfg.steps for k, c in model.comm_stats.calls.items()}
    else:
        comm_bytes, comm_calls = counter.bytes, counter.calls
    counter.paused = True  # what follows is the benchmark's own traffic
    per_rank: list[Any] = [None] * world
    exchanged = sum(exchange.bytes.values()) / cfg.steps
    dist.all_gather_object(per_rank, (PHASES.medians(), exchanged))
    tracked = -1.0 if tracker is None else tracker.peak / 2**20
    peak = torch.tensor([peak_mb(device, rss_before), built, tracked])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "method": method,
        "world_size": world,
        "device": device.type,
        "params": counter.params,
        "step_s": statistics.median(times),
        "step_times": times,
        "cpu_step_times": cpu_times,
        "tokens_per_s_per_rank": cfg.batch * cfg.context / statistics.median(times),
        "peak_mb_per_rank": peak[0].item(),
        "build_peak_mb_per_rank": peak[1].item(),
        **({"tracked_peak_mb_per_rank": peak[2].item()} if cfg.track else {}),
        "comm_bytes_per_step": comm_bytes / cfg.steps,
        "comm_calls_per_step": comm_calls / cfg.steps,
        "comm_bytes_per_step_by_kind": by_kind,
        "comm_calls_per_step_by_kind": calls_by_kind,
        "owner_exchange_bytes_per_step_per_rank": [e for _, e in per_rank],
        "phases_s_per_rank": [p for p, _ in per_rank],
        "losses": losses,
        "final_loss": losses[-1],
        "config": asdict(cfg),
    }


def main() -> None:
    method = ALIASES.get(sys.argv[1], sys.argv[1])
    cfg = Config(**json.loads(sys.argv[2])) if len(sys.argv) > 2 else Config()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = run(method, cfg)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    end_ranks()


if __name__ == "__main__":
    main()
