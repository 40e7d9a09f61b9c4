"""How fast this CPU multiplies matrices in bf16 against fp32, in the layouts a linear layer uses.

    python benchmarks/bf16_matmul.py

A ``Linear(512, 2048)`` over 128 rows: forward ``x @ W.T``, weight gradient ``g.T @ x`` and
input gradient ``g @ W``. On a CPU without bf16 matrix instructions some of these layouts run
tens of times slower in bf16, which bounds any bf16 training step there, sharded or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def millis(fn: Callable[[], object], repeat: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


def main() -> None:
    torch.set_num_threads(1)
    x, w, g = torch.randn(128, 512), torch.randn(2048, 512), torch.randn(128, 2048)
    print("dtype     forward x@W.T   weight grad g.T@x   input grad g@W   (ms, one thread)")
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd, gd = x.to(dtype), w.to(dtype), g.to(dtype)
        times = [
            millis(lambda x=xd, w=wd: torch.nn.functional.linear(x, w)),
            millis(lambda x=xd, g=gd: g.t() @ x),
            millis(lambda w=wd, g=gd: g @ w),
        ]
        print(f"{str(dtype):9s} " + "".join(f"{t:16.1f}" for t in times))


if __name__ == "__main__":
    main()
