"""Two ranks on one device over one backend: which operations the backend does there, and
shardwrap's collectives and training over it (``tests/support/two_ranks.py``'s checks).

Launched by tests/e2e/test_gpu_two_ranks.py; both ranks use the same DEVICE:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/two_ranks_one_gpu.py \\
        BACKEND DEVICE OUT_PREFIX

Each rank appends its records to ``OUT_PREFIX.rank<R>.jsonl`` as each check starts and ends.
Collectives give up after 30 s, so a check the backend neither completes nor refuses ends the
run rather than holding it.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.two_ranks import run_checks


def main(backend: str, device: str, prefix: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the hostname may resolve nowhere
    dist.init_process_group(backend, timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    where = torch.device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)  # both ranks: the same GPU
    run_checks(rank, where, Path(f"{prefix}.rank{rank}.jsonl"))
    # NOTE: the records are written; a NCCL communicator whose creation was refused can hang
    # in destroy_process_group(), so the process ends here, at once.
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
