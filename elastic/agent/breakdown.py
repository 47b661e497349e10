"""Save at breakdown: the newest state in this node's shared memory goes to disk as the
job goes down, so the next run resumes from it and not from an older checkpoint.

The agent outlives its workers, and their newest complete snapshot is still in the
node's shared memory (``elastic.stored.SnapshotSlots``) when the job fails for good or
this node is told to stop. Written like any checkpoint (atomic rename, checksum, keep
the newest K), only when it is newer than what the directory already has. Torch-free:
the bytes are copied as they are.
"""

from __future__ import annotations

import logging
from pathlib import Path

from elastic.stored import CheckpointDir, SnapshotSlots

log = logging.getLogger("elastic.breakdown")


def save_at_breakdown(
    node_dir: Path, checkpoint_dir: str | None, keep: int, shared: str | None = None
) -> str | None:
    """Write the node's newest snapshot to ``checkpoint_dir`` if it is newer than the
    newest checkpoint there; returns what happened, for the log (None: no snapshot).
    ``shared``: why the job's other nodes hold it too (a node leaving a job that goes
    on), so that its copy in memory going with the node loses nothing."""
    if not SnapshotSlots.present(node_dir):
        return None
    try:
        slots = SnapshotSlots(node_dir, create=False)
    except (OSError, ValueError) as e:
        return f"could not read this node's snapshots at breakdown: {e}"
    try:
        newest = slots.newest()
        if newest is None:
            return None
        slot, step = newest
        if checkpoint_dir is None and shared is not None:
            return f"this node's copy of the newest state (step {step}) goes with it: {shared}"
        if checkpoint_dir is None:
            return (
                f"this node's copy of the newest state (step {step}) was in memory only and "
                "is lost with it: give --checkpoint-dir to keep it at breakdown"
            )
        target = CheckpointDir(checkpoint_dir, keep)
        have = target.steps()
        if have and have[0] >= step:
            return f"the newest state (step {step}) is already in {checkpoint_dir}"
        data = slots.read(slot)  # complete: a slot is marked valid only after its bytes
        result = target.write(step, data)  # checks the layout, stamps the checksum
        del data
        if not result.ok:
            return f"could not save the newest state (step {step}) at breakdown: {result.error}"
        return (
            f"saved the newest state (step {step}, {result.nbytes / 1e6:.1f} MB) to "
            f"{checkpoint_dir} in {result.seconds:.2f}s at breakdown"
        )
    finally:
        slots.close()
