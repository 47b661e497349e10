"""Lightning on ``elastic.State``: one callback, and a restart resumes at the last step.

    trainer = L.Trainer(strategy="ddp", callbacks=[ElasticLightning()], ...)

Lightning already knows how to save and restore everything a run holds: its own
checkpoint (``dump_checkpoint``) has the model, optimizers, schedulers, precision,
callbacks and the loops' progress, and its loops resume mid-epoch from it. So the
callback does not collect state itself. After each optimizer step it hands ``State`` the
checkpoint as one object, and ``State`` snapshots it into the node's shared memory
when its cost policy says (``--snapshot-every``). On a restart it finds the newest
snapshot anywhere in the job and gives it to Lightning as the checkpoint to resume from
(a ``ckpt_path`` the script passes wins only when it is newer: its step is peeked at
without loading its tensors, and the file is read only then).

The data position is what Lightning cannot resume by itself: a plain ``DataLoader``
starts its epoch over (Lightning warns), and after a resize the ``DistributedSampler``
it injects would split the epoch differently. The callback swaps that sampler for
``ResumableSampler``: the same order and the same split as long as the world size stays
(a run without faults is unchanged), and after a restart it splits only the part of the
epoch not yet trained on over the new world. Its position is in Lightning's checkpoint
too (as a stateful loader's), so Lightning's own checkpoint files resume exactly as well.

Lightning's DDP holds the process group, so a Trainer serves one round: with ``trainer
.fit`` a membership change restarts the workers; with ``ElasticLightning.run(fit)``
(``fit`` makes a Trainer and fits) the process group re-forms in the same process and
``fit`` runs again from the newest committed state: the last fit's own, kept in memory,
where no rank holds a newer one (``State.run``).

``ModelParallelStrategy`` (FSDP2) shards the model and optimizer state, so no rank holds
a checkpoint another could load. Given ``--checkpoint-dir`` (a directory every node
reads), its snapshots are ``State``'s sharded ones: DCP checkpoints of the shards, with
the rest of Lightning's checkpoint beside them (``_Rest``), at the interval the cost
policy chooses; a restart loads the newest, re-sharded over the new world size by DCP.
Under ``run()`` the workers are kept here too, where ``fit`` makes the LightningModule
(a sharded one is cut over each round's group; one made before ``run()``, or kept by
``fit``, gives new workers at each change, as before: ``made_anew``): each snapshot
also copies the shards to
host memory and to the next node; a fault keeps the shards and the rest as of the last
commit (``State.held_shards``), and the next Trainer's ``State`` re-shards the newest
step the ranks' memory holds whole over the new group (``State.follow``,
``restore(held=...)``), reading the disk only where memory holds none. FSDP
(``FSDPStrategy``, FSDP1) gets the same DCP snapshots of its shards (``get_state_dict``
reads FSDP1's flat parameters as shards DCP re-shards), but FSDP1's shards cannot be
re-sharded in memory: a change gives new workers, which load the newest snapshot.
DeepSpeed keeps its own format: the callback stands aside and Lightning resumes from its
own checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import io
import logging
import math
import weakref
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from elastic.contract import SnapshotPolicy
from elastic.integrations._group import ensure_group
from elastic.worker import comm, group, rng
from elastic.worker.reshard import Held, forget_old_meshes
from elastic.worker.sharded import complete_steps, is_sharded
from elastic.worker.state import State

log = logging.getLogger("elastic.lightning")

__all__ = ["ElasticLightning", "ResumableSampler"]

T = TypeVar("T")
K = TypeVar("K")

_KEY = "elastic_position"  # marks this sampler's state among a checkpoint's loader states


class ResumableSampler(Sampler[int]):
    """``DistributedSampler``'s order and split, resumable after any number of samples
    and over a different world size.

    The epoch's order is the same permutation ``DistributedSampler`` draws; ``start`` of
    its positions were trained on before this iteration (all ranks together), and the
    rest is padded or cut to a multiple of the world size and dealt out rank by rank, as
    ``DistributedSampler`` deals the whole. ``len`` is always a whole epoch's at this
    world size, so Lightning, which counts an epoch's batches once, counts every epoch
    right; a resumed iteration yields the last ``len`` - ``offset`` batches of it.
    """

    def __init__(self, base: DistributedSampler, batch_size: int, drop_batch: bool) -> None:
        self.n = len(base.dataset)  # type: ignore[arg-type]
        self.num_replicas, self.rank = base.num_replicas, base.rank
        self.shuffle, self.seed, self.drop_last = base.shuffle, base.seed, base.drop_last
        self.batch_size, self.drop_batch = batch_size, drop_batch  # the DataLoader's
        self.epoch = base.epoch
        self.start = 0
        self.offset = 0  # the batches of the epoch this iteration does not yield

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.start, self.offset = epoch, 0, 0

    def _share(self, start: int) -> int:
        """Samples per rank when the epoch's positions from ``start`` on are dealt out."""
        left = max(self.n - start, 0)
        return left // self.num_replicas if self.drop_last else -(-left // self.num_replicas)

    def _batches(self, samples: int) -> int:
        return samples // self.batch_size if self.drop_batch else -(-samples // self.batch_size)

    def _rest(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        rest = order[self.start :]
        world = self.num_replicas
        if self.drop_last:
            return rest[: len(rest) // world * world]
        pad = -len(rest) % world
        if pad and rest:
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._rest()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self._share(0)

    def state(self, batches: int) -> dict[str, int]:
        """The position once the loop has counted ``batches`` batches of this epoch."""
        trained = (batches - self.offset) * self.batch_size * self.num_replicas
        return {
            _KEY: 1,
            "epoch": self.epoch,
            "consumed": min(self.start + max(trained, 0), self.n),
            "batches": batches,
        }

    def load(self, state: dict[str, int]) -> None:
        """Go to ``state``'s position: ``offset`` becomes the batches of a whole epoch at
        this world size less those left, which the loop's count must then say."""
        self.epoch, self.start = state["epoch"], state["consumed"]
        self.offset = self._batches(self._share(0)) - self._batches(self._share(self.start))


class _Checkpoint:
    """Lightning's whole checkpoint as the one object ``State`` saves and loads.

    Live (``ElasticLightning.run``), a fault that ends a fit keeps it as of the last
    commit (``kept``), for the next Trainer or a rank behind: the cut step died in its
    gradients' all-reduce, before the optimizer, so the model and optimizers are still
    the committed step's; what moves on between a commit and the next all-reduce (the
    loops' progress, the schedulers, the callbacks' states: the batch's end, validation,
    the epoch's end) is taken as ``committed`` at the commit. Without it (before a
    Trainer's first commit, or if keeping failed) ``live_state`` is False: a live
    re-formation takes the newest snapshot."""

    def __init__(self, trainer: pl.Trainer | None, live: bool = False) -> None:
        self.trainer = trainer
        self.live = live
        self.loaded: dict[str, Any] | None = None
        self.committed: dict[str, Any] | None = None
        self.kept: dict[str, Any] | None = None

    @property
    def live_state(self) -> bool:
        return self.kept is not None

    def on_commit(self) -> None:
        """Live, note the moving parts of the checkpoint as of this step (``State`` calls
        this at each commit; small: counters, scheduler and callback states)."""
        if self.live and self.trainer is not None:
            self.committed = _moving_parts(self.trainer)

    def keep(self) -> None:
        """A fault ends the fit: keep the checkpoint of the last commit, while the Trainer
        is still whole (before its teardown)."""
        kept = _as_committed(self._dump, self.committed, lambda ckpt: ckpt)
        if kept is not None:
            self.kept = kept

    def state_dict(self) -> dict[str, Any]:
        return self.kept if self.kept is not None else self._dump()

    def _dump(self) -> dict[str, Any]:
        assert self.trainer is not None, "no Trainer is fitting"
        return _restorable(self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False))

    def load_state_dict(self, ckpt: dict[str, Any]) -> None:
        self.loaded = ckpt


def _moving_parts(t: pl.Trainer) -> dict[str, Any]:
    """What of a Lightning checkpoint moves on after an optimizer step, before the next
    step's first collective: noted at each commit, so that a fault in that step leaves
    the checkpoint of the step committed (with the model and optimizers, which the cut
    step did not reach)."""
    return copy.deepcopy(
        {
            "epoch": t.current_epoch,
            "global_step": t.global_step,
            "loops": t._checkpoint_connector._get_loops_state_dict(),
            "callbacks": call._call_callbacks_state_dict(t),
            "lr_schedulers": [c.scheduler.state_dict() for c in t.lr_scheduler_configs],
        }
    )


def made_anew(module: object, before: Collection[object], fit: Callable[..., Any]) -> bool:
    """Whether ``fit`` makes ``module`` anew at each call, as far as can be told: it was
    not alive before ``run()`` began, and ``fit`` cannot find it again (it is not in
    fit's closure, globals, bound object or partial arguments, where a module made once
    and cached is kept). A sharded module is cut over one group, so only then can the
    workers be kept through a change."""
    if module in before:
        return False
    places: list[Any] = []
    f: Any = fit
    while isinstance(f, functools.partial):
        places += [*f.args, *f.keywords.values()]
        f = f.func
    for cell in getattr(f, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # a cell not filled yet
            places.append(cell.cell_contents)
    places += getattr(f, "__globals__", {}).values()
    bound = getattr(f, "__self__", None)
    if bound is not None:
        places += [bound, *getattr(bound, "__dict__", {}).values()]
    return not any(p is module for p in places)


def _as_committed(
    dump: Callable[[], dict[str, Any]],
    committed: dict[str, Any] | None,
    pack: Callable[[dict[str, Any]], K],
) -> K | None:
    """The checkpoint as of the last commit, packed: what ``dump`` gives now (the model
    and optimizers, which the cut step did not reach) with the moving parts noted at that
    commit (``_moving_parts``). None where nothing was committed, or it cannot be had (a
    hook that needs the broken group, say): the snapshots serve instead."""
    if committed is None:
        return None
    try:
        return pack({**dump(), **copy.deepcopy(committed)})
    except Exception as e:
        log.warning("could not keep the state of the last step in memory: %s", e)
        return None


def _restorable(ckpt: dict[str, Any]) -> dict[str, Any]:
    """What a restart reads back is loaded without running code (weights_only): the
    hyperparameters serve load_from_checkpoint, not a resume, and may be any object."""
    for key in ("hyper_parameters", "hparams_name", "datamodule_hyper_parameters"):
        ckpt.pop(key, None)
    return ckpt


class _Rest:
    """Lightning's checkpoint but the shards, beside them in a sharded snapshot (``State``
    saves the model's and optimizers' shards with DCP, which re-shards them on load): the
    loops' progress (the loader's position among them), callbacks, schedulers, precision
    and what the hooks add. One opaque value to DCP (its bytes), so that the restore's
    template need not have the saved structure (loops grow keys as they run). Until
    ``ready`` (training started) it is that template. ``live`` (``run()``): as
    ``_Checkpoint``, a fault keeps it as of the last commit (``keep``), beside the shards
    the next Trainer's State re-shards from memory."""

    def __init__(self, trainer: pl.Trainer, live: bool = False) -> None:
        self.trainer = trainer
        self.live = live
        self.ready = False
        self.loaded: dict[str, Any] | None = None
        self.committed: dict[str, Any] | None = None
        self.kept: bytes | None = None

    def on_commit(self) -> None:
        if self.live and self.ready:
            self.committed = _moving_parts(self.trainer)

    def keep(self) -> None:
        """A fault ends the fit: keep the rest as of the last commit (see ``_Checkpoint``)."""
        kept = _as_committed(self._dump, self.committed, self._pack)
        if kept is not None:
            self.kept = kept

    def state_dict(self) -> dict[str, Any]:
        if not self.ready:
            return {"checkpoint": b""}
        if self.kept is not None:
            return {"checkpoint": self.kept}
        return {"checkpoint": self._pack(self._dump())}

    def _dump(self) -> dict[str, Any]:
        strategy = self.trainer.strategy
        # the shards are State's to save: Lightning's own state dicts of them would copy
        # every shard to the CPU (its cpu_offload) only to be thrown away here
        strategy.lightning_module_state_dict = dict
        strategy.optimizer_state = lambda _optimizer: {}
        try:
            ckpt: dict[str, Any] = self.trainer._checkpoint_connector.dump_checkpoint(
                weights_only=False
            )
        finally:
            del strategy.lightning_module_state_dict, strategy.optimizer_state
        ckpt.pop("state_dict", None)
        ckpt.pop("optimizer_states", None)
        return ckpt

    @staticmethod
    def _pack(ckpt: dict[str, Any]) -> bytes:
        buf = io.BytesIO()
        torch.save(_restorable(ckpt), buf)
        return buf.getvalue()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        raw = saved.get("checkpoint", b"")
        self.loaded = torch.load(io.BytesIO(raw), weights_only=True) if raw else None


def sharded(strategy: object) -> str | None:
    """The name of a strategy whose checkpoint is not every rank's whole state (FSDP,
    ModelParallel, DeepSpeed: rank 0's alone, or each rank's shard), None for those whose
    is (DDP, one device): only those can be snapshotted as one object and sent to a rank
    that lacks it."""
    if isinstance(strategy, SingleDeviceStrategy):
        return None
    if isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy):
        return None
    return type(strategy).__name__


def shards_dir(strategy: object, checkpoint_dir: str | None) -> str | None:
    """Where a sharded strategy's snapshots go: ModelParallel's shards (FSDP2's DTensors)
    and FSDP's (FSDP1's flat parameters, as ``get_state_dict`` reads them), which DCP
    saves and re-shards, to ``checkpoint_dir`` (``--checkpoint-dir``), where given; None:
    no snapshots (DeepSpeed keeps a format of its own)."""
    if not isinstance(strategy, ModelParallelStrategy | FSDPStrategy):
        return None
    return checkpoint_dir or None


def reads_file(snapshot: int, peeked: int) -> bool:
    """Whether the checkpoint file a script passes (``ckpt_path``) is read beside a
    snapshot of step ``snapshot`` that every rank holds whole (DDP): only where its step,
    peeked without loading its tensors (``_file_step``), is newer, or could not be peeked
    (-1: Lightning reads it, and says what is wrong with it). A live round's snapshot is
    usually the newer: the file is not read, however large."""
    return peeked < 0 or peeked > snapshot


def from_snapshot(snapshot: int, file: int) -> bool:
    """Resume from the newest snapshot of the shards (its step; -1: none) rather than the
    checkpoint file the script passes (its step; -1: none): only where it is newer."""
    return snapshot >= 0 and snapshot > file


def _file_step(path: str | Path | None) -> int:
    """The global step of the checkpoint a script resumes from (a Lightning sharded one is
    a directory with its metadata in ``meta.pt``); -1: none, or unreadable (Lightning
    then says what is wrong with it)."""
    if not path:
        return -1
    p = Path(path)
    f = p / "meta.pt" if p.is_dir() else p
    try:
        try:  # the step alone: the tensors stay on disk
            meta = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
        except RuntimeError:  # a file in torch's legacy format cannot be mapped
            meta = torch.load(f, map_location="cpu", weights_only=False)
        return int(meta.get("global_step", -1))
    except Exception as e:  # whatever a file may hold: Lightning reads it itself
        log.debug("could not read the step of %s: %s", path, e)
        return -1


def _loader_state(ckpt: dict[str, Any]) -> dict[str, int] | None:
    fit = ckpt.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    for state in fit.get("combined_loader", []):
        if isinstance(state, dict) and state.get(_KEY):
            return state
    return None


class ElasticLightning(Callback):
    """Snapshots Lightning's checkpoint through ``elastic.State`` after optimizer steps
    and resumes from the newest one (see the module doc). Under torchrun or plain python
    it changes nothing but the sampler (same order) and its saved position."""

    def __init__(self, snapshot_policy: SnapshotPolicy | None = None) -> None:
        self._policy = snapshot_policy
        self._state: State | None = None
        self._checkpoint: _Checkpoint | None = None
        self._position: dict[str, int] | None = None  # to resume the train loader at
        self._committed = 0  # the global step last committed
        self._rng: dict[str, Any] | None = None  # the restored RNG states, until training
        self._unwrap: list[Callable[[], None]] = []  # puts the strategy's methods back
        self._live = False  # inside run(): the State outlives each fit
        self._keeps = False  # ... and this fit's sharded model is kept live through changes
        self._before: weakref.WeakSet[pl.LightningModule] = weakref.WeakSet()  # see run()
        self._fit: Callable[..., Any] = lambda: None  # run()'s: where it may keep a module
        self._aside = False  # a sharded strategy: no snapshot of the whole checkpoint
        self._shards: State | None = None  # ModelParallel's: DCP snapshots of the shards
        self._rest: _Rest | None = None  # beside them, the rest of the checkpoint
        self._held: Held | None = None  # run(): the shards a fault left, for the next fit

    # -- start: restore --------------------------------------------------------------------
    def run(self, fit: Callable[[], T], backend: str | None = None) -> T:
        """Keep the workers through membership changes: ``fit()`` makes a Trainer with
        this callback and fits it; after a change the process group re-forms in this
        process and ``fit()`` is called again, resuming from the newest snapshot in the
        job (``State.run``). Anywhere but elastic-run's live mode it is called once.

        The process group must exist before the first fit, to be re-formed: under a
        launcher it is made here with ``backend`` (default: as Lightning picks for
        ``accelerator="auto"``: NCCL where this local rank has a GPU, else gloo; a CPU
        Trainer on a GPU machine passes "gloo"), and every Trainer finds it made."""
        ensure_group(backend)
        self._fit = fit
        self._checkpoint = _Checkpoint(None, live=True)
        self._state = State(self._policy, lightning=self._checkpoint)
        self._live = True
        # a sharded model is cut over one group: one made before run() is passed to every
        # fit, so its run keeps no workers (one made in fit() is made anew each time)
        self._before = weakref.WeakSet(  # type(), not isinstance: that asks every object
            o  # for its __class__, and some warn (torch.distributed.reduce_op)
            for o in gc.get_objects()
            if issubclass(type(o), pl.LightningModule)
        )
        try:
            # the step resumed from is said once the fit knows it (``on_train_start``):
            # Lightning may resume from a newer file, or a sharded strategy from its own
            self._state.restore(tell=False)
            return self._state.run(fit)
        finally:
            self._live = self._keeps = False
            self._before = weakref.WeakSet()
            self._state.close()
            self._state = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = sharded(trainer.strategy)
        if strategy is not None:
            directory = self._shards_dir(trainer)
            self._keeps = (
                self._live
                and directory is not None
                and not isinstance(trainer.strategy, FSDPStrategy)  # FSDP1: see the doc
                and made_anew(pl_module, self._before, self._fit)
            )
            if self._keeps:
                if is_sharded({"model": pl_module}):  # made in fit() once, and kept
                    raise RuntimeError(
                        "ElasticLightning.run: fit() passed the LightningModule an earlier "
                        f"fit sharded; {strategy} shards it over each round's group, so "
                        "make a new LightningModule in each fit(), as the Trainer is"
                    )
                forget_old_meshes()  # before configure_model shards over this round's
            self._stand_aside(trainer, strategy, directory)
            if directory is not None:
                self._snapshot_shards(trainer, directory)
            return
        if self._live:  # run(): restored already, or again after a re-formation
            cp = self._checkpoint
            assert cp is not None
            # a newer state a rank sent, else this rank's own, kept from the last fit
            loaded = cp.loaded if cp.loaded is not None else cp.kept
            cp.trainer, cp.loaded, cp.kept, cp.committed = trainer, None, None, None
            self._wrap_loaders(trainer)
            if loaded is not None:
                self._resume_from(trainer, loaded)
                self._rng = rng.capture()
            return
        self._checkpoint = _Checkpoint(trainer)
        self._state = State(self._policy, lightning=self._checkpoint)
        self._wrap_loaders(trainer)
        if self._state.restore(tell=False):  # Lightning may resume from a file instead
            self._resume_from(trainer, self._checkpoint.loaded or {})
            # Lightning draws from the RNG before the first step (a DataLoader iterator's
            # seed): the restored states go back right before it, as they were saved
            self._rng = rng.capture()

    def _shards_dir(self, trainer: pl.Trainer) -> str | None:
        policy = self._policy or SnapshotPolicy.from_env()
        return shards_dir(trainer.strategy, policy.checkpoint_dir)

    def _stand_aside(self, trainer: pl.Trainer, strategy: str, directory: str | None) -> None:
        """A sharded strategy's checkpoint is not each rank's whole state, so no rank could
        send it to another: no snapshot of the whole. ModelParallel's and FSDP's shards
        are snapshotted to ``directory``, where given (and ModelParallel's, under ``run()``,
        kept in memory for the next fit: the workers stay); else Lightning resumes from
        its own checkpoints, and under ``run()`` a change gives new workers. The sampler
        still resumes at the exact sample."""
        if not self._aside:
            new = ", and a membership change gives new workers" if self._live else ""
            fsdp1 = isinstance(trainer.strategy, FSDPStrategy)
            if directory is not None and self._keeps:
                log.info(
                    "%s shards the model: its snapshots are DCP checkpoints of the shards in "
                    "%s, and copies in memory: the workers are kept through membership changes",
                    strategy,
                    directory,
                )
            elif directory is not None and self._live and fsdp1:
                log.warning(
                    "%s shards the model with FSDP1: its snapshots are DCP checkpoints of the "
                    "shards in %s, but FSDP1's flat shards cannot be re-sharded in memory, so "
                    "a membership change gives new workers, which load the newest (FSDP2, "
                    "ModelParallelStrategy, keeps them)",
                    strategy,
                    directory,
                )
            elif directory is not None:
                (log.warning if self._live else log.info)(
                    "%s shards the model: its snapshots are DCP checkpoints of the shards in %s%s",
                    strategy,
                    directory,
                    " (the LightningModule was made before run(), or fit() keeps it: a sharded "
                    "one is cut over one group, so a membership change gives new workers; make "
                    "a new one in each fit(), as the Trainer is, to keep them)"
                    if self._live
                    else "",
                )
            else:
                more = (
                    " (give --checkpoint-dir, a directory every node reads, for snapshots "
                    "of its shards)"
                    if fsdp1 or isinstance(trainer.strategy, ModelParallelStrategy)
                    else ""
                )
                log.warning(
                    "%s keeps sharded checkpoints of its own: elastic-run's snapshots stand "
                    "aside, Lightning resumes from its own checkpoints%s%s",
                    strategy,
                    more,
                    new,
                )
        self._aside = True
        if self._live and not self._keeps:
            group.detach()  # the agent no longer re-forms these workers in place
        self._wrap_loaders(trainer)

    def _snapshot_shards(self, trainer: pl.Trainer, directory: str) -> None:
        """Make the shards' State once the strategy sharded the model and made the
        optimizers: Lightning then resumes (``resume_start``), and the newer of the
        snapshots and the script's ``ckpt_path`` is restored."""
        connector = trainer._checkpoint_connector
        resume = connector.resume_start

        def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            connector.resume_start = resume
            if not self._restore_shards(trainer, directory, checkpoint_path):
                resume(checkpoint_path, weights_only)

        connector.resume_start = resume_start
        self._unwrap.append(lambda: setattr(connector, "resume_start", resume))

    def _restore_shards(self, trainer: pl.Trainer, directory: str, path: Any) -> bool:
        """Restore the newest snapshot of the shards, re-sharded over this world, and give
        Lightning the rest as the checkpoint it resumes from; False: Lightning reads
        ``path`` (newer, or no snapshot) or nothing."""
        # the strategy's: FSDP wraps the LightningModule (unless configure_model wrapped
        # its layers), and only the wrapper reads its flat parameters as shards
        module = trainer.strategy.model
        if not isinstance(module, torch.nn.Module) or not is_sharded({"model": module}):
            log.warning(
                "%s left the model unsharded (no DTensor parameters or FSDP modules after "
                "configure_model): no snapshots; Lightning resumes from its own checkpoints",
                type(trainer.strategy).__name__,
            )
            if self._keeps:
                group.detach()  # nothing kept: a change gives new workers
                self._keeps = False
            return False
        self._rest = _Rest(trainer, live=self._keeps)
        optimizers = {f"optimizer_{i}": o for i, o in enumerate(trainer.optimizers)}
        self._shards = State(self._policy, model=module, **optimizers, lightning=self._rest)
        held = self._held
        if self._keeps:
            assert self._state is not None
            why = self._shards.follow(self._state)
            if why is not None:
                log.warning("a membership change gives new workers: %s", why)
                group.detach()
                held = self._held = None
        steps = complete_steps(Path(directory))
        # rank 0's view for all: every rank takes the same branch of what follows
        newest, file = trainer.strategy.broadcast((steps[0] if steps else -1, _file_step(path)))
        if self._keeps:  # and the newest step the ranks' memory holds a part of, at most
            newest = max(newest, comm.control().all_reduce([held.step if held else -1], "MAX")[0])
        if not from_snapshot(newest, file):
            if path and newest >= 0:
                log.info("%s (step %d) is as new as the snapshots: resuming from it", path, file)
            self._held = None
            return False
        restored = self._shards.restore(tell=False, held=held)
        self._held = None  # re-sharded (a fault before this keeps it for the next fit)
        if not restored:
            return False
        step = self._shards.step  # memory may hold a newer step only in part: this one whole
        if not from_snapshot(step, file):  # Lightning reads the file over it
            log.info(
                "%s (step %d) is newer than the snapshots (%d): resuming from it", path, file, step
            )
            return False
        if path:
            log.info("resuming from the snapshot of step %d, not %s", step, path)
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = self._rest.loaded or {}
        self._rng = rng.capture()  # as restored: back right before the first step
        return True

    def _resume_from(self, trainer: pl.Trainer, ckpt: dict[str, Any]) -> None:
        """Hand the snapshot to Lightning as the checkpoint to resume from: it restores
        everything from it as from a file (a file passed as ``ckpt_path`` is used instead
        when it is newer: read only then, ``reads_file``)."""
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = ckpt  # kept by resume_start when no path is given
        strategy = trainer.strategy
        read_file = strategy.load_checkpoint
        step = int(ckpt.get("global_step", 0))

        def load_checkpoint(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
            strategy.load_checkpoint = read_file
            peeked = _file_step(path)
            if not reads_file(step, peeked):
                log.info(
                    "resuming from the snapshot of step %d, not %s (step %d: not read)",
                    step,
                    path,
                    peeked,
                )
                return ckpt
            file: dict[str, Any] = read_file(path, weights_only)
            if int(file.get("global_step", -1)) > step:
                log.info("%s (step %s) is newer than the snapshot", path, file["global_step"])
                return file
            log.info("resuming from the snapshot of step %d, not %s", step, path)
            return ckpt

        strategy.load_checkpoint = load_checkpoint
        self._unwrap.append(lambda: setattr(strategy, "load_checkpoint", read_file))

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # before the loaders are made: their length must count the batches trained
        self._position = _loader_state(checkpoint)

    def _wrap_loaders(self, trainer: pl.Trainer) -> None:
        """Lightning passes every loader through ``strategy.process_dataloader`` after
        injecting its sampler: the train loader's ``DistributedSampler`` is swapped there."""
        strategy = trainer.strategy
        process = strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            dataloader = process(dataloader)
            if trainer.state.stage is RunningStage.TRAINING and isinstance(dataloader, DataLoader):
                self._make_resumable(trainer, dataloader)
            return dataloader

        strategy.process_dataloader = process_dataloader
        self._unwrap.append(lambda: setattr(strategy, "process_dataloader", process))

    def _make_resumable(self, trainer: pl.Trainer, loader: DataLoader) -> None:
        batches = loader.batch_sampler
        base: Any = getattr(batches, "sampler", None)
        if (
            not isinstance(batches, BatchSampler)
            or type(base) is not DistributedSampler
            or loader.batch_size is None
        ):
            log.warning(
                "the train loader's sampler is %s, not the DistributedSampler Lightning "
                "injects: a restart starts its epoch over",
                type(base).__name__,
            )
            return
        sampler = ResumableSampler(base, loader.batch_size, loader.drop_last)
        if self._position is not None:
            sampler.load(self._position)
            # the loop restored its count of the epoch's batches at the old world size:
            # it counts in this world's now, where the loader's length is (Lightning ends
            # the epoch and schedules validation by it)
            shift = self._position["batches"] - sampler.offset
            count: Any = trainer.fit_loop.epoch_loop.batch_progress.current
            count.ready, count.started = count.ready - shift, count.started - shift
            count.processed, count.completed = count.processed - shift, count.completed - shift
            self._position = None  # once: a loader made again later starts its epoch
        batches.sampler = sampler
        loop = trainer.fit_loop.epoch_loop
        # a stateful loader: Lightning saves its position with its loops, and reads it back
        loader.state_dict = lambda: sampler.state(loop.batch_progress.current.processed)
        loader.load_state_dict = sampler.load

    # -- training: commit ------------------------------------------------------------------
    def _committing(self) -> State | None:
        """The State each optimizer step is committed to: the shards', else the whole
        checkpoint's unless it stands aside."""
        if self._shards is not None:
            return self._shards
        return None if self._aside else self._state

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng is not None:
            rng.apply(self._rng)
            self._rng = None
        if self._rest is not None:
            self._rest.ready = True  # its snapshots hold the checkpoint from now on
        state = self._committing()
        if state is not None:  # from the snapshot, a file, or the start
            state.resumed_from(trainer.global_step or -1)
            self._committed = trainer.global_step

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        state = self._committing()
        if state is None or trainer.global_step == self._committed:
            return  # no optimizer step (gradient accumulation)
        state.step = trainer.global_step - 1
        self._committed = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        state.commit(float(loss) if isinstance(loss, torch.Tensor) else None)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not self._live:
            return
        if self._checkpoint is not None and not self._aside:
            self._checkpoint.keep()  # before the teardown: the next fit starts from it
        if self._keeps and self._shards is not None and self._rest is not None:
            self._rest.keep()  # the shards as of the last commit, and the rest beside them
            held = self._shards.held_shards(live=self._rest.kept is not None)
            if held is not None and held.step >= (self._held.step if self._held else -1):
                self._held = held  # for the next fit's State (else an older fit's is kept)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        while self._unwrap:  # a later fit() starts as the first did
            self._unwrap.pop()()
        if self._shards is not None:  # each fit shards its model anew
            self._shards.close()  # the checkpoint in flight, if any, completes
            self._shards = self._rest = None
        if self._state is not None and not self._live:  # run() closes its own
            self._state.close()  # the snapshot copy in flight, if any, completes
            self._state = None
