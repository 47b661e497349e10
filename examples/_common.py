"""Small helpers the examples share: synthetic data and device choice. Not an API."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset


def synthetic(n: int = 4096, features: int = 32, seed: int = 0) -> TensorDataset:
    """A fixed regression problem: y = x @ w + noise. No downloads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def gpu(index: int) -> torch.device:
    """GPU ``index`` if there is one, else the CPU (examples run anywhere)."""
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed() -> torch.device:
    """Join the process group the launcher set up; the device of this local rank."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = gpu(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device
