"""DataParallel versus DistributedDataParallel: the same model, two ways to use many GPUs.

    python examples/dp_vs_ddp.py --mode dp                       # one process, all GPUs
    elastic-run --nproc-per-node 2 examples/dp_vs_ddp.py --mode ddp  # a process per GPU

DataParallel (one process): every step it copies the model to each GPU, splits the batch,
runs the replicas in threads (under one GIL), gathers the outputs on GPU 0 and reduces
the gradients there. Simple, but GPU 0 does extra work and the copies and the GIL limit
it; it cannot span machines.

DistributedDataParallel (a process per GPU, started by elastic-run or torchrun): each
process keeps its own replica and its own share of the data (the sampler), and the
gradients are averaged with an all-reduce that overlaps the backward pass. It scales
across machines, and with elastic-run it survives losing and gaining them. Prefer it.

On a machine without GPUs both modes run on the CPU (DataParallel then just calls the
module), so the example runs anywhere.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _common import gpu, init_distributed, synthetic
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import elastic


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["dp", "ddp"], required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=128, help="per process")
    a = ap.parse_args()
    if a.mode == "dp":
        device = gpu(0)
        model = nn.DataParallel(net().to(device))  # replicas on every visible GPU
        rank, world = 0, 1
    else:
        device = init_distributed()
        model = DDP(net().to(device), device_ids=[device.index] if device.type == "cuda" else None)
        rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = synthetic(a.samples)
    # DP splits each batch over its GPUs itself; DDP gives each process its own share
    sampler = elastic.ElasticSampler(data, batch_size=a.batch_size, seed=0)
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
    state.restore()
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        last = float("nan")  # stays nan if a resume found this epoch done
        started = time.perf_counter()
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = loss.item()
            state.commit(loss=last)
        if rank == 0:
            print(
                f"{a.mode} epoch {epoch}: loss {last:.4f}, "
                f"{time.perf_counter() - started:.2f}s, {world} process(es)",
                flush=True,
            )
    state.close()
    if a.mode == "ddp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
