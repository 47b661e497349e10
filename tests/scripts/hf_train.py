"""A Hugging Face Trainer script as torchrun users write it, for the adapter's tests.

Logs, per batch and rank, the sample indices it trains on to ``$RESULT_DIR/w<pid>.jsonl``
(the rows ``agents.samples_once`` reads), as its forward sees them: a rank killed after
its step's all-reduce, whose samples the others commit, has logged them (logged at the
step's end, they were missing, though trained on); rank 0 saves the
final model and optimizer state to ``$RESULT_DIR/final.pt``. ``--adapter`` attaches
``ElasticCallback``; ``--device cuda`` trains on the GPU (``--backend gloo``: two nodes
on one GPU); ``--kill-rank/--kill-step`` make that rank SIGKILL itself at the end
of that step, on the first attempt only. The Trainer's own checkpoints go to
``$RESULT_DIR/out`` every ``--checkpoint-every`` steps and the script resumes from the
last one, as such scripts do.
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

import torch
from elastic_train import Indexed  # the same data as the hand-written loop
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint


class Samples(Dataset):
    def __init__(self, n: int) -> None:
        self.data = Indexed(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        idx, x, y = self.data[i]
        return {"idx": idx, "x": x, "labels": y}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.record: Callable[[list[int], float], None] | None = None

    def forward(self, idx: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        loss = nn.functional.mse_loss(self.net(x), labels)
        if self.training and self.record is not None:
            self.record(idx.tolist(), float(loss.detach()))
        return {"loss": loss}


class Record(TrainerCallback):
    def __init__(self, a: argparse.Namespace, net: Net) -> None:
        self.a, self.net = a, net
        self.out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115
        self.first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.epoch, self.substep = 0, 0
        self.state: Any = None
        self.args: Any = None

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        self.state, self.args, self.substep = state, args, 0
        self.net.record = self.write  # this Trainer's: a live round makes a new one

    def on_epoch_begin(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        self.epoch = int(state.epoch)  # a resumed epoch's fraction, or the whole one ended

    def write(self, indices: list[int], loss: float) -> None:
        state, args = self.state, self.args
        row = {
            "t": time.time(),
            "pid": os.getpid(),
            "epoch": self.epoch,
            "step": state.global_step + 1,  # the optimizer step this batch is for
            "batch": state.global_step * args.gradient_accumulation_steps + self.substep,
            "rank": args.process_index,
            "world": args.world_size,
            "port": int(os.environ.get("MASTER_PORT", 0)),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "indices": indices,
            "loss": loss,
        }
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()

    def on_substep_end(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        self.substep += 1

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        self.substep = 0
        a = self.a
        if (
            self.first_attempt
            and args.process_index == a.kill_rank
            and state.global_step == a.kill_step
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(a.step_time)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    ap.add_argument("--adapter", action="store_true")
    ap.add_argument("--live", action="store_true", help="ElasticCallback.run: workers kept")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backend", help="the process group's (default: gloo on CPU, else NCCL)")
    a = ap.parse_args()
    # the snapshot interval elastic.State picks, with its time (benchmarks/frameworks.py)
    logging.basicConfig(format="%(created).3f %(name)s: %(message)s")
    logging.getLogger("elastic.state").setLevel(logging.INFO)
    result = os.environ["RESULT_DIR"]
    out = os.path.join(result, "out")
    backend = a.backend or ("gloo" if a.device == "cpu" else "nccl")
    set_seed(0)  # the model's initial weights too
    net = Net()

    def make() -> Trainer:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=a.batch_size,
            gradient_accumulation_steps=a.accumulate,
            num_train_epochs=a.epochs,
            learning_rate=0.01,
            lr_scheduler_type="linear",
            save_strategy="steps",
            save_steps=a.checkpoint_every,
            logging_steps=1000,
            report_to=[],
            seed=0,
            use_cpu=a.device == "cpu",
            ddp_backend=backend,
            ddp_find_unused_parameters=False,
            disable_tqdm=True,
        )
        trainer = Trainer(model=net, args=args, train_dataset=Samples(a.samples))
        trainer.add_callback(Record(a, net))
        return trainer

    last = get_last_checkpoint(out) if os.path.isdir(out) else None
    if a.live:
        from elastic.integrations.transformers import ElasticCallback

        trainer: Any = None

        def made() -> Trainer:
            nonlocal trainer
            trainer = make()
            return trainer

        ElasticCallback.run(made, resume_from_checkpoint=last, backend=backend)
    else:
        trainer = make()
        if a.adapter:
            from elastic.integrations.transformers import ElasticCallback

            ElasticCallback.attach(trainer)
        trainer.train(resume_from_checkpoint=last)
    if trainer.args.process_index == 0:
        optimizer: Any = trainer.optimizer
        final = {
            "model": net.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": trainer.state.global_step,
        }
        torch.save(final, os.path.join(result, "final.pt"))


if __name__ == "__main__":
    main()
