"""HSDP (two replica groups of two shards, four processes over gloo) loses a replica
group: the two survivors re-form as one replica group of two and rebuild the state from
their own shards, sending nothing (for tests/test_reshard.py). Prints JSON lines."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic.worker import comm, reshard


def shard(seed: int, replicas: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (replicas, 2), mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=0.01)}


def full(objects: dict[str, Any]) -> list[float]:
    model, opt = objects["model"], objects["opt"]
    params = list(model.parameters())
    sums = [float(p.detach().full_tensor().double().sum()) for p in params]
    return sums + [
        float(v.full_tensor().double().sum())
        for p in params
        for k, v in opt.state[p].items()
        if k != "step"
    ]


def worker(i: int, d: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{d}/a", rank=i, world_size=4)
    objects, values = shard(0, 2), {"step": 0}
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + i)
        objects["model"](torch.randn(4, 5, generator=g)).pow(2).mean().backward()
        objects["opt"].step()
        objects["opt"].zero_grad()
        values["step"] += 1
    before = full(objects)
    dist.destroy_process_group()
    comm.control().forget()
    if i >= 2:
        return  # the second replica group is lost
    held = reshard.capture(objects, values, values["step"])
    dist.init_process_group("gloo", init_method=f"file://{d}/b", rank=i, world_size=2)
    reshard.forget_old_meshes()
    objects, values = shard(5, 1), {"step": 0}
    out = reshard.exchange(objects, values, held, -1)
    said = {"process": i, "source": out.source, "step": values["step"], "sent": out.sent}
    os.write(1, (json.dumps({**said, "same": full(objects) == before}) + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(worker, args=(d,), nprocs=4, start_method="forkserver")
