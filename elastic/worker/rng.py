"""Random number generator states: each rank's own, kept beside the node's snapshot.

Ranks differ in their RNG state (dropout masks, augmentation) though their model state is
the same, so RNG states are not part of the shared snapshot: each rank writes its own
file, and on restore takes it back if it is of the restored step. A rank that has none
(a new node, or new ranks after a resize) is seeded from (step, rank): reproducible, and
different for every rank and step.

The states are read at the step (about 0.2 ms) and written by one background thread, off
the training path (the file cost 1-2 ms a snapshot there); a restore waits for the
writes in flight first. A file lost with a crash right after its snapshot means a fresh
seed for that step, as for a rank that has none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import sys
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("elastic.state")


def _numpy() -> Any:
    return sys.modules.get("numpy")  # only if the script uses it: never import it for them


def capture() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and every CUDA device), Python, NumPy (its
    key as NumPy holds it: ``portable`` makes it loadable without NumPy)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def portable(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with NumPy's key as a tensor: a file of it loads with weights_only."""
    if "numpy" not in state or isinstance(state["numpy"][1], torch.Tensor):
        return state
    name, keys, pos, has_gauss, gauss = state["numpy"]
    keys = torch.from_numpy(keys.astype("int64"))
    return {**state, "numpy": (name, keys, int(pos), int(has_gauss), float(gauss))}


def apply(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
        np.random.set_state((name, keys.astype("uint32"), pos, has_gauss, gauss))


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


class _Writer:
    """One daemon thread that writes the RNG files in the order they were taken."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, int, int, dict[str, Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, node_dir: str, rank: int, step: int, state: dict[str, Any]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rng-writer", daemon=True)
                self._thread.start()
        self._queue.put((node_dir, rank, step, state))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                _write(*item)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()


_writer = _Writer()


def save(node_dir: str | None, rank: int, step: int) -> None:
    """This rank's RNG states of ``step``, next to the node's snapshot: read now, written
    in the background. One file per step: the snapshot of this step may be cut short (a
    crash while it is copied), and then the restore needs the RNG states of the step
    before, which are still there."""
    if node_dir:
        _writer.put(node_dir, rank, step, capture())


def flush() -> None:
    """Wait until every RNG state saved so far is in its file."""
    _writer.flush()


def _write(node_dir: str, rank: int, step: int, state: dict[str, Any]) -> None:
    path = _path(node_dir, rank, step)
    tmp = path.with_suffix(".tmp")
    try:
        torch.save({"step": step, "rng": portable(state)}, tmp)
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
    flush()
    path = _path(node_dir, rank, step) if node_dir else None
    if path is not None and path.exists():
        with contextlib.suppress(Exception):
            saved = torch.load(path, weights_only=True)
            if saved.get("step") == step:
                apply(saved["rng"])
                return
    reseed(step, rank)
