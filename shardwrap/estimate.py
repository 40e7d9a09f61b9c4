"""The memory planner: what each rank will hold, per ZeRO stage and offload tier, before launch.

    python -m shardwrap.estimate gpt2 --world-size 8 --batch 4 --seq 1024
    python -m shardwrap.estimate examples.train_gpt:GPT --world-size 2 --batch 2 --seq 64 \\
        --kwargs '{"width": 1024, "depth": 8, "heads": 16, "context": 64}'
    python -m shardwrap.estimate llama --world-size 8 --tp 2 --batch 4 --seq 1024
    python -m shardwrap.estimate examples.train_gpt:GPT --world-size 4 --tp 2 \\
        --tp-plan examples.train_gpt_tp:tp_plan --batch 2 --seq 64 \\
        --kwargs '{"width": 1024, "depth": 8, "heads": 16, "context": 64}'

The model is built on the meta device, so nothing is allocated: a ``transformers`` model type
(its default config, nothing downloaded; ``--kwargs`` overrides fields) or ``module:factory``
(called with ``--kwargs``). With ``--tp`` the ranks are dp x tp, each tp rank holding its
blocks of what the model's own tensor-parallel plan (a ``transformers`` model's) or
``--tp-plan module:attr`` (a ``parallelize_module`` plan, or a function returning one) splits.
In Python: ``shardwrap.estimate_memory(...)``.
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

from .options import MixedPrecision
from .planning.planner import MemoryEstimate, MemoryPlan, estimate_memory

__all__ = ["MemoryEstimate", "MemoryPlan", "estimate_memory", "main"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> MemoryPlan:
    """Parse ``argv``, print the plan's table and return the plan."""
    p = argparse.ArgumentParser(
        prog="python -m shardwrap.estimate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the examples, one a line
    )
    p.add_argument("model", help="a transformers model type (gpt2, t5, llama) or module:factory")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--stage", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument(
        "--offload", nargs="+", choices=["cpu", "disk"], default=[], help="tiers besides none"
    )
    p.add_argument("--mixed-precision", choices=sorted(PRECISIONS), default="fp32")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--auto-wrap", help="module:Class of the block to wrap (default: found)")
    p.add_argument(
        "--kwargs", type=json.loads, default={}, help="JSON: factory arguments or config fields"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides world size)")
    p.add_argument("--tp-plan", help="module:attr, a parallelize_module plan or a function of none")
    args = p.parse_args(argv)
    dtype = PRECISIONS[args.mixed_precision]
    auto_wrap = None
    if args.auto_wrap:
        module, _, name = args.auto_wrap.partition(":")
        auto_wrap = getattr(importlib.import_module(module), name)
    tp_plan = None
    if args.tp_plan:
        module, _, name = args.tp_plan.partition(":")
        tp_plan = getattr(importlib.import_module(module), name)
        tp_plan = tp_plan() if callable(tp_plan) else tp_plan
    plan = estimate_memory(
        args.model,
        world_size=args.world_size,
        stage=tuple(args.stage),
        offload=(None, *args.offload),
        mixed_precision=MixedPrecision(param_dtype=dtype) if dtype else None,
        batch=args.batch,
        seq=args.seq,
        auto_wrap=auto_wrap,
        optimizer=args.optimizer,
        device=args.device,
        kwargs=args.kwargs,
        tp=args.tp,
        tp_plan=tp_plan,
    )
    print(plan)
    return plan


if __name__ == "__main__":
    main()
