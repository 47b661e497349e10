"""A Hugging Face Trainer script as torchrun users write it, for the adapter's tests.

Logs, per optimizer step and rank, the sample indices it trained on to
``$RESULT_DIR/w<pid>.jsonl`` (the rows ``agents.samples_once`` reads); rank 0 saves the
final model and optimizer state to ``$RESULT_DIR/final.pt``. ``--adapter`` attaches
``ElasticCallback``; ``--kill-rank/--kill-step`` make that rank SIGKILL itself at the end
of that step, on the first attempt only. The Trainer's own checkpoints go to
``$RESULT_DIR/out`` every ``--checkpoint-every`` steps and the script resumes from the
last one, as such scripts do.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import time
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
        self.seen: list[int] = []  # the indices of the optimizer step being trained
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        loss = nn.functional.mse_loss(self.net(x), labels)
        if self.training:
            self.seen += idx.tolist()
            self.losses.append(float(loss.detach()))
        return {"loss": loss}


class Record(TrainerCallback):
    def __init__(self, a: argparse.Namespace, net: Net) -> None:
        self.a, self.net = a, net
        self.out = open(os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a")  # noqa: SIM115
        self.first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        # a live round's new Trainer: the step a lost peer cut short is rolled back, and
        # so are the samples its forward saw (kept, they would be logged twice)
        self.net.seen, self.net.losses = [], []

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        row = {
            "t": time.time(),
            "pid": os.getpid(),
            "epoch": math.ceil(state.epoch) - 1,
            "step": state.global_step,
            "rank": args.process_index,
            "world": args.world_size,
            "port": int(os.environ.get("MASTER_PORT", 0)),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "indices": self.net.seen,
            "loss": sum(self.net.losses),
        }
        self.net.seen, self.net.losses = [], []
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
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
    a = ap.parse_args()
    # the snapshot interval elastic.State picks, with its time (benchmarks/frameworks.py)
    logging.basicConfig(format="%(created).3f %(name)s: %(message)s")
    logging.getLogger("elastic.state").setLevel(logging.INFO)
    result = os.environ["RESULT_DIR"]
    out = os.path.join(result, "out")
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
            use_cpu=True,
            ddp_backend="gloo",
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

        ElasticCallback.run(made, resume_from_checkpoint=last)
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
