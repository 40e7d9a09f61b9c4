"""The files a gather and a gradient pass through, in shardwrap and in FSDP2, counted alike.

    python benchmarks/crossings.py              # both libraries, 2 ranks, a table per hook

Each library wraps the same model (4 blocks of two Linear layers, each block a unit, then the
root) on 2 ranks under ``torchrun``; shardwrap at stage 3 with one exchange per unit
(``bucket_mb=0``), FSDP2 with ``fully_shard`` per block and on the root. After three steps,
rank 0 records one step with ``sys.setprofile``: every call into the library's own files (the
``shardwrap`` package; FSDP2's ``torch/distributed/fsdp/_fully_shard``), as a tree per hook
that torch runs (a module's forward hooks, autograd's). The rule that counts:

- a call is on the data's path where it, or a call under it, reaches torch (a tensor's method,
  a torch function, a collective): reads of Python values and bookkeeping are left out;
- walking that pruned tree down and back up, each step between two files is a change of file.

Per kind of hook the report gives the files and changes of the median call, and the most of any
call. Output: ``benchmarks/results/crossings/<theme>_<hardware>_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from _launch import commit, end_ranks, hardware, results_dir, torchrun_json
from torch import nn

METHODS = ("shardwrap", "fsdp2")

PRE_FORWARD = "pre-forward (waits, views, prefetches the next)"
POST_FORWARD = "post-forward (reshards)"
PRE_BACKWARD = "pre-backward (gathers, issues reductions)"
VIEWS_DONE = "a gradient's views done (flat gradient, reduction lands)"
GRAD_DONE = "a gradient complete (released, handed to reductions)"
END_BACKWARD = "end of backward (every gradient lands in .grad)"
# What each hook is, by the qualified name of its first call in the library.
KINDS = {
    "Root._hook_pre_forward.<locals>.hook": PRE_FORWARD,
    "FSDPState._pre_forward": PRE_FORWARD,
    "Root._hook_post_forward.<locals>.hook": POST_FORWARD,
    "FSDPState._post_forward": POST_FORWARD,
    "Root._outputs.<locals>.pre_backward": PRE_BACKWARD,
    "FSDPState._pre_backward": PRE_BACKWARD,
    "_FullParams.backward": VIEWS_DONE,
    "Unit.hook_grad.<locals>.hook": GRAD_DONE,
    "RegisterPostBackwardFunction.backward": GRAD_DONE,
    "Root._end_backward": END_BACKWARD,
    "FSDPState._root_post_backward_final_callback": END_BACKWARD,
}


class Recorder:
    """Call trees of the package under ``prefix``, one per hook torch runs, while installed."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.roots: list[dict[str, Any]] = []
        self.open: list[dict[str, Any]] = []

    def _parent(self, frame: FrameType) -> dict[str, Any] | None:
        """The open call of the nearest package frame up the stack, unless torch's module call
        or autograd (no Python caller) ran this one first: then it is a hook of its own."""
        caller = frame.f_back
        while caller is not None:
            name = caller.f_code.co_filename
            if name.startswith(self.prefix):
                return next((n for n in reversed(self.open) if n["frame"] is caller), None)
            if name.endswith("torch/nn/modules/module.py"):
                return None
            caller = caller.f_back
        return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(self.prefix):
            node = {
                "file": name[len(self.prefix) :],
                "name": frame.f_code.co_qualname,
                "calls": [],
                "torch": False,
                "frame": frame,
            }
            parent = self._parent(frame)
            (parent["calls"] if parent is not None else self.roots).append(node)
            self.open.append(node)
        elif event == "call" and self.open and "/torch/" in name:
            self.open[-1]["torch"] = True
        elif event == "return" and self.open and self.open[-1]["frame"] is frame:
            self.open.pop()["frame"] = None
        elif event == "c_call" and self.open and self.open[-1]["frame"] is frame:
            module = getattr(arg, "__module__", None) or ""
            owner = getattr(arg, "__self__", None)
            if module.startswith("torch") or (
                owner is not None and type(owner).__module__.startswith("torch")
            ):
                self.open[-1]["torch"] = True


def prune(node: dict[str, Any]) -> dict[str, Any] | None:
    """``node`` with only the calls that reach torch; ``None`` where none does."""
    calls = [c for c in (prune(c) for c in node["calls"]) if c is not None]
    if not calls and not node["torch"]:
        return None
    return {"file": node["file"], "name": node["name"], "calls": calls}


def walk(node: dict[str, Any], files: list[str]) -> None:
    """The files met walking down into each call and back up, in order."""
    files.append(node["file"])
    for call in node["calls"]:
        walk(call, files)
        files.append(node["file"])


def hook_name(node: dict[str, Any]) -> str:
    """The first call of a hook that is not a decorator's wrapper."""
    while node["name"].endswith("wrapper") and node["calls"]:
        node = node["calls"][0]
    return node["name"]


def measure(method: str) -> list[dict[str, Any]]:
    """On every rank: train, record one step; rank 0's hooks with their files and changes."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(torch.relu(self.a(x)))

    model: nn.Module = nn.Sequential(*[Block() for _ in range(4)], nn.Linear(64, 8))
    if method == "shardwrap":
        import shardwrap
        from shardwrap import ShardedModule

        model = ShardedModule(model, auto_wrap=Block, bucket_mb=0)
        prefix = os.path.dirname(shardwrap.__file__) + "/"
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model[:4]:
            fully_shard(block)
        fully_shard(model)
        prefix = os.path.dirname(torch.__file__) + "/distributed/fsdp/_fully_shard/"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = Recorder(prefix)
    for step in range(4):
        x = torch.randn(4, 64)
        if step == 3:
            sys.setprofile(recorder)
        model(x).pow(2).mean().backward()
        sys.setprofile(None)
        opt.step()
        opt.zero_grad()
    hooks = []
    for root in recorder.roots:
        tree = prune(root)
        if tree is None or (kind := KINDS.get(hook_name(tree))) is None:
            continue
        files: list[str] = []
        walk(tree, files)
        changes = sum(a != b for a, b in zip(files, files[1:]))
        hooks.append({"kind": kind, "files": sorted(set(files)), "changes": changes})
    dist.barrier()
    return hooks


def summarize(hooks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: the median and the most files and changes, and every file any call met."""
    out: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(KINDS.values()):
        mine = [h for h in hooks if h["kind"] == kind]
        if mine:
            out[kind] = {
                "calls": len(mine),
                "files": statistics.median_low(len(h["files"]) for h in mine),
                "changes": statistics.median_low(h["changes"] for h in mine),
                "most_files": max(len(h["files"]) for h in mine),
                "most_changes": max(h["changes"] for h in mine),
                "met": sorted({Path(f).stem for h in mine for f in h["files"]}),
            }
    return out


def report(summaries: dict[str, dict[str, Any]], argv: list[str]) -> str:
    rows = ["| hook | method | calls | files | changes | most files / changes | files met |"]
    rows.append("|---|---|---|---|---|---|---|")
    for kind in dict.fromkeys(KINDS.values()):
        for method, summary in summaries.items():
            s = summary.get(kind)
            if s is not None:
                rows.append(
                    f"| {kind} | {method} | {s['calls']} | {s['files']} | {s['changes']} | "
                    f"{s['most_files']} / {s['most_changes']} | {', '.join(s['met'])} |"
                )
    return "\n".join(
        [
            "# The files a gather and a gradient pass through: shardwrap and FSDP2",
            "",
            f"- command: `{' '.join(['python benchmarks/crossings.py', *argv])}`",
            f"- commit {commit()}, {datetime.date.today()}, torch {torch.__version__}, "
            f"{hardware()}, gloo, 2 ranks under torchrun, rank 0's fourth step",
            "- model: 4 blocks of two Linear(64, 64), each a unit, and a Linear(64, 8) in the "
            "root; shardwrap stage 3 with bucket_mb=0, FSDP2 fully_shard per block and root",
            "- counted: calls into the library's own files that reach torch; files and changes "
            "of file walking each hook's pruned call tree (the median call, and the most)",
            "",
            *rows,
            "",
        ]
    )


def main() -> None:
    if "LOCAL_RANK" in os.environ:  # a rank of a launch below
        dist.init_process_group("gloo")
        hooks = measure(sys.argv[1])
        if dist.get_rank() == 0:
            Path(sys.argv[2]).write_text(json.dumps(hooks))
        end_ranks()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--theme", default="linear4_stage3")
    p.add_argument("--out-dir", type=Path, default=results_dir("crossings"))
    args = p.parse_args()
    summaries = {}
    for method in args.methods:
        hooks = torchrun_json(Path(__file__), method, nproc=2, timeout=600)
        if "error" in hooks:
            raise SystemExit(f"{method} failed: {hooks['error']}")
        summaries[method] = summarize(hooks)
    text = report(summaries, sys.argv[1:])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{args.theme}_{hardware()}_{datetime.date.today()}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(summaries, indent=1))
    print(text)


if __name__ == "__main__":
    main()
