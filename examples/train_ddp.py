"""DistributedDataParallel training, launched by elastic-run (or torchrun).

    elastic-run --nproc-per-node 2 examples/train_ddp.py --epochs 3

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher;
``init_process_group`` reads them. On GPUs each worker uses the device of its local
rank with NCCL; on CPU it uses gloo. The data is a fixed synthetic regression problem,
so the example needs no downloads.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(n: int = 4096, features: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def setup() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    a = ap.parse_args()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    data = make_dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler)
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        started, total, batches = time.time(), 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, batches = total + loss.item(), batches + 1
        if rank == 0:
            print(f"epoch {epoch}: loss {total / batches:.4f} "
                  f"({time.time() - started:.2f}s, world size {world})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
