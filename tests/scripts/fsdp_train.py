"""FSDP2 training on CPU with elastic.State: sharded state saved and resharded by DCP.

Logs, per step, the world size and a checksum of the full parameters (an all-gather), to
``$RESULT_DIR/w<pid>.jsonl``; right after ``restore()`` it logs the restored checksum.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

import elastic


def checksum(model: nn.Module) -> float:
    return float(sum(p.full_tensor().double().sum() for p in model.parameters()))


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.1)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = elastic.State(model=model, optimizer=opt)
    restored = state.restore()
    out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115

    def log(**kw: object) -> None:
        out.write(json.dumps({"t": time.time(), "rank": rank, "world": world, **kw}) + "\n")
        out.flush()

    if restored:
        log(event="restored", step=state.step, checksum=checksum(model))
    g = torch.Generator().manual_seed(rank)
    while state.step < a.steps:
        x = torch.randn(8, 16, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        log(event="step", step=state.step + 1, checksum=checksum(model))
        state.commit()  # may save and stop here for a resize: the step above is kept
        time.sleep(a.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
