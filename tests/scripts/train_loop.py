"""A small gloo DDP loop for end-to-end tests: every step is logged with the world size.

Each worker appends one JSON line per step to ``$RESULT_DIR/w<pid>.jsonl`` so tests can
see who trained, when, and at which world size. ``--crash-rank/--crash-step`` make one
rank raise (``@record`` writes TORCHELASTIC_ERROR_FILE, as torch scripts do).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--crash-rank", type=int, default=-1)
    ap.add_argument("--crash-step", type=int, default=-1)
    ap.add_argument(
        "--crash-restarts",
        type=int,
        default=99,
        help="crash only while TORCHELASTIC_RESTART_COUNT is below this",
    )
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115
    for step in range(a.steps):
        if rank == a.crash_rank and step == a.crash_step and restarts < a.crash_restarts:
            raise RuntimeError(f"injected crash at step {step} on rank {rank}")
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.write(
            json.dumps(
                {
                    "t": time.time(),
                    "step": step,
                    "rank": rank,
                    "world": world,
                    "restarts": restarts,
                    "pid": os.getpid(),
                    "port": int(os.environ["MASTER_PORT"]),
                }
            )
            + "\n"
        )
        out.flush()
        time.sleep(a.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
