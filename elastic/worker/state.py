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
and snapshots by policy or stops to let the job resize, as the ranks agree: in one tiny
all-reduce every few steps (``agreement``), or, under DDP, only when a rank asked in
DDP's own gradient all-reduce (``doorbell``).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from elastic import contract
from elastic.contract import NODE_DIR_ENV, ControlBlock, SnapshotPolicy
from elastic.stored import SnapshotError
from elastic.worker import (
    alive,
    comm,
    group,
    progress,
    quick_exit,
    reshard,
    rng,
    sharded,
    snapshot,
)
from elastic.worker.agreement import Agreement
from elastic.worker.cadence import Cadence, interval_moved
from elastic.worker.doorbell import Doorbell, Rung
from elastic.worker.group import Group, Reformation
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

__all__ = ["CheckpointMismatchError", "Reformation", "SnapshotPolicy", "State"]

T = TypeVar("T")


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _stepping(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose step runs the step hooks: a wrapper's own (accelerate's
    ``AcceleratedOptimizer``) only hands the step to the one it holds."""
    inner = getattr(opt, "optimizer", None)
    return _stepping(inner) if isinstance(inner, torch.optim.Optimizer) else opt


@dataclass
class _Core:
    """Everything ``State`` keeps besides the script's values, on one object: no name a
    script gives a value can shadow it, and none of it is saved."""

    objects: dict[str, Any]  # with state_dict/load_state_dict: models, optimizers...
    values: dict[str, Any]  # plain values, "step" among them
    policy: SnapshotPolicy
    stats: Stats
    cadence: Cadence
    ctl: ControlBlock | None
    node_dir: str | None
    sharded: bool
    snapshotter: Snapshotter
    agreement: Agreement = field(default_factory=Agreement)
    due: bool = False  # a snapshot fell due since the ranks last agreed
    stop_seen: int = 0  # the control block's stop generation already answered
    hooks: list[Any] = field(default_factory=list)
    last_commit: float | None = None  # the cadence's clock at the end of commit()
    disturbed: bool = False  # a snapshot ran into the step now in progress
    logged: int | None = None  # the snapshot interval last logged
    stepped: bool = False  # an optimizer stepped since the last commit()
    group: Group | None = None  # while run() keeps this process through changes
    restored: bool = False
    rebuild: Callable[[], dict[str, Any]] | None = None  # run()'s reshard: sharded, live
    tells: bool = True  # restores tell the agent the step (restore(tell=False): not)
    follows: bool = False  # commits for another State's run() (``follow``)
    delegated: bool = False  # ... and this is that run()'s: a follower holds the state
    disk_step: int = -1  # the step of the sharded checkpoint this State wrote last
    held: reshard.Held | None = None  # the shards kept from a broken group until resync
    kept: reshard.Held | None = None  # the last snapshot of the shards, and a buddy's
    # the samplers and the objects told of each commit, while the objects stay the same
    per_step: tuple[list[ElasticSampler], list[Any]] | None = None
    doorbell: Doorbell = field(init=False)  # the agreement's question, in DDP's reduction

    def __post_init__(self) -> None:
        self.doorbell = Doorbell(self.ringing)
        self.doorbell.watch(self.objects.values())

    @property
    def comm(self) -> comm.ControlGroup:
        return comm.control()

    @property
    def apart(self) -> bool:
        """Sharded state kept live: snapshots keep the shards in memory (and on the next
        node), and the DCP checkpoint goes to the disk at an interval of its own."""
        return self.sharded and self.group is not None

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [_stepping(o) for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)]

    def samplers(self) -> list[ElasticSampler]:
        return self._per_step()[0]

    def committing(self) -> list[Any]:
        """Objects told of each commit (``on_commit()``): what they hold as of the last
        one is what a live re-formation carries on from (a loader's place in its epoch)."""
        return self._per_step()[1]

    def _per_step(self) -> tuple[list[ElasticSampler], list[Any]]:
        """What ``commit()`` touches every step, found once (``replaced`` says when the
        objects change): a getattr a Module does not answer costs an exception."""
        if self.per_step is None:
            objects = self.objects.values()
            self.per_step = (
                [o for o in objects if isinstance(o, ElasticSampler)],
                [o for o in objects if callable(getattr(o, "on_commit", None))],
            )
        return self.per_step

    def replaced(self) -> None:
        """An object was set anew (``state.model = ...``, a reshard)."""
        self.per_step = None
        self.doorbell.watch(self.objects.values())

    def ringing(self) -> Rung:
        """What this rank asks of the ranks at the step in progress (during backward)."""
        g = self.group
        snapshot = bool(self.due or self.cadence.due(self.values["step"] + 1))
        pause = g is not None and g.pause_asked
        return Rung(bool(self.stopping() or pause or self.cadence.asks(snapshot)), snapshot)

    def stopping(self) -> bool:
        return self.ctl is not None and self.ctl.stop_generation != self.stop_seen


class State:
    """Model, optimizer, scheduler, sampler and plain values of a run (see module doc).

    Values are read and set as attributes (``state.epoch``); a name that ``State`` itself
    uses (``commit``, ``run``, ``stats``, ``step``...) is refused when the State is made,
    so a value can never be shadowed by, or shadow, what ``State`` does."""

    _core: _Core

    def __init__(self, snapshot_policy: SnapshotPolicy | None = None, **items: Any) -> None:
        objects: dict[str, Any] = {}
        values: dict[str, Any] = {"step": 0}
        for key, value in items.items():
            if key in RESERVED:
                raise ValueError(
                    f"State: {key!r} is a name State uses itself "
                    f"({'its step counter' if key == 'step' else 'State.' + key}); "
                    "give the value another name"
                )
            (objects if _has_state(value) else values)[key] = value
        policy = snapshot_policy or SnapshotPolicy.from_env()
        every = policy.every
        fixed = None if every == "auto" else int(every)
        if fixed:
            progress.cadence(fixed, 0.0, 0.0, fixed)
        ctl = contract.worker_block()
        if ctl is not None:
            ctl.mark(contract.USES_STATE)
            alive.start(ctl)  # the agent tells a frozen process from a blocked one
        is_sharded = sharded.is_sharded(objects)
        if is_sharded and not policy.checkpoint_dir:
            raise ValueError(
                "sharded state (FSDP2/DTensor) is saved with torch.distributed.checkpoint: "
                "give --checkpoint-dir on a filesystem every node can read"
            )
        node_dir = os.environ.get(NODE_DIR_ENV) or None
        stats = Stats()
        core = _Core(
            objects=objects,
            values=values,
            policy=policy,
            stats=stats,
            cadence=Cadence(policy.budget, fixed),
            ctl=ctl,
            node_dir=node_dir,
            sharded=is_sharded,
            snapshotter=Snapshotter(policy, node_dir, comm.local_rank(), stats),
            stop_seen=ctl.stop_generation if ctl else 0,
        )
        object.__setattr__(self, "_core", core)
        self._hook_optimizers()
        quick_exit.arm()

    def _hook_optimizers(self) -> None:
        """(Again, after ``reshard`` made new optimizers:) their steps wait for the
        snapshot copy, and count as a step in flight."""
        core = self._core
        for h in core.hooks:
            h.remove()
        core.hooks.clear()

        def stepped(*_: Any) -> None:
            core.stepped = True

        for opt in core.optimizers():
            core.hooks.append(
                opt.register_step_pre_hook(lambda *_: core.snapshotter.wait_for_step())
            )
            core.hooks.append(opt.register_step_post_hook(stepped))

    # -- values as attributes ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        core: _Core | None = self.__dict__.get("_core")
        if core is not None:
            if name in core.values:
                return core.values[name]
            if name in core.objects:
                return core.objects[name]
        raise AttributeError(f"State has no value or object {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        core = self._core
        if name in core.values:
            core.values[name] = value
        elif name in core.objects:
            core.objects[name] = value
            core.replaced()
        elif name in RESERVED:
            raise AttributeError(f"State.{name} cannot be set")
        else:
            raise AttributeError(
                f"State has no value {name!r}: name it when making the State "
                f"(State(..., {name}=...)) so that it is saved and restored"
            )

    @property
    def stats(self) -> Stats:
        """What this State did so far: snapshots, checkpoints, restores."""
        return self._core.stats

    @property
    def round(self) -> comm.Round:
        """This worker's place in the round it trains in now (rank, world size, local
        rank, device...): read it inside the training function, as it changes when the
        job re-forms."""
        return comm.Round.now()

    @property
    def policy(self) -> SnapshotPolicy:
        """When it snapshots and checkpoints (``--snapshot-every`` and the others)."""
        return self._core.policy

    # -- commit ---------------------------------------------------------------------------
    def commit(self, loss: float | None = None) -> None:
        """One optimizer step is done: count it, report it (``loss`` too, if given, for
        the metrics), snapshot or stop as the ranks agree."""
        core = self._core
        core.stepped = False
        core.values["step"] += 1
        step = core.values["step"]
        samplers = core.samplers()
        samples = 0
        if samplers:
            before = sum(s.consumed for s in samplers)
            for s in samplers:
                s.advance(1)
            samples = (sum(s.consumed for s in samplers) - before) // max(comm.world(), 1)
        for o in core.committing():
            o.on_commit()  # before any snapshot of this step
        progress.report(step, loss, samples)
        cadence = core.cadence
        now = cadence.clock()
        agreement = core.agreement
        if core.last_commit is not None:
            cadence.observe(now - core.last_commit, core.disturbed)
            agreement.stepped(now - core.last_commit)
        core.due = core.due or cadence.due(step)
        bell = core.doorbell.rang()
        if not agreement.due(step, core.comm.generation, None if bell is None else bell.agree):
            snap = bell is not None and bell.snapshot  # every rank's bell says so alike
            if snap:
                self._snapshot_due(step)
            core.disturbed = snap or core.snapshotter.copying
            core.last_commit = cadence.clock()
            return
        g = core.group
        asked = g is not None and g.pause_asked
        gap = agreement.proposal(cadence.fixed)
        door = core.doorbell
        door.consider(agreement.step_s())  # weighed here, settled in this agreement
        unready = not door.ready
        began = cadence.clock()
        stop, due, interval, pause, least, unfolded, declined, disk = core.comm.all_reduce(
            [
                core.stopping(),
                core.due,
                cadence.proposal,
                asked,
                -gap,
                unready,
                door.declines,
                self._disk_due(step),
            ],
            "MAX",
        )
        agreement.timed(cadence.clock() - began)
        door.settle(bool(declined))
        door.fold(not unfolded)
        core.due = False
        moved = agreement.agreed(step, -least)  # MAX of the negated: the least gap
        if cadence.agree(interval) or moved:
            self._tell_cadence()
        # the ranks stop together; a live one that was not asked to leave pauses instead
        leave = bool(stop or pause) if g is None else bool(stop) and core.stopping()
        if due or stop or pause:  # pausing: the copy overlaps the re-formation
            # a node told to leave takes its memory with it: the disk too (the whole job
            # may be stopping)
            self._snapshot_due(step, wait=leave, disk=bool(disk or stop))
        if leave:
            self._leave_for_resize()
        if stop or pause:
            raise Reformation(f"the ranks paused at step {step} for a membership change")
        core.disturbed = bool(due) or core.snapshotter.copying
        core.last_commit = cadence.clock()

    def _snapshot_due(self, step: int, wait: bool = False, disk: bool = True) -> None:
        """The snapshot the ranks agreed on (or all asked for in the bell): its time in
        ``commit()`` is part of its cost."""
        cadence = self._core.cadence
        began = cadence.clock()
        # a sharded checkpoint beside the snapshot in memory keeps its own interval
        # (``_disk_due``): the snapshots' is what memory costs
        apart = self._snapshot(wait, disk)
        cadence.blocked(cadence.clock() - began - apart)
        self._core.due = False

    def _tell_cadence(self) -> None:
        """The ranks agreed on a new interval or gap: logged (rank 0) and exported, with
        the steps a crash can cost (a due snapshot waits for the next agreement)."""
        core = self._core
        cadence, gap = core.cadence, core.agreement.gap
        folded = core.doorbell.active
        late = 0 if cadence.fixed or folded else gap - 1  # a fixed interval's gap divides it
        risk = cadence.at_risk + late if cadence.at_risk else 0
        progress.cadence(cadence.interval, cadence.cost_s or 0.0, cadence.step_s or 0.0, risk)
        if not interval_moved(core.logged, cadence.interval) or comm.rank() != 0:
            return  # the log shows the first choice and moves of 2x; the metrics all
        core.logged = cadence.interval
        why = cadence.choice.reason if cadence.choice else "no measurements here yet"
        if cadence.choice and cadence.choice.interval != cadence.interval:
            why += f" here; another rank's figures asked for every {cadence.interval}"
        if folded:
            why += "; the ranks learn whether to agree in DDP's gradient all-reduce"
        elif gap > 1:
            why += f"; the ranks agree every {gap} steps: {core.agreement.choice.reason}"
        verdict = core.doorbell.verdict
        if not folded and verdict is not None and not verdict.pays:
            why += f" ({verdict.reason})"
        log.info(
            "snapshot every %d step(s), at most %d step(s) lost to a crash: %s",
            cadence.interval,
            risk,
            why,
        )

    def heartbeat(self) -> None:
        """Progress without a step (a long evaluation): keeps the hang detector quiet."""
        progress.report()

    def _leave_for_resize(self) -> None:
        core = self._core
        core.snapshotter.flush(timeout=60)
        log.info("stopping at step %d for a resize", core.values["step"])
        if core.ctl is not None:  # the others need not wait for this process to end
            core.ctl.leaving()
        raise SystemExit(contract.EXIT_RESIZE)

    # -- live re-formation ----------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        reshard: Callable[[], dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> T:
        """Restore (unless ``restore()`` ran already), then return ``fn(*args, **kwargs)``.

        Under elastic-run (``--restart-mode live``, the default) a membership change does
        not end the process: ``fn`` is left (by the exception of the collective that failed,
        or by ``commit()`` when the ranks pause together), the new process group forms, the
        ranks agree on the newest committed state (a rank behind, or a newcomer, gets it
        from a rank that has it) and ``fn`` is called again. Anywhere else (torchrun, plain
        python, ``--restart-mode respawn``) it is called once.

        Sharded state (FSDP2, HSDP) is bound to the group it was sharded over, so it is
        kept live only with ``reshard``: a function that shards the model over the
        current group and returns the objects to replace by name (the model, its
        optimizer, anything holding either, as a scheduler does); after a change
        ``State`` calls it and moves the shards into what it returns, from the ranks'
        memory where it holds the step whole, else from the checkpoint directory. Read
        the objects from ``state`` inside ``fn`` (``state.model``)."""
        from torch.nn.parallel import DistributedDataParallel

        core = self._core
        for name, obj in core.objects.items():
            if isinstance(obj, DistributedDataParallel):
                raise ValueError(
                    f"State.run: {name!r} is a DistributedDataParallel. Give State the module "
                    f"inside it and wrap that in DDP inside {getattr(fn, '__name__', 'fn')}(): "
                    "DDP holds the process group, which a re-formation replaces"
                )
        core.rebuild = reshard
        g = self._go_live()
        try:
            while True:
                try:
                    if g is not None and g.abandoned.is_set():  # while the script built
                        raise Reformation("the round was given up before State.run")
                    if not core.restored:  # inside: a change during it is one more change
                        self.restore()
                    return fn(*args, **kwargs)
                except BaseException as e:
                    if g is None or not g.breaks(e):
                        raise
                    self._reform(g, e)
        finally:
            group.detach()
            core.group = None

    def _go_live(self) -> Group | None:
        core = self._core
        if comm.dist() is None:
            return None
        if core.sharded:
            why = (
                "no reshard function was given to State.run"
                if core.rebuild is None
                else reshard.unsupported(core.objects)
            )
            if why is not None:
                log.info("sharded state takes the respawn path: %s", why)
                return None
        g = group.attach(core.ctl)
        if g is not None and g.reformations == 0:
            g.adopt()  # the group the script formed itself
        core.group = g
        return g

    def follow(self, run: State) -> str | None:
        """Commit for ``run``, whose ``run()`` keeps this process through membership
        changes while a framework makes this State's sharded objects anew in each call of
        its function (Lightning's Trainer shards the model as it sets up): pauses become
        re-formations of that run's group, and each snapshot also keeps the shards in host
        memory and on the next node (``held_shards`` hands them to the next State).
        Returns why it cannot (the state is not sharded, or not so that memory can
        re-shard it, or ``run`` is not kept live): the process then ends with the group."""
        core = self._core
        why = reshard.unsupported(core.objects) if core.sharded else "the state is not sharded"
        if why is None and run._core.group is None:
            why = "the run is not kept live"
        if why is None:
            core.group, core.follows = run._core.group, True
            run._core.delegated = True
        return why

    def held_shards(self, live: bool) -> reshard.Held | None:
        """What this rank holds of the sharded state, for the State that replaces this
        one after a re-formation (``restore(held=...)``); call it before the objects are
        torn down. ``live`` (the caller kept the rest of its state as of the last commit):
        the objects' rows as they are, at the step last committed, besides the last
        snapshot's copies (this rank's and the previous node's); not where an optimizer
        stepped after the commit (its rows are a step ahead of the rest). None: nothing
        held."""
        core = self._core
        core.snapshotter.wait_copy()
        if not core.sharded:
            return None
        if not live or core.stepped:
            return core.kept
        return self._live_shards()

    def _live_shards(self) -> reshard.Held:
        """This rank's shards as they are, at the step committed (views, no copy), and the
        last snapshot's copies beside them."""
        core = self._core
        return reshard.capture(core.objects, core.values, core.values["step"]) + core.kept

    def _reform(self, g: Group, why: BaseException) -> None:
        """Leave the broken group, form the next one, agree on the state (see
        ``Group.reform``); save and exit instead if this node leaves meanwhile."""
        started = time.perf_counter()
        if not isinstance(why, Reformation) and not g.abandoned.is_set():
            text = str(why).strip().splitlines()[0][:200] if str(why).strip() else ""
            log.warning(
                "rank %d: collective failed (%s: %s); waiting for the agent",
                comm.rank(),
                type(why).__name__,
                text,
            )
        step = g.reform(self._drop_step_in_flight, self._resync, self._core.stopping)
        if step is None:  # this node leaves meanwhile
            # sharded (here or in a follower): a save is collective; its group is gone;
            # not yet restored (it left in its first restore): its state is nobody's step
            if self._core.restored and not (self._core.sharded or self._core.delegated):
                self.snapshot(wait=True)
            self._leave_for_resize()
        log.info(
            "re-formed live: rank %d of %d %s in %.2fs (re-formation %d)",
            comm.rank(),
            comm.world(),
            "(a follower restores its state)" if self._core.delegated else f"at step {step}",
            time.perf_counter() - started,
            g.reformations,
        )

    def _drop_step_in_flight(self) -> None:
        """Between leaving a group and forming the next: nothing may read the tensors a
        load rewrites; a step whose optimizer ran but whose commit() did not is counted,
        not redone; the gradients of the step in flight go."""
        core = self._core
        core.snapshotter.wait_copy()
        core.doorbell.forget()  # its DDP holds the old group
        if core.stepped:
            core.stepped = False
            core.values["step"] += 1
            for s in core.samplers():
                s.advance(1)
        for opt in core.optimizers():
            opt.zero_grad(set_to_none=True)
        if core.sharded and core.held is None and core.restored:  # kept until a resync
            core.held = self._live_shards()

    def _resync(self) -> int:
        """Every rank offers the state it holds; the newest goes to those behind. An object
        whose ``live_state`` is False (a framework's whole checkpoint, which a step cut
        short leaves half-done) is offered as of this node's newest snapshot."""
        core = self._core
        if not core.restored:  # the group broke in the first restore: it is done again
            if core.sharded:
                self._shard_again()
            self.restore()
            return int(core.values["step"])
        if core.sharded:
            return self._resync_sharded()
        mine = (
            Candidate(step=core.values["step"], in_memory=lambda: snapshot.to_bytes(self._state()))
            if all(getattr(o, "live_state", True) for o in core.objects.values())
            else None  # an object read only at a step boundary: the newest snapshot instead
        )
        step, nbytes = self._restore_snapshot(mine)
        core.stats.restore_bytes = nbytes
        self._apply_batch_policy()
        if core.ctl is not None and core.tells:
            core.ctl.beat(step)
            core.ctl.restored(step)
        return step

    # -- snapshots ------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "version": 1,
            "step": self._core.values["step"],
            "values": dict(self._core.values),
            "objects": {k: o.state_dict() for k, o in self._core.objects.items()},
        }

    def snapshot(self, wait: bool = False) -> None:
        """Take a snapshot now (commit() does this by policy). Collective when sharded.
        ``wait``: copy everything before returning (the process is about to stop)."""
        self._snapshot(wait, disk=True)

    def _snapshot(self, wait: bool, disk: bool) -> float:
        """``snapshot``; ``disk=False``: sharded state kept live goes to memory only (the
        ranks agreed so: ``_disk_due``). Returns the seconds a sharded checkpoint written
        beside the snapshot in memory took (0: none)."""
        step = self._core.values["step"]
        apart = self._core.apart  # kept live: by run(reshard=...), or follow()
        self._core.cadence.taken(step, apart)
        rng.save(self._core.node_dir, comm.rank(), step)
        if self._core.sharded:
            if apart:
                self._keep_sharded(step)
            took = self._save_sharded(step, counted=not apart) if disk or not apart else 0.0
            return took if apart else 0.0
        stable = set() if wait else stable_storage(self._core.optimizers())
        frozen = frozen_storage(
            o for o in self._core.objects.values() if isinstance(o, torch.nn.Module)
        )
        rank0 = comm.rank() == 0
        self._core.snapshotter.take(
            self._state(),
            step,
            stable,
            frozen,
            checkpoint=lambda: rank0 and self._core.snapshotter.due_checkpoint(wait),
        )
        return 0.0

    def _keep_sharded(self, step: int) -> None:
        """The shards copied to host memory, and to the next node (``reshard.keep``): a
        node lost while live leaves its rows on the next one."""
        started = time.perf_counter()
        core = self._core
        distance = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        core.kept = None  # the copy it replaces goes first: the memory is needed
        core.kept = reshard.keep(core.objects, core.values, step, distance)
        core.stats.snapshot_bytes = sum(
            p.tensor.numel() * p.tensor.element_size() for p in core.kept.pieces
        )
        took = time.perf_counter() - started
        core.stats.snapshots += 1
        core.stats.snapshot_seconds = took
        log.debug("sharded snapshot of step %d in %.3fs", step, took)

    def _disk_due(self, step: int) -> bool:
        """This rank's say on whether a snapshot at ``step`` also writes the sharded
        checkpoint (the ranks take the MAX: any rank that wants it gets it, so all write
        together, as DCP needs). Only sharded state kept live can skip it
        (``Cadence.disk_due``: memory keeps every snapshot, the disk at the interval its
        own cost allows); anything else is written every time."""
        core = self._core
        if not core.apart:
            return True
        return core.cadence.disk_due(step, core.disk_step, core.stats.checkpoint_seconds)

    def _save_sharded(self, step: int, counted: bool = True) -> float:
        """The DCP checkpoint of the shards (``counted``: it is the snapshot too, where
        memory keeps none); its seconds (0: it failed)."""
        started = time.perf_counter()
        directory = Path(str(self._core.policy.checkpoint_dir))
        try:
            sharded.save(
                directory, step, self._core.objects, self._core.values, self._core.policy.keep
            )
        except Exception as e:  # DCP raises its own exception types, on every rank
            self._core.stats.checkpoint_failures += 1
            progress.checkpoint(False, 0.0, 0)
            log.error("sharded checkpoint of step %d failed; training goes on: %s", step, e)
            return 0.0
        stats = self._core.stats
        took = time.perf_counter() - started
        stats.checkpoints += 1
        stats.checkpoint_seconds = took
        if counted:
            stats.snapshots += 1
            stats.snapshot_seconds = took
        self._core.disk_step = step
        return took

    # -- restore --------------------------------------------------------------------------
    def restore(self, tell: bool = True, held: reshard.Held | None = None) -> bool:
        """Load the newest state in the job; False (nothing loaded) on a fresh start.
        Every rank must call it, at the same point of the script. ``tell=False``: the
        agent learns the step resumed from later, from ``resumed_from`` (a framework
        that may resume from a file of its own instead), this time and after each live
        re-formation. ``held``: sharded state kept from the objects this State's replace
        (``held_shards`` of the State that held them), re-sharded from memory where the
        ranks hold a whole step of it."""
        started = time.perf_counter()
        nbytes = 0
        self._core.tells = tell
        if self._core.sharded:
            step = self._restore_sharded(held)
        else:
            step, nbytes = self._restore_snapshot()
        took = time.perf_counter() - started
        self._core.restored = True
        self._core.stats.restore_seconds = took
        self._core.stats.restore_bytes = nbytes
        progress.restored(took, nbytes)
        self._apply_batch_policy()
        if step >= 0:
            self._core.stats.restored_step = step
        if tell:
            self.resumed_from(step)
        return step >= 0

    def resumed_from(self, step: int) -> None:
        """Training goes on from ``step`` (-1: from the start): the step counter and the
        agent learn it (the agent says when that is older than what its node committed)."""
        if step >= 0:
            self._core.values["step"] = step
        ctl = self._core.ctl
        if ctl is not None:
            if step >= 0:
                ctl.beat(step)
            ctl.restored(step)

    def _restore_snapshot(self, mine: Candidate | None = None) -> tuple[int, int]:
        """(step restored or -1, bytes loaded). ``mine``: what this rank offers (default:
        the newest state it can read); a rank offering what it holds in memory
        (``in_memory``) and as new as the newest loads nothing."""
        started = time.perf_counter()
        policy = self._core.policy
        if mine is None:
            mine = local_candidate(
                self._core.node_dir,
                self._core.snapshotter.slots,
                policy.checkpoint_dir,
                policy.keep,
                comm.local_rank(),
            )
        rank, world = comm.rank(), comm.world()
        best, lowest = self._core.comm.all_reduce([mine.step, -mine.step], "MAX")
        if best < 0:
            return -1, 0
        everyone = -lowest == best  # the MAX of -step is minus the smallest step
        holder = self._core.comm.all_reduce([rank if mine.step == best else world], "MIN")[0]
        if everyone and mine.in_memory is not None:
            return best, 0  # every rank holds the newest state already
        if everyone:
            blob = mine.read()
        else:
            if mine.step < best:  # a long pause of a large state is seen for what it is
                log.info("rank %d: receiving step %d from rank %d", rank, best, holder)
            blob = self._core.comm.broadcast(mine.read() if rank == holder else None, holder)
            if mine.in_memory is not None and mine.step == best:
                return best, 0
        try:
            saved = snapshot.parse(blob)
        except SnapshotError as e:
            raise CheckpointMismatchError(
                f"the saved state of step {best} is unreadable: {e}"
            ) from None
        load_into(self._core.objects, saved)
        self._core.values.update(saved.get("values", {}))
        self._core.values["step"] = int(saved["step"])
        self._core.snapshotter.keep(best, blob)
        rng.restore(self._core.node_dir, rank, best)
        sent = ", sent over the process group" if not everyone else ""
        took = time.perf_counter() - started
        log.info("restored step %d (from rank %d%s) in %.2fs", best, holder, sent, took)
        return best, len(blob)

    def _resync_sharded(self) -> int:
        """Shard the model again over the new group (the script's ``reshard``) and fill it
        from what the ranks hold (see ``_restore_sharded``)."""
        core = self._core
        assert core.held is not None
        self._shard_again()
        had = core.held.step
        step = self._restore_sharded(core.held)
        core.held = None
        if step < had:  # the agent says so too, once for its node
            log.info(
                "rank %d: sharded state resumes from step %d, %d step(s) before the step "
                "this rank had reached (%d): those are trained again",
                comm.rank(),
                step,
                had - step,
                had,
            )
        if core.ctl is not None and core.tells:
            core.ctl.beat(max(step, 0))
            core.ctl.restored(step)
        return step

    def _shard_again(self) -> None:
        """Put in place of the sharded objects what the script's ``reshard()`` cuts over
        the current group (its optimizers hooked as the first ones were)."""
        assert self._core.rebuild is not None  # sharded state is live only with one
        reshard.forget_old_meshes()
        reshard.replace(self._core.objects, self._core.rebuild())
        self._core.replaced()
        self._hook_optimizers()

    def _restore_sharded(self, held: reshard.Held | None = None) -> int:
        """The newest state the ranks' memory holds whole (``held``: this rank's shards
        from the group before), re-sharded over this group; else the newest DCP
        checkpoint in the checkpoint directory."""
        started = time.perf_counter()
        directory = Path(str(self._core.policy.checkpoint_dir))
        mine = sharded.complete_steps(directory)[:1] if comm.rank() == 0 else []
        outcome = reshard.exchange(
            self._core.objects, self._core.values, held, mine[0] if mine else NOTHING.step
        )
        took = time.perf_counter() - started
        if outcome.source == "memory":
            log.info(
                "rank %d: re-sharded step %d in memory (%d row(s) sent) in %.2fs",
                comm.rank(),
                outcome.step,
                outcome.sent,
                took,
            )
            return outcome.step
        if held is not None:
            log.warning("rank %d: sharded state: %s", comm.rank(), outcome.reason)
        best = outcome.step
        if best < 0:
            if held is not None:
                raise RuntimeError(
                    f"the sharded state of step {held.step} cannot be rebuilt "
                    f"({outcome.reason}) and {directory} holds no checkpoint: "
                    "new workers start over"
                )
            return -1
        try:
            values = sharded.load(directory, best, self._core.objects, self._core.values)
        except Exception as e:  # DCP's own errors: missing keys, wrong shapes
            raise CheckpointMismatchError(
                f"sharded checkpoint of step {best} does not fit: {e}"
            ) from None
        self._core.values.update(values)
        self._core.values["step"] = best
        rng.restore(self._core.node_dir, comm.rank(), best)
        return best

    def _apply_batch_policy(self) -> None:
        schedulers = [
            o
            for o in self._core.objects.values()
            if hasattr(o, "base_lrs") and hasattr(o, "optimizer")
        ]
        for s in self._core.samplers():
            for opt in self._core.optimizers():
                sched = next((x for x in schedulers if x.optimizer is opt), None)
                s.policy.apply(opt, sched, comm.world())

    def flush(self) -> None:
        """Wait for the snapshot copy and the checkpoint write in progress, if any."""
        self._core.snapshotter.flush()

    def close(self) -> None:
        """Finish background work (the process exiting does the same, less politely)."""
        self._core.snapshotter.close()
        progress.flush()
        for h in self._core.hooks:
            h.remove()
        if not self._core.follows:  # a follower's run() goes on: the next one follows it
            alive.stop()  # training is over: what follows is not judged for hangs


# names a value cannot take: what State itself answers to (its step counter included)
RESERVED = frozenset(
    {"step", "snapshot_policy"} | {n for n in vars(State) if not n.startswith("_")}
)
