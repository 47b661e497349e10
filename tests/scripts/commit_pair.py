"""One rank of a two-rank gloo job committing steps that take no time (for
tests/test_agreement.py): counts the agreements, and rank 1 alone is asked to stop at
step STOP_AT; prints where both ranks stopped, the gap and how many agreements it took."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import elastic
from elastic.worker import comm

STEPS, STOP_AT = 2000, 1500


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = elastic.State(model=torch.nn.Linear(4, 1))
    core = state._core
    control = comm.control()
    agreements = 0
    real = control.all_reduce

    def counted(values: list[int], op: str) -> list[int]:
        nonlocal agreements
        agreements += 1
        return real(values, op)

    control.all_reduce = counted  # type: ignore[method-assign]
    if rank == 1:
        core.stopping = lambda: core.values["step"] >= STOP_AT  # type: ignore[method-assign]
    stopped = None
    for _ in range(STEPS):
        try:
            state.commit()
        except SystemExit:  # saved and stopping for a resize (exit code 75)
            stopped = state.step
            break
    print(f"rank {rank} stopped {stopped} gap {core.agreement.gap} agreements {agreements}")
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
