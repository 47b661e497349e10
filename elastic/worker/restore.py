"""Restoring: find the newest state anywhere in the job and load it on every rank.

Every rank offers the newest state it can read itself (its node's snapshot, or, on local
rank 0, the checkpoint directory). The ranks agree on the newest step with one
all-reduce; if every rank holds it, each loads its own copy, otherwise the lowest rank
holding it sends it to all over the process group, so a new node needs no shared
filesystem. A state that does not fit the objects it is loaded into is a
``CheckpointMismatchError`` naming every mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic.stored import CheckpointDir, SnapshotSlots


class CheckpointMismatchError(ValueError):
    """The saved state does not fit the objects it is loaded into; names the mismatch."""


@dataclass(frozen=True)
class Candidate:
    """A state this rank can read: its step and where the bytes are."""

    step: int
    slots: SnapshotSlots | None = None  # a shared-memory snapshot in slot ``slot``
    slot: int = 0
    data: bytes | None = None  # a checkpoint file's bytes
    in_memory: Callable[[], memoryview] | None = None  # the state this process holds, packed

    def read(self) -> memoryview:
        if self.in_memory is not None:
            return self.in_memory()
        if self.slots is not None:
            return self.slots.read(self.slot)
        assert self.data is not None
        return memoryview(self.data)


NOTHING = Candidate(step=-1)


def local_candidate(
    node_dir: str | None,
    slots: SnapshotSlots | None,
    checkpoint_dir: str | None,
    keep: int,
    local_rank: int,
) -> Candidate:
    """The newest state this rank can read itself; ``NOTHING`` if none."""
    best = NOTHING
    if slots is None and SnapshotSlots.present(node_dir):
        try:
            slots = SnapshotSlots(node_dir, create=False)
        except OSError:
            slots = None
    newest = slots.newest() if slots is not None else None
    if newest is not None:
        best = Candidate(step=newest[1], slots=slots, slot=newest[0])
    if checkpoint_dir and local_rank == 0:
        found = CheckpointDir(checkpoint_dir, keep).newest_valid()
        if found is not None and found[0] > best.step:
            best = Candidate(step=found[0], data=found[1])
    return best


def check_fits(name: str, obj: Any, saved: Any) -> None:
    """Compare a module's saved state with its own; raise naming every mismatch."""
    if not isinstance(obj, torch.nn.Module) or not isinstance(saved, dict):
        return
    mine = obj.state_dict()
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    shapes = [
        f"{k}: saved {tuple(saved[k].shape)}, model {tuple(v.shape)}"
        for k, v in mine.items()
        if k in saved
        and isinstance(v, torch.Tensor)
        and isinstance(saved[k], torch.Tensor)
        and saved[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        more = " ..." if len(unexpected) > 8 else ""
        problems.append(f"unexpected keys {unexpected[:8]}{more}")
    if shapes:
        problems.append("shape mismatch " + "; ".join(shapes[:8]))
    if problems:
        raise CheckpointMismatchError(f"saved state does not fit {name!r}: " + ", ".join(problems))


def load_into(objects: dict[str, Any], saved: dict[str, Any]) -> None:
    """Load each object's saved state into it, after checking it fits."""
    found = saved.get("objects", {})
    missing = sorted(set(objects) - set(found))
    if missing:
        raise CheckpointMismatchError(f"saved state has no {missing} (it has {sorted(found)})")
    for name, obj in objects.items():
        check_fits(name, obj, found[name])
        try:
            obj.load_state_dict(found[name])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointMismatchError(f"saved state does not fit {name!r}: {e}") from None
