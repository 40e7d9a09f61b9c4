"""Train the byte-level GPT of ``train_gpt.py`` with 2-D parallelism: shardwrap over dp, torch's
tensor parallelism over tp.

    torchrun --standalone --nproc_per_node=4 examples/train_gpt_tp.py --tp 2   # CPU, gloo

The ranks form a ``("dp", "tp")`` mesh. ``parallelize_module`` first splits each block's MLP
(column- then row-parallel), its attention projection (row-parallel over the replicated
attention's output), the token embedding and the head (vocabulary-parallel) over ``mesh["tp"]``;
``ShardedModule`` then keeps each dp rank's 1/dp of every tp rank's blocks. The tp ranks of one
dp rank read the same windows of the corpus. At the end the model is exported whole to
``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from examples.train_gpt import GPT, Block, load_corpus
from shardwrap import ShardedModule, export


def tp_plan() -> dict[str, object]:
    """The GPT's tensor-parallel plan, for ``parallelize_module`` (and the memory planner's
    ``tp_plan``). The fused ``qkv`` stays replicated: its rows are ``(q|k|v, head, dim)``, and a
    block of rows is not a set of heads."""
    return {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
        "blocks.*.proj": RowwiseParallel(input_layouts=Replicate()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="windows per dp rank and step")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("runs/gpt-tp/model"))
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # every rank builds the same model
    model = GPT(args.width, args.depth, args.heads, args.context)
    model = parallelize_module(model, mesh["tp"], tp_plan())
    model = ShardedModule(model, auto_wrap=Block, process_group=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = load_corpus(None)
    gen = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # one stream per dp rank
    for step in range(args.steps):
        starts = torch.randint(len(corpus) - args.context - 1, (args.batch,), generator=gen)
        windows = torch.stack([corpus[s : s + args.context + 1] for s in starts.tolist()]).long()
        loss = model(windows[:, :-1], windows[:, 1:])
        loss.backward()
        model.clip_grad_norm_(1.0)  # the norm over both axes
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    export(args.out, model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
