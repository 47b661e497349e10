"""One rank of a two-rank gloo job committing steps that take no time (for
tests/test_agreement.py): counts the agreements, and rank 1 alone is asked to stop at
step STOP_AT; prints where both ranks stopped, the gap and how many agreements it took."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from agreements import Agreements, stop_rank_1_at, stopped_at  # this directory

import elastic

STEPS, STOP_AT = 2000, 1500


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = elastic.State(model=torch.nn.Linear(4, 1))
    agreements = Agreements()
    stop_rank_1_at(state, rank, STOP_AT)
    stopped = None
    for _ in range(STEPS):
        stopped = stopped_at(state)
        if stopped is not None:
            break
    gap = state._core.agreement.gap
    print(f"rank {rank} stopped {stopped} gap {gap} agreements {agreements.count}")
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
