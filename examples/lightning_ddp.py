"""PyTorch Lightning with DDP, resumed from elastic-run's in-memory snapshots.

    pip install -e '.[lightning]'
    elastic-run --nproc-per-node 2 examples/lightning_ddp.py --epochs 3

A Lightning script as it runs under torchrun (a LightningModule, a DataLoader, its own
ModelCheckpoint), plus one callback: ``ElasticLightning()``. With it a node lost or a
worker failure costs the steps since the last snapshot (the policy picks the interval
from what a snapshot and a step cost), not the steps since the last checkpoint file, and
the epoch goes on at the exact sample, whatever the new world size. Without elastic-run
the callback does nothing. ``--no-elastic`` leaves it out (the same script, unchanged).

``--live`` also keeps the workers through membership changes: the Trainer is made in a
function, ``fit()``, that ``ElasticLightning.run`` calls again in the same process after
each change (Lightning's DDP holds the process group, so each round needs a Trainer of
its own); the new one resumes from the newest snapshot, with no new python and no
``import lightning``.

``--fsdp2`` shards the model instead (Lightning's ``ModelParallelStrategy``, which runs
on CPU too): give elastic-run a ``--checkpoint-dir`` every node reads, and the callback
snapshots the shards there (DCP checkpoints, at the interval the policy picks) and a
restart resumes from the newest, re-sharded over the new world size::

    elastic-run --nproc-per-node 2 --checkpoint-dir /tmp/ckpt examples/lightning_ddp.py --fsdp2

With ``--live`` too, the workers are kept through changes as with DDP: each snapshot also
copies the shards to host memory and to the next node, and the next Trainer re-shards
the newest step memory holds whole over the new group (the disk is read only where it
does not). A sharded model is cut over each round's group, so ``fit()`` makes the
LightningModule as well as the Trainer.
"""

from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch
from _common import synthetic
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from elastic.integrations.lightning import ElasticLightning


class Regression(L.LightningModule):
    def __init__(self, lr: float, step_time: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.lr, self.step_time = lr, step_time

    def configure_model(self) -> None:  # --fsdp2 (ModelParallelStrategy) only
        if self.device_mesh is not None:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.step_time:
            time.sleep(self.step_time)
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.global_rank == 0:  # one line per step, for the tests and the curious
            loss = float(outputs["loss"])  # type: ignore[index]
            print(f"step {self.global_step} epoch {self.current_epoch} loss {loss:.6f}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--step-time", type=float, default=0.0, help="sleep in each step")
    ap.add_argument("--checkpoint-every", type=int, default=20, help="Lightning's own, in steps")
    ap.add_argument("--dir", default="lightning_ckpt", help="Lightning's own checkpoints")
    ap.add_argument("--no-elastic", action="store_true", help="leave the callback out")
    ap.add_argument("--live", action="store_true", help="keep the workers through changes")
    ap.add_argument("--fsdp2", action="store_true", help="shard the model (FSDP2)")
    a = ap.parse_args()
    L.seed_everything(0, verbose=False)
    loader = DataLoader(synthetic(1024), batch_size=a.batch_size, shuffle=True)
    saver = ModelCheckpoint(dirpath=a.dir, every_n_train_steps=a.checkpoint_every, save_last=True)
    elastic = ElasticLightning()
    model = None if a.fsdp2 else Regression(a.lr, a.step_time)
    last = os.path.join(a.dir, "last.ckpt")

    def fit() -> None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        # sharded, the module is cut over this round's group: a new one for each fit
        module = model if model is not None else Regression(a.lr, a.step_time)
        trainer = L.Trainer(
            accelerator="auto",
            strategy=ModelParallelStrategy() if a.fsdp2 else "ddp",
            devices=local,
            num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local,  # this round's
            max_epochs=a.epochs,
            callbacks=[saver] if a.no_elastic else [saver, elastic],
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
        )
        trainer.fit(module, loader, ckpt_path=last if os.path.exists(last) else None)

    if a.live and not a.no_elastic:
        elastic.run(fit)  # a new Trainer in the same process after each change
    else:
        fit()


if __name__ == "__main__":
    main()
