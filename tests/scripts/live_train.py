"""DDP training in ``elastic.State.run``, for the live re-formation tests.

Every micro-batch it is about to train on is logged as a JSON line to
``$RESULT_DIR/w<pid>.jsonl`` (``t``, ``pid``, ``epoch``, ``step`` being attempted,
``rank``, ``world``, ``indices``), so a test can check which processes trained at which
world size and that no sample was lost or repeated beyond the steps in flight. The
global batch is fixed, and each micro-batch's loss is divided by the accumulation, so the
model does not depend on the world size: rank 0 saves it to ``$RESULT_DIR/final.pt``
for comparison with an undisturbed run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
from elastic_train import Indexed  # this directory: the same data as the resume tests
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import elastic


def net(width: int = 16, depth: int = 0) -> nn.Module:
    """``depth`` hidden layers of ``width`` x ``width`` between the first and the last:
    a model whose gradients and state take more than a socket's buffer to send."""
    torch.manual_seed(0)
    hidden = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), *hidden, nn.Linear(width, 1))


def learning_rate(width: int = 16) -> float:
    """Adam's, scaled down for a wide model: its training stays smooth, so the rounding
    of a batch split over ranks does not grow (``benchmarks/chaos.py`` compares)."""
    return 0.01 * min(1.0, 16 / width)


def optimizer(model: nn.Module, width: int = 16) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=learning_rate(width))


def undisturbed(
    samples: int, epochs: int, global_batch: int, width: int = 16, depth: int = 0
) -> dict[str, torch.Tensor]:
    """The model after the same steps with no change at all, in the caller's process:
    what every run of this script must end with (the tests and benchmarks/chaos.py)."""
    model = net(width, depth)
    opt = optimizer(model, width)
    data = Indexed(samples)
    for epoch in range(epochs):
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(3 + epoch))
        for start in range(0, samples, global_batch):
            idx = order[start : start + global_batch]
            loss = nn.functional.mse_loss(model(data.x[idx]), data.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.state_dict()


def train(
    a: argparse.Namespace,
    state: elastic.State,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loader: DataLoader,
    out: IO[str],
) -> None:
    ddp = DDP(model)  # on this round's process group
    rank, world = dist.get_rank(), dist.get_world_size()
    full_speed = Path(os.environ["RESULT_DIR"]) / "full-speed"  # no pause: see --step-time
    sampler = state.sampler
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        accumulation = sampler.accumulation
        for i, (idx, x, y) in enumerate(loader):
            row = {"t": time.time(), "pid": os.getpid(), "epoch": epoch, "step": state.step + 1}
            row.update(rank=rank, world=world, indices=idx.tolist())
            out.write(json.dumps(row) + "\n")
            out.flush()
            last = (i + 1) % accumulation == 0
            with nullcontext() if last else ddp.no_sync():
                loss = nn.functional.mse_loss(ddp(x), y) / accumulation
                loss.backward()
            if not last:
                continue
            opt.step()
            opt.zero_grad()
            state.commit()
            # a join in the test lands while this trains; until the test says it did
            if not full_speed.exists():
                slow = world < a.slow_below_world
                time.sleep(max(a.step_time, 0.4) if slow else a.step_time)


class SlowToPack:
    """``--slow-send``: a value of State whose state_dict waits (2 s at most) while
    $RESULT_DIR/slow-send exists, so a rank sending the state in a resync is held there
    (and a test can lose it mid-resync, not after)."""

    def __init__(self, results: Path) -> None:
        self.flag = results / "slow-send"

    def state_dict(self) -> dict:
        deadline = time.monotonic() + 2.0
        while self.flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return {}

    def load_state_dict(self, saved: dict) -> None:
        pass


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument(
        "--step-time", type=float, default=0.1, help="until $RESULT_DIR/full-speed exists"
    )
    ap.add_argument("--width", type=int, default=16, help="see net()")
    ap.add_argument("--depth", type=int, default=0, help="see net()")
    ap.add_argument(
        "--slow-below-world",
        type=int,
        default=0,
        help="0.4 s steps below it, until $RESULT_DIR/full-speed exists",
    )
    ap.add_argument(
        "--linger",
        action="store_true",
        help="after training, write $RESULT_DIR/trained and exit once $RESULT_DIR/release is",
    )
    ap.add_argument("--slow-send", action="store_true", help="see SlowToPack; logs State's")
    ap.add_argument(
        "--slow-build",
        action="store_true",
        help="between building the model and State.run, wait while $RESULT_DIR/building "
        "exists (60 s at most; building.PID says it waits): a model that takes that long",
    )
    ap.add_argument(
        "--rank-lag",
        type=float,
        default=0.0,
        help="local rank r builds r times this many seconds longer: ranks get into "
        "State.run one by one",
    )
    a = ap.parse_args()
    results = Path(os.environ["RESULT_DIR"])
    extra = {"slow": SlowToPack(results)} if a.slow_send else {}
    if a.slow_send:  # State's account of each restore: "receiving step ..."
        logging.basicConfig(format="%(message)s")
        logging.getLogger("elastic").setLevel(logging.INFO)
    dist.init_process_group("gloo")
    model = net(a.width, a.depth)
    opt = optimizer(model, a.width)  # Adam's first param group imports torch._dynamo: 2 s
    # the build's slow part, last: once it ends, the worker is in State.run in moments
    deadline = time.monotonic() + 60
    if a.slow_build and (results / "building").exists():
        (results / f"building.{os.getpid()}").touch()
    while a.slow_build and (results / "building").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(a.rank_lag * int(os.environ["LOCAL_RANK"]))
    policy = elastic.BatchPolicy(micro_batch=a.micro_batch, global_batch=a.global_batch)
    data = Indexed(a.samples)
    sampler = elastic.ElasticSampler(data, policy, shuffle=True, seed=3)
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, **extra)
    with open(results / f"w{os.getpid()}.jsonl", "a") as out:
        state.run(train, a, state, model, opt, loader, out)
    state.close()
    if a.linger:
        (results / "trained").touch()
        deadline = time.monotonic() + 60
        while not (results / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if dist.get_rank() == 0:
        final = {"model": model.state_dict(), "step": state.step}
        torch.save(final, os.path.join(os.environ["RESULT_DIR"], "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
