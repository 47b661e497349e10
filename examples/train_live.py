"""DistributedDataParallel training whose workers keep their processes through every
membership change: ``State.run``.

    elastic-run --nproc-per-node 2 examples/train_live.py --epochs 3

The loop lives in a function handed to ``state.run``. When a node is lost, frozen, leaves
or joins, the survivors leave the broken process group, form the new one in the same
process (no new python, no ``import torch``, no CUDA context, no reload) and call the
function again with every rank holding the newest committed state; the ElasticSampler
splits what remains of the epoch over the new world size. Two rules follow:

- DDP holds the process group, so it is built inside the function, once per round;
  ``State`` gets the plain module.
- Anything about the round (rank, world size) is read inside the function too: after a
  re-formation this process may have another rank: ``state.round.rank``, read inside
  the function (a ``rank`` kept from before ``state.run`` goes stale when rank 0's node
  goes, and whatever only rank 0 does, printing, saving, stops with it).

Kill a node (``kill -9`` its agent): the agents left log ``workers re-form live``, and
rank 0 prints ``training from step N`` from the same process.
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
        "--step-time", type=float, default=0.0, help="sleep after each step, to watch changes"
    )
    a = ap.parse_args()
    device = init_distributed()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=a.lr)
    data = synthetic()
    sampler = elastic.ElasticSampler(data, batch_size=a.batch_size, shuffle=True, seed=0)
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(model=net, optimizer=opt, sampler=sampler, epoch=0)

    def train() -> None:
        # built here, once per round: DDP holds the process group a re-formation replaces
        model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
        rank, world = state.round.rank, state.round.world_size  # this round's
        if state.step and rank == 0:
            print(f"training from step {state.step} at world size {world}", flush=True)
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
                state.commit(loss=loss.item())
                total, batches = total + loss.item(), batches + 1
                time.sleep(a.step_time)
            if rank == 0:
                print(
                    f"epoch {epoch}: loss {total / max(batches, 1):.4f} "
                    f"({time.time() - started:.2f}s, world size {world})",
                    flush=True,
                )

    state.run(train)  # restores, trains; again, in this process, after each change
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
