"""An accelerate script as torchrun users write it, for the helper's tests.

Logs, per optimizer step and rank, the sample indices it trained on to
``$RESULT_DIR/w<pid>.jsonl`` (the rows ``agents.samples_once`` reads). Model, optimizer
and loader go through ``accelerator.prepare``; ``elastic.State`` keeps them and
``ElasticLoader`` the loader's place. ``--accumulate`` batches per optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from elastic_train import Indexed  # the same data as the hand-written loop
from torch import nn
from torch.utils.data import DataLoader

import elastic
from elastic.integrations.accelerate import ElasticLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--step-time", type=float, default=0.0)
    a = ap.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=a.accumulate)
    set_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    loader = DataLoader(Indexed(a.samples), batch_size=a.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    data = ElasticLoader(loader)
    state = elastic.State(model=model, optimizer=optimizer, data=data, epoch=0)
    state.restore()
    out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115
    seen: list[int] = []
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        for idx, x, y in data.epoch(epoch):
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            seen += idx.tolist()
            if accelerator.sync_gradients:  # logged first: a kill before the commit redoes it
                row = {
                    "t": time.time(),
                    "epoch": epoch,
                    "step": state.step + 1,
                    "rank": accelerator.process_index,
                    "world": accelerator.num_processes,
                    "port": int(os.environ.get("MASTER_PORT", 0)),
                    "indices": seen,
                }
                out.write(json.dumps(row) + "\n")
                out.flush()
                seen = []
                state.commit(loss.item())
                time.sleep(a.step_time)
    state.close()


if __name__ == "__main__":
    main()
