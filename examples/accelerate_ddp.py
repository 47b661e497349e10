"""An ``accelerate`` script, resumed from elastic-run's in-memory snapshots.

    pip install -e '.[accelerate]'
    elastic-run --nproc-per-node 2 examples/accelerate_ddp.py --epochs 3

An accelerate training loop as it runs under torchrun (``Accelerator``, ``prepare``,
``accelerator.backward``, gradient accumulation), where ``elastic.State`` keeps what
``save_state`` would, and ``ElasticLoader`` the prepared loader's place in the epoch. A
node lost or a worker failure costs the steps since the last snapshot, and the epoch goes
on at the exact sample, whatever the new world size. Without elastic-run (plain python,
torchrun) it trains the same, and a restart starts over.

``--live`` also keeps the workers through membership changes: the loop runs in
``State.run``, and each round makes its Accelerator (``round_accelerator``) and prepares
the plain model, optimizer and loader again; the epoch goes on from the last commit.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import synthetic
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader

import elastic
from elastic.integrations.accelerate import ElasticLoader, round_accelerator


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--live", action="store_true", help="keep the workers through changes")
    a = ap.parse_args()
    # on a machine without GPUs accelerate joins the launcher's ranks only when told cpu=True
    cpu = not torch.cuda.is_available()
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=a.accumulate)
    set_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    sgd = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9)
    raw = DataLoader(synthetic(1024), batch_size=a.batch_size, shuffle=True)

    def train(accelerator: Accelerator, model: nn.Module, optimizer: Any, data: Any) -> None:
        for epoch in range(state.epoch, a.epochs):
            state.epoch = epoch
            total, batches = 0.0, 0
            for x, y in data.epoch(epoch):
                with accelerator.accumulate(model):
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                total, batches = total + loss.item(), batches + 1
                if accelerator.sync_gradients:
                    state.commit(loss=loss.item())
            accelerator.print(
                f"epoch {epoch}: loss {total / max(batches, 1):.4f} (step {state.step}, "
                f"{accelerator.num_processes} processes)"
            )

    if a.live:  # State holds the plain objects; each round prepares them again
        data = ElasticLoader(accelerator.prepare(raw))
        state = elastic.State(model=net, optimizer=sgd, data=data, epoch=0)

        def this_round() -> None:
            acc = round_accelerator(cpu=cpu, gradient_accumulation_steps=a.accumulate)
            model, optimizer, loader = acc.prepare(net, sgd, raw)
            data.use(loader)
            if state.step:
                acc.print(f"training from step {state.step}, {acc.num_processes} processes")
            train(acc, model, optimizer, data)

        state.run(this_round)
    else:
        model, optimizer, loader = accelerator.prepare(net, sgd, raw)
        data = ElasticLoader(loader)
        state = elastic.State(model=model, optimizer=optimizer, data=data, epoch=0)
        if state.restore():
            accelerator.print(f"resumed at epoch {state.epoch}, step {state.step}")
        train(accelerator, model, optimizer, data)
    state.close()


if __name__ == "__main__":
    main()
