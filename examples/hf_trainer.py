"""The Hugging Face Trainer, resumed from elastic-run's in-memory snapshots.

    pip install -e '.[transformers]'
    elastic-run --nproc-per-node 2 examples/hf_trainer.py --epochs 3

A Trainer script as it runs under torchrun (a small GPT-2 built in code, a dataset, the
Trainer's own checkpoints, resumed from the last one), plus one line:
``ElasticCallback.attach(trainer)``. With it a node lost or a worker failure costs the
steps since the last snapshot (the policy picks the interval from what a snapshot and a
step cost), not the steps since the last checkpoint folder, and the epoch goes on at the
exact sample, whatever the new world size. Without elastic-run it does nothing.
``--no-elastic`` leaves it out (the same script, unchanged).

``--live`` also keeps the workers through membership changes: the Trainer (and its
TrainingArguments) is made in a function that ``ElasticCallback.run`` calls again in the
same process after each change; the new Trainer resumes from the newest snapshot, with
no new python and no ``import transformers``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from elastic.integrations.transformers import ElasticCallback


class Counting(Dataset):
    """Token sequences that count up from a random start: a pattern a tiny model learns."""

    def __init__(self, n: int, length: int = 16, vocab: int = 64) -> None:
        starts = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--checkpoint-every", type=int, default=8, help="the Trainer's own, in steps")
    ap.add_argument("--dir", default="hf_output", help="the Trainer's own checkpoints")
    ap.add_argument("--no-elastic", action="store_true", help="leave the adapter out")
    ap.add_argument("--live", action="store_true", help="keep the workers through changes")
    a = ap.parse_args()
    set_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)

    def make() -> Trainer:
        args = TrainingArguments(  # made per Trainer: they hold the round's world size
            output_dir=a.dir,
            per_device_train_batch_size=a.batch_size,
            num_train_epochs=a.epochs,
            learning_rate=3e-3,
            save_strategy="steps",
            save_steps=a.checkpoint_every,
            logging_steps=1,
            report_to=[],
            seed=0,
            disable_tqdm=True,
            ddp_find_unused_parameters=False,
            use_cpu=not torch.cuda.is_available(),  # the Trainer runs one process per CPU rank else
        )
        return Trainer(model=model, args=args, train_dataset=Counting(a.samples))

    last = get_last_checkpoint(a.dir) if os.path.isdir(a.dir) else None
    if a.live and not a.no_elastic:
        ElasticCallback.run(make, resume_from_checkpoint=last)  # a new Trainer after a change
        return
    trainer = make()
    if not a.no_elastic:
        ElasticCallback.attach(trainer)
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
