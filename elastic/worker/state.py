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
the job resize.

To keep the process through membership changes, put the training in a function (build
DDP inside it: DDP holds the process group) and hand it to ``run``:

    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
    state.run(train)                # restore, train; again after each live re-formation

``run`` calls ``train()`` again, in the same process, with the new process group formed,
the torchrun variables updated and every rank holding the newest committed state.

The parts: ``snapshotter`` takes snapshots, ``restore`` finds and loads
the newest state, ``rng`` keeps each rank's random states, ``comm`` agrees with the
other ranks. Knows nothing about etcd: it talks to its agent through the control block.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from elastic import contract
from elastic.contract import NODE_DIR_ENV, SnapshotPolicy
from elastic.stored import SnapshotError
from elastic.worker import comm, live, progress, rng, sharded, snapshot
from elastic.worker.cadence import Cadence
from elastic.worker.live import Live, Reformation
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

__all__ = ["CheckpointMismatchError", "Reformation", "SnapshotPolicy", "State"]

T = TypeVar("T")


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
        set_(self, "_stepped", False)  # an optimizer stepped since the last commit()
        set_(self, "_live", None)  # Live, while run() keeps this process through changes
        set_(self, "_restored", False)
        hooks = []
        for opt in self._optimizers():
            hooks.append(opt.register_step_pre_hook(lambda *_: self._snapshotter.wait_for_step()))
            hooks.append(opt.register_step_post_hook(lambda *_: self._mark_stepped()))
        set_(self, "_hooks", hooks)

    def _mark_stepped(self) -> None:
        object.__setattr__(self, "_stepped", True)

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
        object.__setattr__(self, "_stepped", False)
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
        live_ = self._live
        pause = live_ is not None and live_.pause_asked
        stop, due, interval, pause = self._comm.all_reduce(
            [self._stopping(), due, cadence.proposal, pause], "MAX"
        )
        if cadence.agree(interval):
            self._tell_cadence()
        # the ranks stop together; a live one that was not asked to leave pauses instead
        leave = bool(stop or pause) if live_ is None else bool(stop) and self._stopping()
        if due or stop or pause:
            self.snapshot(wait=leave)  # pausing: the copy overlaps the re-formation
        if leave:
            self._leave_for_resize()
        if stop or pause:
            raise Reformation(f"the ranks paused at step {step} for a membership change")
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
        if self._ctl is not None:  # the others need not wait for this process to end
            self._ctl.leaving()
        raise SystemExit(contract.EXIT_RESIZE)

    # -- live re-formation ----------------------------------------------------------------
    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Restore (unless ``restore()`` ran already), then return ``fn(*args, **kwargs)``.

        Under elastic-run (``--restart-mode live``, the default) a membership change does
        not end the process: ``fn`` is left (by the exception of the collective that failed,
        or by ``commit()`` when the ranks pause together), the new process group forms, the
        ranks agree on the newest committed state (a rank behind, or a newcomer, gets it
        from a rank that has it) and ``fn`` is called again. Anywhere else (torchrun, plain
        python, ``--restart-mode respawn``) it is called once."""
        from torch.nn.parallel import DistributedDataParallel

        for name, obj in self._objects.items():
            if isinstance(obj, DistributedDataParallel):
                raise ValueError(
                    f"State.run: {name!r} is a DistributedDataParallel. Give State the module "
                    f"inside it and wrap that in DDP inside {getattr(fn, '__name__', 'fn')}(): "
                    "DDP holds the process group, which a re-formation replaces"
                )
        link = self._go_live()
        try:
            if not self._restored:
                self.restore()
            while True:
                try:
                    return fn(*args, **kwargs)
                except BaseException as e:
                    if link is None or not link.reforms(e):
                        raise
                    self._reform(link, e)
        finally:
            live.detach()
            object.__setattr__(self, "_live", None)

    def _go_live(self) -> Live | None:
        d = comm.dist()
        if d is None or self._sharded:
            return None  # sharded state: DCP's collectives; the respawn path stays
        link = live.attach(self._ctl)
        if link is not None and link.reformations == 0:
            link.adopt()  # the group the script formed itself
        object.__setattr__(self, "_live", link)
        return link

    def _reform(self, link: Live, why: BaseException) -> None:
        """Leave the broken group, form the next one, agree on the state; retried while
        the group breaks again under it (a second change during the first)."""
        started = time.perf_counter()
        if not isinstance(why, Reformation) and not link.abandoned.is_set():
            text = str(why).strip().splitlines()[0][:200] if str(why).strip() else ""
            log.warning(
                "rank %d: collective failed (%s: %s); waiting for the agent",
                comm.rank(),
                type(why).__name__,
                text,
            )
        while True:
            self._comm.forget()
            link.let_go()
            self._snapshotter.wait_copy()  # nothing may read the tensors a load rewrites
            if self._stepped:  # the step finished but its commit() did not: count it
                self._count_step()
            for opt in self._optimizers():  # the step in flight is dropped, and its gradients
                opt.zero_grad(set_to_none=True)
            try:
                if not link.form(self._stopping):  # this node leaves meanwhile
                    self.snapshot(wait=True)
                    self._leave_for_resize()
                progress.relabel()
                step = self._resync()
                break
            except Exception as e:
                if not link.reforms(e):
                    raise
        log.info(
            "re-formed live: rank %d of %d at step %d in %.2fs (re-formation %d)",
            comm.rank(),
            comm.world(),
            step,
            time.perf_counter() - started,
            link.reformations,
        )

    def _count_step(self) -> None:
        object.__setattr__(self, "_stepped", False)
        self._values["step"] += 1
        for s in self._samplers():
            s.advance(1)

    def _resync(self) -> int:
        """Every rank offers the state it holds; the newest goes to those behind."""
        mine = Candidate(step=self._values["step"], held=lambda: snapshot.to_bytes(self._state()))
        step, nbytes = self._restore_snapshot(mine)
        self.stats.restore_bytes = nbytes
        self._apply_batch_policy()
        if self._ctl is not None:
            self._ctl.beat(step)
        return step

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
        object.__setattr__(self, "_restored", True)
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

    def _restore_snapshot(self, mine: Candidate | None = None) -> tuple[int, int]:
        """(step restored or -1, bytes loaded). ``mine``: what this rank offers (default:
        the newest state it can read); a rank offering what it holds in memory
        (``held``) and as new as the newest loads nothing."""
        started = time.perf_counter()
        policy = self.policy
        if mine is None:
            mine = local_candidate(
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
        if everyone and mine.held is not None:
            return best, 0  # every rank holds the newest state already
        if everyone:
            blob = mine.read()
        else:
            blob = self._comm.broadcast(mine.read() if rank == holder else None, holder)
            if mine.held is not None and mine.step == best:
                return best, 0
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
