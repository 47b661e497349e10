"""The benchmarks' training script: a small gloo DDP loop logging every step.

Each worker appends ``{"t", "step", "rank", "world"}`` lines to ``$RESULT_DIR/w<pid>.jsonl``.
It never resumes from a checkpoint: the benchmarks time recovery, not training.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    step_time = float(sys.argv[1]) if len(sys.argv) > 1 else 0.05
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl")
    with open(path, "a") as out:
        for step in range(10**9):
            loss = model(torch.randn(16, 32)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.write(
                json.dumps({"t": time.time(), "step": step, "rank": rank, "world": world}) + "\n"
            )
            out.flush()
            time.sleep(step_time)


if __name__ == "__main__":
    main()
