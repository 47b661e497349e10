"""One rank of a two-rank gloo group owned by ``elastic.worker.group.Group`` (for
tests/test_group.py): rank 1 blocks in a collective that rank 0 never joins, until the
agent's side asks it to abandon; it prints what the collective raised and whether the
group counts it as broken, then both ranks leave."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from elastic.contract import ControlBlock
from elastic.worker.group import Group


def main() -> None:
    block = ControlBlock(os.environ["BLOCK"])
    dist.init_process_group("gloo")
    g = Group(block)
    g.adopt()
    print("formed", flush=True)
    if dist.get_rank() == 1:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            print("returned", flush=True)
        except Exception as e:
            took = time.monotonic() - started
            print(f"broke {g.breaks(e)} after {took:.2f}s: {type(e).__name__}", flush=True)
    else:
        sys.stdin.readline()  # until the test has seen rank 1 break
    g.leave()
    print(f"left {dist.is_initialized()} {block.phase.name}", flush=True)
    g.close()


if __name__ == "__main__":
    main()
