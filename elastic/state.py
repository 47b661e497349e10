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
the job resize. A snapshot is a copy of the state into the node's shared memory, which
outlives a worker crash; parameters and optimizer state are copied while the next
forward/backward runs (they only change in ``optimizer.step()``, which waits for the
copy), so the training path pays little more than the small things. Every
``checkpoint_every`` snapshots, global rank 0 also writes one to ``--checkpoint-dir`` in
the background. ``restore()`` finds the newest snapshot or checkpoint on any rank; the
rank holding it sends it to the others over the process group, so a new node needs no
shared filesystem.

Knows nothing about etcd: it talks to its agent through the control block (control.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic import checkpoint, control, progress, sharded, snapshot
from elastic.sampler import ElasticSampler

log = logging.getLogger("elastic.state")

SNAPSHOT_DIR_ENV = control.SNAPSHOT_DIR_ENV
_RESERVED = {"step", "snapshot_policy"}


class CheckpointMismatchError(ValueError):
    """The saved state does not fit the objects it is loaded into; names the mismatch."""


@dataclass(frozen=True)
class SnapshotPolicy:
    """When to snapshot (to shared memory) and checkpoint (to disk). Defaults come from
    elastic-run's flags through the environment."""

    every: int = 1  # steps between snapshots; 0: only when stopping for a resize
    seconds: float = 0.0  # or at least this often (0: not by time)
    checkpoint_every: int = 100  # snapshots between checkpoints to checkpoint_dir
    keep: int = 3
    checkpoint_dir: str | None = None

    @classmethod
    def from_env(cls) -> SnapshotPolicy:
        env = os.environ
        return cls(
            every=int(env.get("ELASTIC_RUN_SNAPSHOT_EVERY", 1)),
            seconds=float(env.get("ELASTIC_RUN_SNAPSHOT_SECONDS", 0)),
            checkpoint_every=int(env.get("ELASTIC_RUN_CHECKPOINT_EVERY", 100)),
            keep=int(env.get("ELASTIC_RUN_CHECKPOINT_KEEP", 3)),
            checkpoint_dir=env.get(checkpoint.ENV) or None,
        )


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _idle_priority() -> None:
    """Run this (the copy) thread only on otherwise idle CPU: training threads keep their
    cores, and optimizer.step() waits for whatever copy is left."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _numpy() -> Any:
    import sys

    return sys.modules.get("numpy")  # only if the script uses it: never import it for them


def _check_fits(name: str, obj: Any, saved: Any) -> None:
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
        problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if shapes:
        problems.append("shape mismatch " + "; ".join(shapes[:8]))
    if problems:
        raise CheckpointMismatchError(f"saved state does not fit {name!r}: " + ", ".join(problems))


class State:
    """Model, optimizer, scheduler, sampler and plain values of a run (see module doc)."""

    def __init__(self, snapshot_policy: SnapshotPolicy | None = None, **items: Any) -> None:
        objects, values = {}, {}
        for key, value in items.items():
            if key in _RESERVED:
                raise ValueError(f"State: {key!r} is reserved")
            (objects if _has_state(value) else values)[key] = value
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_values", {"step": 0, **values})
        object.__setattr__(self, "policy", snapshot_policy or SnapshotPolicy.from_env())
        self._init_runtime()

    def _init_runtime(self) -> None:
        set_ = object.__setattr__
        set_(self, "_ctl", control.worker_block())
        set_(self, "_stop_seen", self._ctl.stop_generation if self._ctl else 0)
        set_(self, "_group", None)
        set_(self, "_last_snapshot", time.monotonic())
        set_(self, "_snapshots", 0)
        set_(self, "_store", None)
        set_(self, "_copy", None)  # the background copy of the snapshot in flight
        set_(self, "_hooks", [])
        set_(self, "_writer", None)
        set_(
            self,
            "stats",
            {
                "snapshots": 0,
                "snapshot_seconds": 0.0,
                "snapshot_bytes": 0,
                "checkpoints": 0,
                "checkpoint_failures": 0,
                "checkpoint_seconds": 0.0,
                "restore_seconds": 0.0,
                "restore_bytes": 0,
                "restored_step": -1,
                "blocked_seconds": 0.0,
            },
        )
        if self._ctl is not None:
            self._ctl.mark(control.USES_STATE)
        dirname = os.environ.get(SNAPSHOT_DIR_ENV)
        if self._local_rank() == 0 and (dirname or self.policy.checkpoint_dir):
            try:
                self._store = snapshot.SnapshotStore(dirname)
            except OSError as e:
                log.warning("no shared-memory snapshots (%s): %s", dirname, e)
        for opt in self._optimizers():
            self._hooks.append(opt.register_step_pre_hook(lambda *_: self._wait_copy()))
        object.__setattr__(self, "_sharded", sharded.is_sharded(self._objects))
        if self._sharded and not self.policy.checkpoint_dir:
            raise ValueError(
                "sharded state (FSDP2/DTensor) is saved with "
                "torch.distributed.checkpoint: give --checkpoint-dir on a "
                "filesystem every node can read"
            )
        if self.policy.checkpoint_dir and not self._sharded:
            target = checkpoint.CheckpointDir(self.policy.checkpoint_dir, self.policy.keep)
            object.__setattr__(
                self, "_writer", checkpoint.BackgroundWriter(target, self._checkpoint_done)
            )

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

    # -- the process group -------------------------------------------------------------
    @staticmethod
    def _dist() -> Any:
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None

    def _rank(self) -> int:
        d = self._dist()
        return d.get_rank() if d else int(os.environ.get("RANK", 0))

    def _world(self) -> int:
        d = self._dist()
        return d.get_world_size() if d else 1

    @staticmethod
    def _local_rank() -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def _control_group(self) -> Any:
        """A gloo group for the small agreements (the default group may be NCCL)."""
        d = self._dist()
        if d is None or d.get_world_size() == 1:
            return None
        if self._group is None:
            group = None if d.get_backend() == "gloo" else d.new_group(backend="gloo")
            object.__setattr__(self, "_group", group or d.group.WORLD)
        return self._group

    def _all_reduce(self, values: list[int], op: str) -> list[int]:
        group = self._control_group()
        if group is None:
            return values
        d = self._dist()
        t = torch.tensor(values, dtype=torch.int64)
        d.all_reduce(t, op=getattr(d.ReduceOp, op), group=group)
        return t.tolist()

    # -- commit ---------------------------------------------------------------------------
    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in self._objects.values() if isinstance(o, torch.optim.Optimizer)]

    def _samplers(self) -> list[ElasticSampler]:
        return [o for o in self._objects.values() if isinstance(o, ElasticSampler)]

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
        progress.report(step, loss, (after - before) // max(self._world(), 1))
        p = self.policy
        due = (p.every > 0 and step % p.every == 0) or (
            p.seconds > 0 and time.monotonic() - self._last_snapshot >= p.seconds
        )
        stop = self._stopping()
        stop, due = (bool(x) for x in self._all_reduce([int(stop), int(due)], "MAX"))
        if due or stop:
            self.snapshot(wait=stop)
        if stop:
            self._leave_for_resize()

    def heartbeat(self) -> None:
        """Progress without a step (a long evaluation): keeps the hang detector quiet."""
        progress.report()

    # -- snapshots ------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "version": 1,
            "step": self._values["step"],
            "values": dict(self._values),
            "objects": {k: o.state_dict() for k, o in self._objects.items()},
        }

    def _stable_tensors(self) -> set[int]:
        """Storage of tensors that change only inside optimizer.step()."""
        ptrs = set()
        for opt in self._optimizers():
            for group in opt.param_groups:
                for p in group["params"]:
                    ptrs.add(p.data_ptr())
                    for v in opt.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor):
                            ptrs.add(v.data_ptr())
        return ptrs

    def snapshot(self, wait: bool = False) -> None:
        """Take a snapshot now (commit() does this by policy). Collective when sharded."""
        self._save_rng()
        if self._sharded:
            self._save_sharded()
            return
        if self._store is None:
            return
        self._wait_copy()
        started = time.perf_counter()
        packed = snapshot.pack(self._state())
        slot = self._store.target()
        try:
            buf = self._store.buffer(slot, packed.size)
        except OSError as e:
            log.error("snapshot to shared memory failed (%s); training continues", e)
            self.stats["checkpoint_failures"] += 1
            progress.checkpoint(False, 0.0, 0)
            return
        snapshot.write_into(buf, packed, tensors=False)
        stable = set() if wait else self._stable_tensors()  # waiting: copy everything now
        later = [i for i, t in enumerate(packed.tensors) if t.data_ptr() in stable]
        deferred = set(later)
        now = [i for i in range(len(packed.tensors)) if i not in deferred]
        snapshot.copy_tensors(buf, packed, now)
        step = self._values["step"]

        def finish() -> None:
            _idle_priority()
            snapshot.copy_tensors_background(
                buf, packed, later, torch.get_num_threads(), setup=_idle_priority
            )
            self._store.commit(slot, step, packed.size)
            self.stats["snapshots"] += 1
            self.stats["snapshot_bytes"] = packed.size
            if self._ctl is not None:
                self._ctl.snapshot_taken(step)
            self._maybe_checkpoint(slot, step)

        if later:
            copy = threading.Thread(target=finish, name="snapshot-copy", daemon=True)
            object.__setattr__(self, "_copy", copy)
            copy.start()
        else:
            finish()
        self.stats["snapshot_seconds"] = time.perf_counter() - started
        self.stats["blocked_seconds"] += self.stats["snapshot_seconds"]
        progress.snapshot(self.stats["snapshot_seconds"], packed.size)
        object.__setattr__(self, "_last_snapshot", time.monotonic())

    def _save_sharded(self) -> None:
        started = time.perf_counter()
        step = self._values["step"]
        try:
            sharded.save(
                Path(self.policy.checkpoint_dir),
                step,
                self._objects,
                self._values,
                self.policy.keep,
            )
        except Exception as e:  # DCP raises its own exception types, on every rank
            self.stats["checkpoint_failures"] += 1
            progress.checkpoint(False, 0.0, 0)
            log.error("sharded checkpoint of step %d failed; training goes on: %s", step, e)
            return
        self.stats["checkpoints"] += 1
        self.stats["snapshots"] += 1
        self.stats["snapshot_seconds"] = self.stats["checkpoint_seconds"] = (
            time.perf_counter() - started
        )
        if self._ctl is not None:
            self._ctl.snapshot_taken(step)

    def _restore_sharded(self) -> bool:
        directory = Path(self.policy.checkpoint_dir)
        mine = sharded.complete_steps(directory)[:1] if self._rank() == 0 else []
        best = self._all_reduce([mine[0] if mine else -1], "MAX")[0]
        if best < 0:
            self._apply_policy()
            return False
        try:
            values = sharded.load(directory, best, self._objects, self._values)
        except Exception as e:  # DCP's own errors: missing keys, wrong shapes
            raise CheckpointMismatchError(
                f"sharded checkpoint of step {best} does not fit: {e}"
            ) from None
        self._values.update(values)
        self._values["step"] = best
        self._restore_rng(best)
        self._apply_policy()
        self.stats["restored_step"] = best
        return True

    def _wait_copy(self) -> None:
        copy = self._copy
        if copy is not None:
            started = time.perf_counter()
            copy.join()
            object.__setattr__(self, "_copy", None)
            waited = time.perf_counter() - started
            self.stats["blocked_seconds"] += waited
            progress.waited(waited)

    def _save_rng(self) -> None:
        """Each rank's RNG, next to the node's snapshot (ranks differ; state does not)."""
        dirname = os.environ.get(SNAPSHOT_DIR_ENV)
        if not dirname:
            return
        path = Path(dirname) / f"rng-rank{self._rank()}.pt"
        tmp = path.with_suffix(".tmp")
        try:
            torch.save({"step": self._values["step"], "rng": _rng_state()}, tmp)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not save this rank's RNG state: %s", e)

    def _maybe_checkpoint(self, slot: int, step: int) -> None:
        writer = self._writer
        object.__setattr__(self, "_snapshots", self._snapshots + 1)
        if writer is None or self._rank() != 0:
            return
        every = max(self.policy.checkpoint_every, 1)
        if self._snapshots % every and not self._stopping():
            return
        store = self._store
        store.pinned.add(slot)
        if not writer.submit(step, store.read(slot), lambda: store.pinned.discard(slot)):
            store.pinned.discard(slot)

    def _stopping(self) -> bool:
        return self._ctl is not None and self._ctl.stop_generation != self._stop_seen

    def _checkpoint_done(self, result: checkpoint.WriteResult) -> None:
        progress.checkpoint(result.ok, result.seconds, result.nbytes)
        if result.ok:
            self.stats["checkpoints"] += 1
            self.stats["checkpoint_seconds"] = result.seconds
            log.info(
                "checkpoint of step %d written (%.2fs, %d bytes)",
                result.step,
                result.seconds,
                result.nbytes,
            )
        else:
            self.stats["checkpoint_failures"] += 1
            log.error(
                "checkpoint of step %d failed, training goes on from memory snapshots: %s",
                result.step,
                result.error,
            )

    def _leave_for_resize(self) -> None:
        if self._writer is not None:
            self._writer.wait(timeout=60)
        log.info("stopping at step %d for a resize", self._values["step"])
        raise SystemExit(control.EXIT_RESIZE)

    # -- restore --------------------------------------------------------------------------
    def _local_candidate(self) -> tuple[int, Any]:
        """(step, source) of the newest state this rank can read itself; (-1, None)."""
        best: tuple[int, Any] = (-1, None)
        dirname = os.environ.get(SNAPSHOT_DIR_ENV)
        if dirname and (Path(dirname) / "slots.hdr").exists():
            with contextlib.suppress(OSError):
                store = self._store or snapshot.SnapshotStore(dirname)
                newest = store.newest()
                if newest is not None:
                    best = (newest[1], ("shm", store, newest[0]))
        elif self._store is not None and self._store.newest() is not None:
            slot, step = self._store.newest()
            best = (step, ("shm", self._store, slot))
        if self.policy.checkpoint_dir and self._local_rank() == 0:
            target = checkpoint.CheckpointDir(self.policy.checkpoint_dir, self.policy.keep)
            found = target.newest_valid()
            if found is not None and found[0] > best[0]:
                best = (found[0], ("file", found[1]))
        return best

    @staticmethod
    def _bytes(source: Any) -> memoryview:
        if source[0] == "shm":
            return source[1].read(source[2])
        return memoryview(source[1])

    def restore(self) -> bool:
        """Load the newest state in the job; False (nothing loaded) on a fresh start.
        Every rank must call it, at the same point of the script."""
        started = time.perf_counter()
        if self._sharded:
            done = self._restore_sharded()
            self.stats["restore_seconds"] = time.perf_counter() - started
            progress.restored(self.stats["restore_seconds"], 0)
            return done
        step, source = self._local_candidate()
        rank, world = self._rank(), self._world()
        best, everyone = self._all_reduce([step, -step], "MAX")
        if best < 0:
            self._apply_policy()
            progress.restored(time.perf_counter() - started, 0)  # a fresh start
            return False
        everyone = -everyone == best  # the MAX of -step is minus the smallest step
        holder = self._all_reduce([rank if step == best else world], "MIN")[0]
        if everyone:
            blob = self._bytes(source)
        else:
            blob = self._broadcast(self._bytes(source) if rank == holder else None, holder)
        try:
            saved = snapshot.parse(blob)
        except snapshot.SnapshotError as e:
            raise CheckpointMismatchError(
                f"the saved state of step {best} is unreadable: {e}"
            ) from None
        self._load(saved)
        self._apply_policy()
        self.stats["restore_seconds"] = time.perf_counter() - started
        self.stats["restore_bytes"] = len(blob)
        self.stats["restored_step"] = best
        progress.restored(self.stats["restore_seconds"], len(blob))
        if self._ctl is not None:
            self._ctl.beat(self._values["step"])
        log.info(
            "restored step %d (from rank %d%s) in %.2fs",
            best,
            holder,
            ", sent over the process group" if not everyone else "",
            self.stats["restore_seconds"],
        )
        return True

    def _broadcast(self, blob: memoryview | None, holder: int) -> memoryview:
        d = self._dist()
        group = self._control_group()
        size = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64)
        d.broadcast(size, src=holder, group=group)
        data = (
            torch.frombuffer(blob, dtype=torch.uint8)
            if blob is not None
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        d.broadcast(data, src=holder, group=group)
        return memoryview(data.numpy())

    def _load(self, saved: dict[str, Any]) -> None:
        objects = saved.get("objects", {})
        missing = sorted(set(self._objects) - set(objects))
        if missing:
            raise CheckpointMismatchError(
                f"saved state has no {missing} (it has {sorted(objects)})"
            )
        for name, obj in self._objects.items():
            _check_fits(name, obj, objects[name])
            try:
                obj.load_state_dict(objects[name])
            except (ValueError, KeyError, RuntimeError) as e:
                raise CheckpointMismatchError(f"saved state does not fit {name!r}: {e}") from None
        self._values.update(saved.get("values", {}))
        self._values["step"] = int(saved["step"])
        self._restore_rng(int(saved["step"]))

    def _restore_rng(self, step: int) -> None:
        dirname = os.environ.get(SNAPSHOT_DIR_ENV)
        path = Path(dirname) / f"rng-rank{self._rank()}.pt" if dirname else None
        if path is not None and path.exists():
            with contextlib.suppress(Exception):
                saved = torch.load(path, weights_only=True)
                if saved.get("step") == step:
                    _set_rng_state(saved["rng"])
                    return
        # this rank's RNG is not here (new node, new ranks): a seed both reproducible
        # and different per rank and per step
        seed = (step * 1_000_003 + self._rank()) % (2**31)
        torch.manual_seed(seed)
        random.seed(seed)
        np = _numpy()
        if np is not None:
            np.random.seed(seed)

    def _apply_policy(self) -> None:
        schedulers = [
            o for o in self._objects.values() if hasattr(o, "base_lrs") and hasattr(o, "optimizer")
        ]
        for s in self._samplers():
            for opt in self._optimizers():
                sched = next((x for x in schedulers if x.optimizer is opt), None)
                s.policy.apply(opt, sched, self._world())

    def flush(self) -> None:
        """Wait for the snapshot copy and the checkpoint write in progress, if any."""
        self._wait_copy()
        if self._writer is not None:
            self._writer.wait()

    def close(self) -> None:
        """Finish background work (the process exiting does the same, less politely)."""
        self.flush()
        for h in self._hooks:
            h.remove()
