"""FSDP2 training with elastic.State, on CPU (gloo) or, with ``--cuda``, on this local
rank's GPU (NCCL).

Logs, per step, the world size, the pid and a checksum of the full parameters (an
all-gather), to ``$RESULT_DIR/w<pid>.jsonl``; after each restore it logs the restored
checksum. ``--live``: the loop runs in ``State.run`` with a ``reshard`` function, so a
membership change re-shards the state in the survivors' memory; without it, a change
gives new workers that load the DCP checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

import elastic


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().full_tensor().double().sum() for p in model.parameters()))


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.1)
    ap.add_argument("--live", action="store_true")
    ap.add_argument(
        "--slow-until-world",
        type=int,
        default=0,
        help="0.4 s steps until this process trained at that world size: a join in the test "
        "lands while it trains, however slowly the newcomer starts",
    )
    ap.add_argument("--cuda", action="store_true")
    a = ap.parse_args()
    device = torch.device("cpu")
    if a.cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if a.cuda else "gloo")

    def shard() -> dict[str, Any]:
        """The model sharded over the current group, and its optimizer."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=0.01)}

    state = elastic.State(**shard())
    out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115

    def log(**kw: object) -> None:
        row = {"t": time.time(), "rank": dist.get_rank(), "world": dist.get_world_size()}
        out.write(json.dumps({**row, "pid": os.getpid(), "device": str(device), **kw}) + "\n")
        out.flush()

    grown = False  # this process trained at --slow-until-world

    def train() -> None:
        nonlocal grown
        model, opt = state.model, state.optimizer  # new ones after each re-sharding
        grown = grown or dist.get_world_size() >= a.slow_until_world
        if state.step:
            log(event="restored", step=state.step, checksum=checksum(model))
        g = torch.Generator().manual_seed(1000 * state.step + dist.get_rank())
        while state.step < a.steps:
            x = torch.randn(8, 16, generator=g).to(device)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            log(event="step", step=state.step + 1, checksum=checksum(model))
            state.commit()  # may save and stop here for a resize: the step above is kept
            time.sleep(a.step_time if grown else max(a.step_time, 0.4))

    if a.live:
        state.run(train, reshard=shard)
    else:
        state.restore()
        train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
