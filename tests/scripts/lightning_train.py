"""A Lightning DDP script as torchrun users write it, for the adapter's tests.

Logs, per batch and rank, the sample indices it trains on to ``$RESULT_DIR/w<pid>.jsonl``
(the rows ``agents.samples_once`` reads), in ``training_step``, before the gradients'
all-reduce: a rank killed after it, whose samples the others commit, has logged them;
rank 0 saves the
final model and optimizer state to ``$RESULT_DIR/final.pt``. ``--adapter`` adds
``ElasticLightning``; ``--live`` fits through its ``run()`` (a new Trainer in the same
process after each membership change); ``--strategy model_parallel`` shards the model
with FSDP2 (Lightning's ModelParallelStrategy, which runs on CPU), ``--strategy fsdp``
with FSDP1 (Lightning's FSDPStrategy: on CPU ``CPUFSDP``, below).
``--device cuda`` trains on the GPU (``--backend gloo``: two nodes on one GPU).
``--kill-rank/--kill-step`` make that rank SIGKILL itself at the end of that step, on the
first attempt only. ``--dump-start`` saves the whole state a resumed fit starts from;
``--module-once`` makes a sharded model's module once, before ``run()``.
Lightning's own ModelCheckpoint writes every ``--checkpoint-every`` steps to
``$RESULT_DIR/ckpt`` and the script resumes from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from elastic_train import Indexed  # the same data as the hand-written loop
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.utils.data import DataLoader


class CPUFSDP(FSDPStrategy):
    """Lightning's FSDPStrategy on the CPU. FSDP1 runs on gloo given the CPU as its
    device, but Lightning refuses its own class without a GPU, and wraps the model for
    the device's index, which the CPU has none of: so on the CPU the layers are wrapped
    in ``configure_model`` (Lightning keeps a wrapping it finds), and this subclass gets
    past the refusal. Everything else is Lightning's FSDPStrategy as it is. Its own
    checkpoints are sharded (``state_dict_type="sharded"``, DCP directories): FSDP1's
    full state dict, gathered to rank 0 and offloaded to the CPU it is already on,
    crashes the process in torch 2.13 (SIGSEGV in its clone)."""


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.record: Callable[[int, list[int], float], None] | None = None

    def configure_model(self) -> None:  # ModelParallelStrategy (FSDP2), CPUFSDP (FSDP1)
        if self.device_mesh is not None:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        if isinstance(self.trainer.strategy, CPUFSDP) and not isinstance(
            self.net, FullyShardedDataParallel
        ):
            cpu = torch.device("cpu")
            self.net = FullyShardedDataParallel(self.net, device_id=cpu, use_orig_params=True)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        idx, x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.record is not None:
            self.record(batch_idx, idx.tolist(), float(loss.detach()))
        return {"loss": loss}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)]


class Record(Callback):
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115
        self.first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
        self.trainer = trainer
        module.record = self.write  # this Trainer's: a live round makes a new one
        if self.a.dump_start and trainer.global_step > 0:
            self.dump(trainer, module)

    def dump(self, trainer: L.Trainer, module: Any) -> None:
        """The whole state a resumed Trainer starts from, gathered to rank 0's file
        ``start-<step>.pt`` (a test compares it with the snapshot of that step)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(module, trainer.optimizers, options=full)
        if trainer.global_rank == 0:
            name = f"start-{trainer.global_step}.pt"
            torch.save({"model": msd, "optim": osd}, os.path.join(os.environ["RESULT_DIR"], name))

    def write(self, batch: int, indices: list[int], loss: float) -> None:
        trainer = self.trainer
        row = {
            "t": time.time(),
            "pid": os.getpid(),
            "epoch": trainer.current_epoch,
            "step": trainer.global_step + 1,  # the optimizer step this batch is for
            "batch": batch,
            "rank": trainer.global_rank,
            "world": trainer.world_size,
            "port": int(os.environ["MASTER_PORT"]),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "indices": indices,
            "loss": loss,
        }
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        a = self.a
        if (
            self.first_attempt
            and trainer.global_rank == a.kill_rank
            and trainer.global_step == a.kill_step
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        # a join lands while this trains; until the test says it did
        if not os.path.exists(os.path.join(os.environ["RESULT_DIR"], "full-speed")):
            slow = trainer.world_size < a.slow_below_world
            time.sleep(0.4 if slow else a.step_time)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--step-time", type=float, default=0.0, help="until $RESULT_DIR/full-speed exists"
    )
    ap.add_argument(
        "--slow-below-world",
        type=int,
        default=0,
        help="0.4 s steps below it, until $RESULT_DIR/full-speed exists",
    )
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    ap.add_argument("--dump-start", action="store_true", help="save a resumed fit's state")
    ap.add_argument("--module-once", action="store_true", help="sharded: one module for all fits")
    ap.add_argument("--adapter", action="store_true")
    ap.add_argument("--live", action="store_true", help="the adapter's run(): workers kept")
    ap.add_argument("--strategy", choices=["ddp", "fsdp", "model_parallel"], default="ddp")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backend", help="the process group's (default: Lightning's choice)")
    a = ap.parse_args()
    # the snapshot interval elastic.State picks, with its time (benchmarks/frameworks.py)
    logging.basicConfig(format="%(created).3f %(name)s: %(message)s")
    logging.getLogger("elastic.state").setLevel(logging.INFO)
    L.seed_everything(0, verbose=False)
    result = os.environ["RESULT_DIR"]
    callbacks: list[Callback] = [
        Record(a),
        ModelCheckpoint(
            os.path.join(result, "ckpt"), every_n_train_steps=a.checkpoint_every, save_last=True
        ),
    ]
    elastic: Any = None
    if a.adapter or a.live:
        from elastic.integrations.lightning import ElasticLightning

        elastic = ElasticLightning()
        callbacks.append(elastic)
    # a sharded model is cut over each round's group: under run() it is made in fit()
    # (--module-once: before run(), as for DDP; a change then gives new workers)
    module = Net() if a.strategy == "ddp" or a.module_once else None
    loader = DataLoader(Indexed(a.samples), batch_size=a.batch_size, shuffle=True)
    last = os.path.join(result, "ckpt", "last.ckpt")

    def strategy() -> Any:
        if a.strategy == "fsdp":
            return FSDPStrategy() if a.device == "cuda" else CPUFSDP(state_dict_type="sharded")
        if a.strategy == "model_parallel":
            return ModelParallelStrategy()
        return DDPStrategy(process_group_backend=a.backend) if a.backend else "ddp"

    def fit() -> L.Trainer:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        model = module if module is not None else Net()
        trainer = L.Trainer(
            accelerator="gpu" if a.device == "cuda" else "cpu",
            strategy=strategy(),
            devices=local,
            num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local,  # this round's
            max_epochs=a.epochs,
            accumulate_grad_batches=a.accumulate,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
        )
        trainer.fit(model, loader, ckpt_path=last if os.path.exists(last) else None)
        return trainer

    trainer = elastic.run(fit, backend=a.backend) if a.live else fit()
    # the model as of the end (FSDP1's would be gathered: a collective, not rank 0's alone)
    if trainer.global_rank == 0 and module is not None and a.strategy != "fsdp":
        opt = trainer.optimizers[0]
        final = {
            "model": module.state_dict(),
            "optimizer": opt.state_dict(),
            "step": trainer.global_step,
        }
        torch.save(final, os.path.join(result, "final.pt"))


if __name__ == "__main__":
    main()
