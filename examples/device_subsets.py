"""Training on a subset of the machine's GPUs: two jobs side by side on disjoint sets.

    elastic-run --devices 0,1 --rdzv-id job-a --metrics-port 9400 examples/device_subsets.py &
    elastic-run --devices 2,3 --rdzv-id job-b --metrics-port 9401 examples/device_subsets.py &

``--devices`` gives each job's workers only the chosen GPUs (through
CUDA_VISIBLE_DEVICES), one worker per device by default, and local rank i uses the i-th
of them, so the script simply uses ``cuda:LOCAL_RANK``: job-a's ranks land on GPUs 0 and
1, job-b's on 2 and 3, and neither can touch the other's. A device that does not exist
is refused before anything starts. (Without elastic-run: ``CUDA_VISIBLE_DEVICES=2,3
torchrun --nproc-per-node 2 ...`` does the same.) On CPU the script trains on the CPU.
"""

from __future__ import annotations

import argparse
import os

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
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--samples", type=int, default=2048)
    a = ap.parse_args()
    device = init_distributed()
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = f"GPUs {chosen}" if chosen else "every GPU of the machine"
    if not torch.cuda.is_available():
        visible = "no GPU"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"rank {dist.get_rank()} (local {os.environ['LOCAL_RANK']}): {device} = {name}; "
        f"this job sees {visible}",
        flush=True,
    )
    torch.manual_seed(0)
    model = DDP(
        nn.Linear(32, 1).to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = synthetic(a.samples)
    sampler = elastic.ElasticSampler(data, batch_size=64, seed=0)
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
    state.restore()
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.commit(loss=loss.item())
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
