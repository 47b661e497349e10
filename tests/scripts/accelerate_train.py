"""An accelerate script as torchrun users write it, for the helper's tests and
``benchmarks/frameworks.py``.

Logs, per optimizer step and rank, the sample indices it trained on to
``$RESULT_DIR/w<pid>.jsonl`` (the rows ``agents.samples_once`` reads). Model, optimizer
and loader go through ``accelerator.prepare``. ``--adapter``: ``elastic.State`` keeps
them and ``ElasticLoader`` the loader's place. Without it the script checkpoints as the
accelerate docs show: ``save_state`` every ``--checkpoint-every`` steps to
``$RESULT_DIR/ckpt``, and on start ``load_state`` and ``skip_first_batches``.
``--live`` (with ``--adapter``): the loop runs in ``State.run``, and each round makes its
``Accelerator`` (``round_accelerator``) and prepares the plain objects again.
``--device cuda`` trains on the GPU (``--backend gloo``: two nodes on one GPU).
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
from accelerate.utils import InitProcessGroupKwargs, set_seed
from elastic_train import Indexed  # the same data as the hand-written loop
from torch import nn
from torch.utils.data import DataLoader


class Own:
    """The script's own checkpoints, as the accelerate docs show them."""

    def __init__(self, accelerator: Accelerator, every: int, loader: Any) -> None:
        self.accelerator, self.every, self.loader = accelerator, every, loader
        self.dir = Path(os.environ["RESULT_DIR"]) / "ckpt"
        self.steps, self.epoch, self.skip = 0, 0, 0
        self.first_batch = 0  # the batch the epoch being trained started at

    def restore(self) -> None:
        done = self.dir / "step.json"
        if done.exists():
            self.accelerator.load_state(str(self.dir))
            saved = json.loads(done.read_text())
            self.steps, self.epoch, self.skip = saved["step"], saved["epoch"], saved["batches"]

    def first(self) -> int:
        return self.epoch

    def starts(self, epoch: int) -> None:
        pass

    def batches(self, epoch: int) -> Any:
        self.loader.set_epoch(epoch)
        self.first_batch, self.skip = self.skip, 0
        if self.first_batch:
            return skip_first_batches(self.loader, self.first_batch)
        return self.loader

    def skipped(self) -> int:
        return self.first_batch

    def step(self) -> int:
        return self.steps

    def committed(self, epoch: int, batches: int, loss: float) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.accelerator.wait_for_everyone()
            self.accelerator.save_state(str(self.dir))
            if self.accelerator.is_main_process:
                info = {"step": self.steps, "epoch": epoch, "batches": batches}
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
    ap.add_argument("--live", action="store_true", help="the adapter in State.run")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backend", help="the process group's (default: accelerate's choice)")
    a = ap.parse_args()
    logging.basicConfig(format="%(created).3f %(name)s: %(message)s")
    logging.getLogger("elastic.state").setLevel(logging.INFO)
    made = {
        "cpu": a.device == "cpu",
        "gradient_accumulation_steps": a.accumulate,
        "kwargs_handlers": [InitProcessGroupKwargs(backend=a.backend)] if a.backend else [],
    }
    accelerator = Accelerator(**made)
    set_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    raw = DataLoader(Indexed(a.samples), batch_size=a.batch_size, shuffle=True)
    out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115

    def train(accelerator: Accelerator, model: Any, optimizer: Any, run: Any) -> None:
        """The loop, as the accelerate docs write it; ``run`` is how this script resumes
        and commits (the adapter, or its own checkpoints)."""
        seen: list[int] = []
        for epoch in range(run.first(), a.epochs):
            run.starts(epoch)
            for batch, (idx, x, y) in enumerate(run.batches(epoch), start=run.skipped()):
                with accelerator.accumulate(model):
                    seen += idx.tolist()
                    if accelerator.sync_gradients:
                        # logged before the gradients are shared: once they are, a peer's
                        # optimizer may step with this rank's samples while this rank dies
                        # (a step not completed anywhere is logged again when redone)
                        row = {
                            "t": time.time(),
                            "pid": os.getpid(),
                            "epoch": epoch,
                            "step": run.step() + 1,
                            "rank": accelerator.process_index,
                            "world": accelerator.num_processes,
                            "port": int(os.environ.get("MASTER_PORT", 0)),
                            "indices": seen,
                        }
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        seen = []
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    run.committed(epoch, batch + 1, loss.item())
                    time.sleep(a.step_time)

    if not a.adapter:
        model, opt, loader = accelerator.prepare(net, optimizer, raw)
        own = Own(accelerator, a.checkpoint_every, loader)
        own.restore()
        train(accelerator, model, opt, own)
        return
    import elastic
    from elastic.integrations.accelerate import ElasticLoader, round_accelerator

    if a.live:  # State keeps the plain objects; each round prepares them again
        data = ElasticLoader(accelerator.prepare(raw))
        state = elastic.State(model=net, optimizer=optimizer, data=data, epoch=0)

        def live() -> None:
            acc = round_accelerator(**made)
            model, opt, loader = acc.prepare(net, optimizer, raw)
            data.use(loader)
            train(acc, model, opt, Adapter(state, data))

        state.run(live)
    else:
        model, opt, loader = accelerator.prepare(net, optimizer, raw)
        data = ElasticLoader(loader)
        state = elastic.State(model=model, optimizer=opt, data=data, epoch=0)
        state.restore()
        train(accelerator, model, opt, Adapter(state, data))
    state.close()


class Adapter:
    """Resume and commit through elastic.State and ElasticLoader."""

    def __init__(self, state: Any, data: Any) -> None:
        self.state, self.data = state, data

    def first(self) -> int:
        return int(self.state.epoch)

    def starts(self, epoch: int) -> None:
        self.state.epoch = epoch

    def batches(self, epoch: int) -> Any:
        return self.data.epoch(epoch)

    def skipped(self) -> int:
        return 0

    def step(self) -> int:
        return int(self.state.step)

    def committed(self, epoch: int, batches: int, loss: float) -> None:
        self.state.commit(loss)


if __name__ == "__main__":
    main()
