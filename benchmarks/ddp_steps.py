"""The benchmarks' training script: a small gloo DDP loop logging every step.

Each worker appends ``{"t", "step", "rank", "world", "pid"}`` lines to
``$RESULT_DIR/w<pid>.jsonl``. Plain (the default), it never resumes from a checkpoint: the
benchmarks time recovery, not training, and ``step`` counts this process's steps. With
``--live`` it runs the loop in ``elastic.State.run``, so under elastic-run its workers keep
their processes through membership changes (or, with ``--restart-mode respawn``, new ones
resume from the snapshots), and ``step`` is the job's committed step it trains: a step
logged twice was trained again.

    python benchmarks/ddp_steps.py [step seconds] [--live]
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 10**9


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, out: IO[str], pause: float) -> None:
    ddp = DDP(model)  # on the process group of this round
    rank, world = dist.get_rank(), dist.get_world_size()
    pid = os.getpid()
    for step in range(STEPS):
        loss = ddp(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if state is not None:
            step = state.step + 1  # the job's step, once committed
        row = {"t": time.time(), "step": step, "rank": rank, "world": world, "pid": pid}
        out.write(json.dumps(row))
        out.write("\n")
        out.flush()
        if state is not None:
            state.commit()
        time.sleep(pause)


state = None


def main() -> None:
    global state
    args = [a for a in sys.argv[1:] if a != "--live"]
    pause = float(args[0]) if args else 0.05
    live = "--live" in sys.argv
    if live:  # before the process group, as the README says: a newcomer's worker can then
        import elastic  # start before its node joins (elastic/agent/lobby.py)
    dist.init_process_group("gloo")
    model = torch.nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl")
    with open(path, "a") as out:
        if not live:
            train(model, opt, out, pause)
            return
        state = elastic.State(model=model, optimizer=opt)
        state.run(train, model, opt, out, pause)


if __name__ == "__main__":
    main()
