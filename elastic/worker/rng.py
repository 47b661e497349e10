"""Random number generator states: each rank's own, kept beside the node's snapshot.

Ranks differ in their RNG state (dropout masks, augmentation) though their model state is
the same, so RNG states are not part of the shared snapshot: each rank writes its own
file, and on restore takes it back if it is of the restored step. A rank that has none
(a new node, or new ranks after a resize) is seeded from (step, rank): reproducible, and
different for every rank and step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("elastic.state")


def _numpy() -> Any:
    return sys.modules.get("numpy")  # only if the script uses it: never import it for them


def capture() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and every CUDA device), Python, NumPy."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        keys = torch.tensor(keys.tolist(), dtype=torch.int64)  # no numpy needed to load it
        state["numpy"] = (name, keys, pos, has_gauss, gauss)
    return state


def apply(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys.tolist(), dtype="uint32"), pos, has_gauss, gauss))


def reseed(step: int, rank: int) -> None:
    seed = (step * 1_000_003 + rank) % (2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed)


KEEP = 3  # RNG files per rank: more than the snapshot slots, so the restored one is there


def _path(node_dir: str, rank: int, step: int) -> Path:
    return Path(node_dir) / f"rng-rank{rank}-step{step}.pt"


def save(node_dir: str | None, rank: int, step: int) -> None:
    """This rank's RNG states of ``step``, next to the node's snapshot. One file per step:
    the snapshot of this step may be cut short (a crash while it is copied), and then
    the restore needs the RNG states of the step before, which are still there."""
    if not node_dir:
        return
    path = _path(node_dir, rank, step)
    tmp = path.with_suffix(".tmp")
    try:
        torch.save({"step": step, "rng": capture()}, tmp)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save this rank's RNG state: %s", e)
        return
    old = sorted(Path(node_dir).glob(f"rng-rank{rank}-step*.pt"), key=_step_of)[:-KEEP]
    for stale in old:
        with contextlib.suppress(OSError):
            stale.unlink()


def _step_of(path: Path) -> int:
    try:
        return int(path.stem.rsplit("step", 1)[1])
    except (IndexError, ValueError):
        return -1


def restore(node_dir: str | None, rank: int, step: int) -> None:
    """This rank's RNG states of ``step`` if the node has them, else a fresh seed."""
    path = _path(node_dir, rank, step) if node_dir else None
    if path is not None and path.exists():
        with contextlib.suppress(Exception):
            saved = torch.load(path, weights_only=True)
            if saved.get("step") == step:
                apply(saved["rng"])
                return
    reseed(step, rank)
