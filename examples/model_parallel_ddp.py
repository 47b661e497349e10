"""Model and data parallelism together: DDP over a model split across two devices.

    elastic-run --nproc-per-node 2 examples/model_parallel_ddp.py   # 4 GPUs: 2 per process

Each process owns two devices (local rank r: 2r and 2r+1) and holds the whole model split
across them, as in model_parallel.py. DistributedDataParallel then replicates that split
model across processes and nodes: with a multi-device module, give DDP no device_ids,
and it averages gradients on whichever device each parameter lives. On CPU both stages
share the CPU, so the example runs anywhere.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from _common import gpu, synthetic
from model_parallel import TwoStage
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import elastic


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--step-time", type=float, default=0.0)
    a = ap.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    first, second = gpu(2 * local_rank), gpu(2 * local_rank + 1)
    dist.init_process_group("nccl" if first.type == "cuda" else "gloo")
    torch.manual_seed(0)
    model = DDP(TwoStage(first, second))  # no device_ids: the module spans devices
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = synthetic(a.samples)
    sampler = elastic.ElasticSampler(data, batch_size=64, seed=0)
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
    if state.restore() and dist.get_rank() == 0:
        print(f"resumed at epoch {state.epoch}, step {state.step}", flush=True)
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        last = float("nan")  # stays nan if a resume found this epoch done
        for x, y in loader:
            out = model(x)
            loss = nn.functional.mse_loss(out, y.to(out.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = loss.item()
            state.commit(loss=last)
            time.sleep(a.step_time)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {last:.4f}, world size {dist.get_world_size()}", flush=True)
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
