"""DDP training with elastic.State, for the checkpoint/resume tests.

Logs, per optimizer step and rank, which sample indices it trained on, to
``$RESULT_DIR/w<pid>.jsonl``, so a test can check every sample is used exactly once per
epoch and the step counter never goes back further than allowed. Rank 0 saves the final
model and optimizer state to ``$RESULT_DIR/final.pt`` for bitwise comparisons.
``--kill-rank/--kill-step`` make that rank SIGKILL itself after committing the step, on
the first attempt only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import elastic


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=0)
    ap.add_argument(
        "--step-time", type=float, default=0.0, help="until $RESULT_DIR/full-speed exists"
    )
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    policy = elastic.BatchPolicy(micro_batch=a.micro_batch, global_batch=a.global_batch or None)
    data = Indexed(a.samples)
    sampler = elastic.ElasticSampler(data, policy, shuffle=True, seed=3)
    # its own generator: creating an iterator must not draw from the RNG that State restores
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(model=model, optimizer=opt, scheduler=sched, sampler=sampler, epoch=0)
    state.restore()
    out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115
    full_speed = os.path.join(os.environ["RESULT_DIR"], "full-speed")
    first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        accumulation = sampler.accumulation
        seen: list[int] = []
        for i, (idx, x, y) in enumerate(loader):
            last = (i + 1) % accumulation == 0
            seen += idx.tolist()
            if last:  # the reduction below takes these samples into every rank's step, even
                # if this rank fails before its row (a peer lost as the reduction ends)
                out.write(json.dumps({"tried": True, "epoch": epoch, "step": state.step + 1,
                                      "rank": rank, "port": int(os.environ["MASTER_PORT"]),
                                      "t": time.time(), "indices": seen}) + "\n")  # fmt: skip
                out.flush()
            with nullcontext() if last else model.no_sync():
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
            if not last:
                continue
            opt.step()
            opt.zero_grad()
            sched.step()
            out.write(
                json.dumps(
                    {
                        "t": time.time(),
                        "pid": os.getpid(),
                        "epoch": epoch,
                        "step": state.step + 1,
                        "rank": rank,
                        "world": world,
                        "port": int(os.environ["MASTER_PORT"]),
                        "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                        "indices": seen,
                    }
                )
                + "\n"
            )
            out.flush()
            seen = []
            state.commit()
            if first_attempt and rank == a.kill_rank and state.step == a.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if not os.path.exists(full_speed):  # the test saw what it waited for
                time.sleep(a.step_time)
    state.close()
    if rank == 0:
        torch.save(
            {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": state.step},
            os.path.join(os.environ["RESULT_DIR"], "final.pt"),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
