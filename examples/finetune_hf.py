"""Train a Hugging Face causal LM (GPT-2 or Llama, from a tiny config) with shardwrap.

    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --model gpt2
    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --model llama
    python examples/finetune_hf.py                                   # one rank

The model is a ``transformers`` model built from a small config with random weights: nothing
is downloaded and the Hub is never contacted. Each decoder layer (``GPT2Block``,
``LlamaDecoderLayer``) becomes a shardwrap unit; GPT-2's head stays tied to its embedding.
Training runs in bf16 mixed precision by default (``--precision fp32`` for full precision):
shards, gradients reduced and AdamW state stay fp32, gathered parameters are bf16. On a CPU
without bf16 matrix instructions bf16 runs slower than fp32 (twice the time on the 2-core
development machine); it is the default because GPUs train in it.

Tokens are bytes: the vocabulary is 256, one id per byte value, and the corpus is the standard
library's ``.py`` files (or ``--data``), as in ``train_gpt.py``. Every rank calls
``model.generate()`` at the end (each forward gathers the shards); rank 0 prints the greedy
sample. ``--summary PATH`` writes the losses and every rank's sampled ids as JSON, and
``--export DIR`` writes the trained model in a folder ``from_pretrained`` reads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from train_gpt import load_corpus, lr_at  # the sibling example; the script's folder is on sys.path

import shardwrap
from shardwrap import MixedPrecision, ShardedModule

VOCAB = 256  # one token per byte value
NUL = 0  # bos, eos and padding: a byte that source text does not contain


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak; linear warmup, cosine decay")
    p.add_argument("--data", type=Path, help="a file or folder; default: the stdlib's .py files")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--prompt", default="\n\ndef ", help="start of the greedy sample")
    p.add_argument("--sample-tokens", type=int, default=48, help="prompt and sample fit --context")
    p.add_argument("--summary", type=Path, help="write losses and samples here as JSON")
    p.add_argument("--export", type=Path, help="write the trained model to this folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if len(args.prompt.encode()) + args.sample_tokens > args.context:
        p.error("the prompt's bytes and --sample-tokens must fit in --context (GPT-2's positions)")
    return args


def build_model(args: argparse.Namespace) -> tuple[nn.Module, type[nn.Module]]:
    """The causal LM with random weights, and its decoder-layer class (the unit)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: never ask the Hub
    import transformers

    special = dict(bos_token_id=NUL, eos_token_id=NUL, pad_token_id=NUL)
    if args.model == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=args.context,
            n_embd=args.width,
            n_layer=args.layers,
            n_head=args.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **special,
        )
        return transformers.GPT2LMHeadModel(config), GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.width,
        intermediate_size=8 * args.width // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),  # grouped-query attention
        max_position_embeddings=args.context,
        **special,
    )
    return transformers.LlamaForCausalLM(config), LlamaDecoderLayer


def main(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        # A hung rank holds the others in their collective until this timeout (torch's default:
        # 30 minutes with gloo); then they fail (shardwrap.CollectiveFailed) instead of waiting.
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    else:  # plain `python examples/finetune_hf.py`: one rank, the same code path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    windows = load_corpus(args.data).unfold(0, args.context, 1)  # (n, T), a view
    rng = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)  # own windows per rank

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model, layer = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    decay = {n for n, p in model.named_parameters() if p.ndim >= 2}
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    precision = bf16 if args.precision == "bf16" else None
    model = ShardedModule(model, auto_wrap=layer, mixed_precision=precision)
    device = next(model.parameters()).device  # where shardwrap put the shards
    named = list(model.named_parameters())  # shards are 1-D: choose weight decay by name
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    if rank == 0:
        print(f"{args.model}: {n_params:,} parameters, {layer.__name__} units, {args.precision}")
        print(f"{len(windows):,} windows of {args.context} bytes; world size {world}, {device}")

    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(len(windows), (args.batch,), generator=rng)
        ids = windows[starts].to(device, torch.long)  # (B, T); the model shifts the labels
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 in (1, args.steps)):
            tok_s = world * args.batch * args.context * (step + 1) / (time.perf_counter() - start)
            print(f"step {step + 1:5d}  loss {losses[-1]:.3f}  {tok_s:,.0f} tokens/s", flush=True)

    model.eval()  # every rank generates alike: each forward gathers the units' shards
    prompt = torch.tensor([list(args.prompt.encode())], device=device)
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=args.sample_tokens,
        min_new_tokens=args.sample_tokens,
        do_sample=False,
        pad_token_id=NUL,
    )
    sample = out[0, prompt.shape[1] :].tolist()
    samples: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(samples, sample)
    if args.export is not None:
        shardwrap.export(args.export, model)
    if rank == 0:
        text = bytes(sample).decode(errors="replace")
        print(f"\ngreedy sample:\n{args.prompt}{text}")
        if args.summary is not None:
            summary = dict(
                model=args.model,
                precision=args.precision,
                world_size=world,
                parameters=n_params,
                losses=losses,
                samples=samples,
            )
            args.summary.write_text(json.dumps(summary) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
