"""DistributedDataParallel training that survives restarts and resizes.

    elastic-run --nproc-per-node 2 examples/train_ddp.py --epochs 3

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher;
``init_process_group`` reads them. On GPUs each worker uses the device of its local rank
with NCCL; on CPU it uses gloo. The data is a fixed synthetic regression problem, so the
example needs no downloads.

What makes it elastic is four lines: an ElasticSampler (every sample once per epoch,
whatever happens to the world size), a State holding everything that changes,
``state.restore()`` before the loop and ``state.commit()`` after each optimizer step.
Kill a worker or a node, or add one, and training goes on from the newest snapshot.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _common import init_distributed, synthetic
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import elastic


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="sleep after each step, to watch resizes happen",
    )
    a = ap.parse_args()
    device = init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    data = synthetic()
    sampler = elastic.ElasticSampler(data, batch_size=a.batch_size, shuffle=True, seed=0)
    # its own generator: building an iterator must not draw from the RNG State restores
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
    if state.restore() and rank == 0:
        print(f"resumed at epoch {state.epoch}, step {state.step}", flush=True)
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        started, total, batches = time.time(), 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.commit(loss=loss.item())  # the loss is optional: for the metrics
            total, batches = total + loss.item(), batches + 1
            time.sleep(a.step_time)
        if rank == 0:
            print(
                f"epoch {epoch}: loss {total / max(batches, 1):.4f} "
                f"({time.time() - started:.2f}s, world size {dist.get_world_size()})",
                flush=True,
            )
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
