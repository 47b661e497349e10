"""Three processes re-shard FSDP2 state in memory through a join and a loss (for
tests/test_reshard.py), each phase a new gloo group as a re-formation makes one.

Phase A, world 2 (processes 0, 1): two steps, a snapshot (``reshard.keep``), a third
step. Phase B, world 3 (process 2 joins): the state of step 3 is re-sharded from the
survivors' live shards; a step, a snapshot, a step. Phase C, world 2: process 0 (rank 0)
is gone; processes 1 and 2 (now ranks 0 and 1) cannot rebuild step 5 (rank 0's rows went
with it) and rebuild step 4 from their snapshots and the copy of rank 0's rows its buddy
kept; then a DCP save and load over the new group. Each process prints JSON lines.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from elastic.worker import comm, reshard, sharded


def shard(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)  # a different seed each time: the state must come from peers
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=0.01)}


def full(objects: dict[str, Any]) -> list[float]:
    """Sums of every full parameter and optimizer state (all-gathers: every rank)."""
    model, opt = objects["model"], objects["opt"]
    sums = [float(p.full_tensor().double().sum()) for p in model.parameters()]
    for p in model.parameters():
        sums += [
            float(v.full_tensor().double().sum()) for k, v in opt.state[p].items() if k != "step"
        ]
        sums.append(float(opt.state[p]["step"]))
    return sums


def train(objects: dict[str, Any], values: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(100 * values["step"] + dist.get_rank())
    objects["model"](torch.randn(4, 5, generator=g)).pow(2).mean().backward()
    objects["opt"].step()
    objects["opt"].zero_grad()
    values["step"] += 1


def group(d: str, phase: str, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{d}/{phase}", rank=rank, world_size=world)


def leave() -> None:
    dist.destroy_process_group()
    comm.control().forget()


def worker(i: int, d: str) -> None:
    def say(**kw: Any) -> None:
        os.write(1, (json.dumps({"process": i, **kw}) + "\n").encode())  # one write: whole lines

    held: reshard.Held | None = None
    kept: reshard.Held | None = None
    values: dict[str, Any] = {"step": 0}
    if i < 2:
        group(d, "a", i, 2)
        objects = shard(0)
        train(objects, values)
        train(objects, values)
        kept = reshard.keep(objects, values, values["step"], 1)
        train(objects, values)
        say(phase="a", step=values["step"], full=full(objects))
        leave()
        held = reshard.capture(objects, values, values["step"]) + kept
    group(d, "b", i, 3)
    reshard.forget_old_meshes()
    objects = shard(1 + i)
    values = {"step": 0}
    out = reshard.exchange(objects, values, held, -1)
    say(phase="b", source=out.source, step=values["step"], sent=out.sent, full=full(objects))
    train(objects, values)
    at4 = full(objects)
    kept = reshard.keep(objects, values, values["step"], 1)
    train(objects, values)
    say(phase="b4", step=4, full=at4)
    leave()
    if i == 0:
        return  # this one is lost
    held = reshard.capture(objects, values, values["step"])
    group(d, "c", i - 1, 2)
    reshard.forget_old_meshes()
    objects = shard(10 + i)
    values = {"step": 0}
    lost = reshard.exchange(objects, values, held, -1)
    say(phase="c-live", source=lost.source, reason=lost.reason)
    out = reshard.exchange(objects, values, held + kept, -1)
    say(phase="c", source=out.source, step=values["step"], reason=out.reason, full=full(objects))
    sharded.save(Path(d) / "dcp", values["step"], objects, values, keep=1)
    again = shard(20 + i)
    loaded = sharded.load(Path(d) / "dcp", values["step"], again, {"step": 0})
    say(phase="dcp", step=loaded["step"], full=full(again))
    leave()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            worker, args=(d,), nprocs=3, start_method=sys.argv[1] if len(sys.argv) > 1 else "spawn"
        )
