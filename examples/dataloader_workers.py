"""DataLoader workers: load the next batches in parallel with training.

    elastic-run tune-workers examples/dataloader_workers.py:make_dataset --batch-size 64
    elastic-run --nproc-per-node 2 examples/dataloader_workers.py --num-workers 2

``num_workers=0`` loads every batch in the training process, between steps. With N > 0
the DataLoader forks N processes that prepare batches ahead (``prefetch_factor`` each),
so slow loading (decoding, augmentation) overlaps with the step. Too many workers steal
cores and memory from training (and under elastic-run, from the other local ranks): with
P training processes on C cores, keep P x (1 + num_workers) near C. Measure rather than
guess: ``elastic-run tune-workers`` times your dataset at 0, 1, 2, 4... workers and
recommends the smallest count within 5% of the fastest.

This dataset makes each sample cost real CPU (a small "augmentation"), so the effect of
workers is visible.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _common import init_distributed
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import elastic


class Augmented(Dataset):
    """Random images, made to cost CPU per sample like real decoding and augmentation."""

    def __init__(self, n: int = 2048) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        img = torch.rand(3, 64, 64, generator=g)
        for _ in range(4):  # the "augmentation"
            img = torch.nn.functional.avg_pool2d(img[None], 3, 1, 1)[0].flip(-1)
        return img, torch.tensor([img.mean()])


def make_dataset() -> Dataset:
    """What `elastic-run tune-workers examples/dataloader_workers.py:make_dataset` times."""
    return Augmented()


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--samples", type=int, default=2048)
    a = ap.parse_args()
    device = init_distributed()
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 1)).to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = Augmented(a.samples)
    sampler = elastic.ElasticSampler(data, batch_size=32, seed=0)
    loader = DataLoader(
        data,
        batch_sampler=sampler,
        num_workers=a.num_workers,
        persistent_workers=a.num_workers > 0,
        generator=torch.Generator(),
        pin_memory=device.type == "cuda",
    )
    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
    state.restore()
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.commit(loss=loss.item())
        if dist.get_rank() == 0:
            print(
                f"epoch {epoch}: {time.perf_counter() - started:.2f}s with "
                f"num_workers={a.num_workers}",
                flush=True,
            )
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
