"""Training on one chosen device.

    python examples/single_device.py --device cuda:1      # or cpu; defaults to cuda:0 or cpu
    elastic-run examples/single_device.py --device cuda:1 # the same, restarted if it fails

Everything that takes part in a step must be on the same device: the model (``.to``
moves its parameters), and every batch (moved as it arrives). Nothing else changes. The
State makes it resumable: under elastic-run a crash resumes from the last snapshot.
"""

from __future__ import annotations

import argparse

import torch
from _common import gpu, synthetic
from torch import nn
from torch.utils.data import DataLoader

import elastic


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:1 ... (default: cuda:0 if there is a GPU, else cpu)",
    )
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4096)
    a = ap.parse_args()
    device = torch.device(a.device) if a.device else gpu(0)
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index >= torch.cuda.device_count()
    ):
        raise SystemExit(f"{device} does not exist here ({torch.cuda.device_count()} GPUs)")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = synthetic(a.samples)
    sampler = elastic.ElasticSampler(data, batch_size=64, seed=0)
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
    state.restore()
    for epoch in range(state.epoch, a.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        last = float("nan")  # stays nan if a resume found this epoch done
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = loss.item()
            state.commit(loss=last)
        print(f"epoch {epoch} on {device}: loss {last:.4f}", flush=True)
    state.close()


if __name__ == "__main__":
    main()
