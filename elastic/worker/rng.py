"""Random number generator states: each rank's own, kept beside the node's snapshot.

Ranks differ in their RNG state (dropout masks, augmentation) though their model state is
the same, so RNG states are not part of the shared snapshot: each rank writes its own
file, and on restore takes it back if it is of the restored step. A rank that has none
(a new node, or new ranks after a resize) is seeded from (step, rank): reproducible, and
different for every rank and step.

The file is written at the step, before the snapshot is taken, on the training thread
(0.17 ms in all here, 0.07 ms of it reading the states: raw bytes behind a small JSON
header, no pickle, no zip). A background thread wrote it once, and a worker killed two
steps after a snapshot on a loaded machine had not written it yet: its restore was
reseeded, and the resume no longer bitwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import sys
from array import array
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("elastic.state")

MAGIC = b"elastic-run rng 1\n"
KEEP = 3  # RNG files per rank: more than the snapshot slots, so the restored one is there


def _numpy() -> Any:
    return sys.modules.get("numpy")  # only if the script uses it: never import it for them


def capture() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and every CUDA device), Python, NumPy."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def apply(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype="uint32"), pos, has_gauss, gauss))


def reseed(step: int, rank: int) -> None:
    seed = (step * 1_000_003 + rank) % (2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed)


def _words(data: bytes) -> array[int]:
    words = array("I")  # 32 bits on every platform torch runs on
    words.frombytes(data)
    return words


def _bytes(t: torch.Tensor) -> bytes:
    """A CPU byte tensor's bytes, without NumPy (a script may run without it)."""
    out = bytearray(t.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(t.reshape(-1))
    return bytes(out)


def encode(step: int, state: dict[str, Any]) -> bytes:
    """``state`` (``capture()``'s) of ``step`` as a file's bytes: a JSON header naming
    the raw blobs that follow it."""
    version, words, gauss = state["python"]
    blobs = {"torch": _bytes(state["torch"]), "python": array("I", words).tobytes()}
    head: dict[str, Any] = {"step": step, "python": [version, gauss]}
    for i, t in enumerate(state.get("cuda", ())):
        blobs[f"cuda{i}"] = _bytes(t)
    if "numpy" in state:
        name, keys, pos, has_gauss, g = state["numpy"]
        blobs["numpy"] = _numpy().asarray(keys, dtype="uint32").tobytes()
        head["numpy"] = [name, int(pos), int(has_gauss), float(g)]
    head["blobs"] = [[k, len(v)] for k, v in blobs.items()]
    text = json.dumps(head).encode()
    return MAGIC + len(text).to_bytes(4, "little") + text + b"".join(blobs.values())


def _tensor(data: bytes) -> torch.Tensor:
    if not data:
        raise ValueError("an empty generator state")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(data: bytes) -> tuple[int, dict[str, Any]]:
    """The step and the states of ``encode``'s bytes; ValueError names what is wrong."""
    if not data.startswith(MAGIC):
        raise ValueError("not an RNG file of elastic-run")
    at = len(MAGIC) + 4
    size = int.from_bytes(data[at - 4 : at], "little")
    try:
        head = json.loads(data[at : at + size])
        at += size
        blobs: dict[str, bytes] = {}
        for name, n in head["blobs"]:
            blobs[name], at = data[at : at + n], at + n
        if at != len(data):
            raise ValueError(f"{len(data)} bytes, where its header names {at}")
        version, gauss = head["python"]
        state: dict[str, Any] = {
            "torch": _tensor(blobs["torch"]),
            "python": (version, tuple(_words(blobs["python"])), gauss),
        }
        cuda = sorted((int(k[4:]), k) for k in blobs if k.startswith("cuda"))
        if cuda:
            state["cuda"] = [_tensor(blobs[k]) for _, k in cuda]
        if "numpy" in head:
            name, pos, has_gauss, g = head["numpy"]
            state["numpy"] = (name, _words(blobs["numpy"]), pos, has_gauss, g)
        return int(head["step"]), state
    except (KeyError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"malformed ({type(e).__name__}: {e})") from None


def _path(node_dir: str, rank: int, step: int) -> Path:
    return Path(node_dir) / f"rng-rank{rank}-step{step}.rng"


def _mine(node_dir: str, rank: int) -> list[Path]:
    return sorted(Path(node_dir).glob(f"rng-rank{rank}-step*.rng"), key=_step_of)


def save(node_dir: str | None, rank: int, step: int) -> None:
    """This rank's RNG states of ``step``, next to the node's snapshot, in place before
    the snapshot is. One file per step: the snapshot of this step may be cut short (a
    crash while it is copied), and then the restore needs the RNG states of the step
    before, which are still there."""
    if not node_dir:
        return
    path = _path(node_dir, rank, step)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(encode(step, capture()))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save this rank's RNG state: %s", e)
        return
    for stale in _mine(node_dir, rank)[:-KEEP]:
        with contextlib.suppress(OSError):
            stale.unlink()


def _step_of(path: Path) -> int:
    try:
        return int(path.stem.rsplit("step", 1)[1])
    except (IndexError, ValueError):
        return -1


def restore(node_dir: str | None, rank: int, step: int) -> None:
    """This rank's RNG states of ``step`` if the node has them, else a fresh seed: said
    as a warning for an unreadable file, and as a note where the node holds this rank's
    files of other steps only (a rank numbered anew after a resize; a worker that ended
    between the node's snapshot and its own file)."""
    path = _path(node_dir, rank, step) if node_dir else None
    if path is not None and path.exists():
        try:
            saved, state = decode(path.read_bytes())
            if saved == step:
                apply(state)  # a state of the wrong size is refused by its generator
                return
            why = f"it holds step {saved}"
        except (OSError, ValueError, TypeError, RuntimeError) as e:
            why = str(e)
        log.warning(
            "rank %d: the RNG file %s is unusable (%s): seeded from (step, rank)", rank, path, why
        )
    elif node_dir and _mine(node_dir, rank):
        log.info(
            "rank %d: this node holds no RNG state of step %d for it: seeded from (step, "
            "rank), so its random draws (dropout, augmentation) differ from a run without "
            "the fault",
            rank,
            step,
        )
    reseed(step, rank)
