"""``elastic.State``: what a training script needs to survive restarts and resizes.

    state = elastic.State(model=model, optimizer=opt, scheduler=sched, sampler=sampler, epoch=0)
    state.restore()                 # the newest state anywhere in the job, or a fresh start
    for epoch in range(state.epoch, epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        for batch in loader:
            ...                      # forward, backward, optimizer.step()
            state.commit()           # one optimizer step done

``commit()`` counts the step, advances the ElasticSampler, reports progress to the agent,
and (the ranks agreeing through one tiny all-reduce) snapshots by policy or stops to let
the job resize. The parts: ``snapshotter`` takes snapshots, ``restore`` finds and loads
the newest state, ``rng`` keeps each rank's random states, ``comm`` agrees with the
other ranks. Knows nothing about etcd: it talks to its agent through the control block.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from elastic import contract
from elastic.contract import NODE_DIR_ENV, SnapshotPolicy
from elastic.stored import SnapshotError
from elastic.worker import comm, progress, rng, sharded, snapshot
from elastic.worker.cadence import Cadence
from elastic.worker.restore import (
    NOTHING,
    Candidate,
    CheckpointMismatchError,
    load_into,
    local_candidate,
)
from elastic.worker.sampler import ElasticSampler
from elastic.worker.snapshotter import Snapshotter, Stats, frozen_storage, stable_storage

log = logging.getLogger("elastic.state")

_RESERVED = {"step", "snapshot_policy"}

__all__ = ["CheckpointMismatchError", "SnapshotPolicy", "State"]


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class State:
    """Model, optimizer, scheduler, sampler and plain values of a run (see module doc)."""

    def __init__(self, snapshot_policy: SnapshotPolicy | None = None, **items: Any) -> None:
        objects: dict[str, Any] = {}
        values: dict[str, Any] = {"step": 0}
        for key, value in items.items():
            if key in _RESERVED:
                raise ValueError(f"State: {key!r} is reserved")
            (objects if _has_state(value) else values)[key] = value
        set_ = object.__setattr__
        set_(self, "_objects", objects)
        set_(self, "_values", values)
        set_(self, "policy", snapshot_policy or SnapshotPolicy.from_env())
        set_(self, "stats", Stats())
        every = self.policy.every
        fixed = None if every == "auto" else int(every)
        set_(self, "_cadence", Cadence(self.policy.budget, fixed))
        if fixed:
            progress.cadence(fixed, 0.0, 0.0, fixed)
        set_(self, "_last_commit", None)  # the cadence's clock at the end of commit()
        set_(self, "_disturbed", False)  # a snapshot ran into the step now in progress
        set_(self, "_logged_interval", 0)
        set_(self, "_ctl", contract.worker_block())
        set_(self, "_stop_seen", self._ctl.stop_generation if self._ctl else 0)
        set_(self, "_comm", comm.ControlGroup())
        set_(self, "_node_dir", os.environ.get(NODE_DIR_ENV) or None)
        if self._ctl is not None:
            self._ctl.mark(contract.USES_STATE)
        set_(self, "_sharded", sharded.is_sharded(objects))
        if self._sharded and not self.policy.checkpoint_dir:
            raise ValueError(
                "sharded state (FSDP2/DTensor) is saved with torch.distributed.checkpoint: "
                "give --checkpoint-dir on a filesystem every node can read"
            )
        set_(
            self,
            "_snapshotter",
            Snapshotter(self.policy, self._node_dir, comm.local_rank(), self._ctl, self.stats),
        )
        hooks = [
            opt.register_step_pre_hook(lambda *_: self._snapshotter.wait_for_step())
            for opt in self._optimizers()
        ]
        set_(self, "_hooks", hooks)

    # -- plain values as attributes ---------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._values:
            self._values[name] = value
        else:
            object.__setattr__(self, name, value)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in self._objects.values() if isinstance(o, torch.optim.Optimizer)]

    def _samplers(self) -> list[ElasticSampler]:
        return [o for o in self._objects.values() if isinstance(o, ElasticSampler)]

    # -- commit ---------------------------------------------------------------------------
    def commit(self, loss: float | None = None) -> None:
        """One optimizer step is done: count it, report it (``loss`` too, if given, for
        the metrics), snapshot or stop as the ranks agree."""
        self._values["step"] += 1
        step = self._values["step"]
        samplers = self._samplers()
        before = sum(s.consumed for s in samplers)
        for s in samplers:
            s.advance(1)
        after = sum(s.consumed for s in samplers)
        progress.report(step, loss, (after - before) // max(comm.world(), 1))
        cadence: Cadence = self._cadence
        now = cadence.clock()
        if self._last_commit is not None:
            cadence.observe(now - self._last_commit, self._disturbed)
        due = cadence.due(step)
        stop, due, interval = self._comm.all_reduce(
            [self._stopping(), due, cadence.proposal], "MAX"
        )
        if cadence.agree(interval):
            self._tell_cadence()
        if due or stop:
            self.snapshot(wait=bool(stop))
        if stop:
            self._leave_for_resize()
        set_ = object.__setattr__
        set_(self, "_disturbed", bool(due) or self._snapshotter.copying)
        set_(self, "_last_commit", cadence.clock())

    def _tell_cadence(self) -> None:
        """The ranks agreed on a new interval: logged (rank 0) and exported, with the
        steps a crash can cost."""
        cadence: Cadence = self._cadence
        risk = cadence.at_risk
        progress.cadence(cadence.interval, cadence.cost_s or 0.0, cadence.step_s or 0.0, risk)
        logged = self._logged_interval
        if comm.rank() != 0 or (logged and logged / 2 < cadence.interval < logged * 2):
            return  # the log shows the first choice and moves of 2x; the metrics all
        object.__setattr__(self, "_logged_interval", cadence.interval)
        why = cadence.choice.reason if cadence.choice else "no measurements here yet"
        if cadence.choice and cadence.choice.interval != cadence.interval:
            why += f" here; another rank's figures asked for every {cadence.interval}"
        log.info(
            "snapshot every %d step(s), at most %d step(s) lost to a crash: %s",
            cadence.interval,
            risk,
            why,
        )

    def heartbeat(self) -> None:
        """Progress without a step (a long evaluation): keeps the hang detector quiet."""
        progress.report()

    def _stopping(self) -> bool:
        return self._ctl is not None and self._ctl.stop_generation != self._stop_seen

    def _leave_for_resize(self) -> None:
        self._snapshotter.flush(timeout=60)
        log.info("stopping at step %d for a resize", self._values["step"])
        raise SystemExit(contract.EXIT_RESIZE)

    # -- snapshots ------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "version": 1,
            "step": self._values["step"],
            "values": dict(self._values),
            "objects": {k: o.state_dict() for k, o in self._objects.items()},
        }

    def snapshot(self, wait: bool = False) -> None:
        """Take a snapshot now (commit() does this by policy). Collective when sharded.
        ``wait``: copy everything before returning (the process is about to stop)."""
        step = self._values["step"]
        self._cadence.taken(step)
        rng.save(self._node_dir, comm.rank(), step)
        if self._sharded:
            self._save_sharded(step)
            return
        stable = set() if wait else stable_storage(self._optimizers())
        frozen = frozen_storage(o for o in self._objects.values() if isinstance(o, torch.nn.Module))
        rank0 = comm.rank() == 0
        self._snapshotter.take(
            self._state(),
            step,
            stable,
            frozen,
            checkpoint=lambda: rank0 and self._snapshotter.due_checkpoint(wait),
        )

    def _save_sharded(self, step: int) -> None:
        started = time.perf_counter()
        directory = Path(str(self.policy.checkpoint_dir))
        try:
            sharded.save(directory, step, self._objects, self._values, self.policy.keep)
        except Exception as e:  # DCP raises its own exception types, on every rank
            self.stats.checkpoint_failures += 1
            progress.checkpoint(False, 0.0, 0)
            log.error("sharded checkpoint of step %d failed; training goes on: %s", step, e)
            return
        self.stats.checkpoints += 1
        self.stats.snapshots += 1
        took = time.perf_counter() - started
        self.stats.snapshot_seconds = self.stats.checkpoint_seconds = took
        if self._ctl is not None:
            self._ctl.snapshot_taken(step)

    # -- restore --------------------------------------------------------------------------
    def restore(self) -> bool:
        """Load the newest state in the job; False (nothing loaded) on a fresh start.
        Every rank must call it, at the same point of the script."""
        started = time.perf_counter()
        nbytes = 0
        if self._sharded:
            step = self._restore_sharded()
        else:
            step, nbytes = self._restore_snapshot()
        took = time.perf_counter() - started
        self.stats.restore_seconds = took
        self.stats.restore_bytes = nbytes
        progress.restored(took, nbytes)
        self._apply_batch_policy()
        if step < 0:
            return False
        self.stats.restored_step = step
        if self._ctl is not None:
            self._ctl.beat(step)
        return True

    def _restore_snapshot(self) -> tuple[int, int]:
        """(step restored or -1, bytes loaded)."""
        started = time.perf_counter()
        policy = self.policy
        mine: Candidate = local_candidate(
            self._node_dir,
            self._snapshotter.slots,
            policy.checkpoint_dir,
            policy.keep,
            comm.local_rank(),
        )
        rank, world = comm.rank(), comm.world()
        best, lowest = self._comm.all_reduce([mine.step, -mine.step], "MAX")
        if best < 0:
            return -1, 0
        everyone = -lowest == best  # the MAX of -step is minus the smallest step
        holder = self._comm.all_reduce([rank if mine.step == best else world], "MIN")[0]
        if everyone:
            blob = mine.read()
        else:
            blob = self._comm.broadcast(mine.read() if rank == holder else None, holder)
        try:
            saved = snapshot.parse(blob)
        except SnapshotError as e:
            raise CheckpointMismatchError(
                f"the saved state of step {best} is unreadable: {e}"
            ) from None
        load_into(self._objects, saved)
        self._values.update(saved.get("values", {}))
        self._values["step"] = int(saved["step"])
        rng.restore(self._node_dir, rank, best)
        sent = ", sent over the process group" if not everyone else ""
        took = time.perf_counter() - started
        log.info("restored step %d (from rank %d%s) in %.2fs", best, holder, sent, took)
        return best, len(blob)

    def _restore_sharded(self) -> int:
        directory = Path(str(self.policy.checkpoint_dir))
        mine = sharded.complete_steps(directory)[:1] if comm.rank() == 0 else []
        best = int(self._comm.all_reduce([mine[0] if mine else NOTHING.step], "MAX")[0])
        if best < 0:
            return -1
        try:
            values = sharded.load(directory, best, self._objects, self._values)
        except Exception as e:  # DCP's own errors: missing keys, wrong shapes
            raise CheckpointMismatchError(
                f"sharded checkpoint of step {best} does not fit: {e}"
            ) from None
        self._values.update(values)
        self._values["step"] = best
        rng.restore(self._node_dir, comm.rank(), best)
        return best

    def _apply_batch_policy(self) -> None:
        schedulers = [
            o for o in self._objects.values() if hasattr(o, "base_lrs") and hasattr(o, "optimizer")
        ]
        for s in self._samplers():
            for opt in self._optimizers():
                sched = next((x for x in schedulers if x.optimizer is opt), None)
                s.policy.apply(opt, sched, comm.world())

    def flush(self) -> None:
        """Wait for the snapshot copy and the checkpoint write in progress, if any."""
        self._snapshotter.flush()

    def close(self) -> None:
        """Finish background work (the process exiting does the same, less politely)."""
        self.flush()
        for h in self._hooks:
            h.remove()
