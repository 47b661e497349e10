"""An accelerate script as torchrun users write it, for the helper's tests and
``benchmarks/frameworks.py``.

Logs, per optimizer step and rank, the sample indices it trained on to
``$RESULT_DIR/w<pid>.jsonl`` (the rows ``agents.samples_once`` reads). Model, optimizer
and loader go through ``accelerator.prepare``. ``--adapter``: ``elastic.State`` keeps
them and ``ElasticLoader`` the loader's place. Without it the script checkpoints as the
accelerate docs show: ``save_state`` every ``--checkpoint-every`` steps to
``$RESULT_DIR/ckpt``, and on start ``load_state`` and ``skip_first_batches``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, skip_first_batches
from accelerate.utils import set_seed
from elastic_train import Indexed  # the same data as the hand-written loop
from torch import nn
from torch.utils.data import DataLoader


class Own:
    """The script's own checkpoints, as the accelerate docs show them."""

    def __init__(self, accelerator: Accelerator, every: int, loader: Any) -> None:
        self.accelerator, self.every, self.loader = accelerator, every, loader
        self.dir = Path(os.environ["RESULT_DIR"]) / "ckpt"
        self.step, self.epoch, self.skip = 0, 0, 0
        self.first = 0  # the batch the epoch being trained started at

    def restore(self) -> None:
        done = self.dir / "step.json"
        if done.exists():
            self.accelerator.load_state(str(self.dir))
            saved = json.loads(done.read_text())
            self.step, self.epoch, self.skip = saved["step"], saved["epoch"], saved["batches"]

    def batches(self, epoch: int) -> Any:
        self.loader.set_epoch(epoch)
        self.first, self.skip = self.skip, 0
        return skip_first_batches(self.loader, self.first) if self.first else self.loader

    def committed(self, epoch: int, batches: int) -> None:
        self.step += 1
        if self.step % self.every == 0:
            self.accelerator.wait_for_everyone()
            self.accelerator.save_state(str(self.dir))
            if self.accelerator.is_main_process:
                info = {"step": self.step, "epoch": epoch, "batches": batches}
                (self.dir / "step.json").write_text(json.dumps(info))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--checkpoint-every", type=int, default=1000, help="without --adapter")
    ap.add_argument("--adapter", action="store_true")
    a = ap.parse_args()
    # the snapshot interval elastic.State picks, with its time (benchmarks/frameworks.py)
    logging.basicConfig(format="%(created).3f %(name)s: %(message)s")
    logging.getLogger("elastic.state").setLevel(logging.INFO)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=a.accumulate)
    set_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    loader = DataLoader(Indexed(a.samples), batch_size=a.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    if a.adapter:
        import elastic
        from elastic.integrations.accelerate import ElasticLoader

        data = ElasticLoader(loader)
        state = elastic.State(model=model, optimizer=optimizer, data=data, epoch=0)
        state.restore()
        first, step, epochs = state.epoch, lambda: state.step, data.epoch
    else:
        own = Own(accelerator, a.checkpoint_every, loader)
        own.restore()
        first, step, epochs = own.epoch, lambda: own.step, own.batches
    out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115
    seen: list[int] = []
    for epoch in range(first, a.epochs):
        if a.adapter:
            state.epoch = epoch
        batches = epochs(epoch)
        for batch, (idx, x, y) in enumerate(batches, start=0 if a.adapter else own.first):
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
                    "step": step() + 1,
                    "rank": accelerator.process_index,
                    "world": accelerator.num_processes,
                    "port": int(os.environ.get("MASTER_PORT", 0)),
                    "indices": seen,
                }
                out.write(json.dumps(row) + "\n")
                out.flush()
                seen = []
                if a.adapter:
                    state.commit(loss.item())
                else:
                    own.committed(epoch, batch + 1)
                time.sleep(a.step_time)
    if a.adapter:
        state.close()


if __name__ == "__main__":
    main()
