"""Model parallelism: one model, its layers on two devices.

    python examples/model_parallel.py       # stage 0 on cuda:0, stage 1 on cuda:1
    elastic-run examples/model_parallel.py  # the same, restarted if it fails

When a model does not fit on one device, put parts of it on different devices and move
the activations between them in ``forward``. The loss is computed where the output is,
so the labels go to the output's device. (Here both "devices" are the CPU when fewer
than two GPUs exist: the code is the same.)
"""

from __future__ import annotations

import argparse

import torch
from _common import gpu, synthetic
from torch import nn
from torch.utils.data import DataLoader

import elastic


class TwoStage(nn.Module):
    def __init__(self, first: torch.device, second: torch.device) -> None:
        super().__init__()
        self.first, self.second = first, second
        self.stage0 = nn.Sequential(nn.Linear(32, 512), nn.ReLU()).to(first)
        self.stage1 = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stage0(x.to(self.first))
        return self.stage1(h.to(self.second))  # the activations cross devices here


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4096)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = TwoStage(gpu(0), gpu(1))
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
            out = model(x)
            loss = nn.functional.mse_loss(out, y.to(out.device))  # labels to the output
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = loss.item()
            state.commit(loss=last)
        print(
            f"epoch {epoch}: loss {last:.4f} (stages on {model.first} and {model.second})",
            flush=True,
        )
    state.close()


if __name__ == "__main__":
    main()
