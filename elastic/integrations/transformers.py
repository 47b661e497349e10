"""The Hugging Face ``Trainer`` on ``elastic.State``: a restart resumes at the last step.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    ElasticCallback.attach(trainer)
    trainer.train()

The Trainer resumes only from a checkpoint folder (``train(resume_from_checkpoint=...)``,
read inside ``train()`` before any callback runs), so a callback alone cannot hand it a
snapshot: ``attach`` also wraps ``train``. After each optimizer step the callback hands
``State`` what a checkpoint folder holds (model, optimizer, scheduler, scaler,
``TrainerState``) and the epoch's data position, and ``State`` snapshots it into the
node's shared memory when its cost policy says (``--snapshot-every``). On a restart the
wrapped ``train`` finds the newest snapshot in the job and resumes the Trainer from it
as from a folder: its ``_load_*`` steps read the snapshot, and only ``trainer_state.json``
(a few hundred bytes) is written, to a private temporary folder, since the Trainer reads
that file itself. A folder the script passes is used instead when it is newer.

The data position: the Trainer skips as many batches per rank as were trained, right
only at the same world size. The resumed epoch's sampler leads with filler batches
instead (``_loader``), the Trainer is told to skip exactly those, and its epoch and step
counts are set to match (``max_steps`` too, when the run is given in epochs).

The Trainer's accelerator holds the process group, so a Trainer serves one round: with
``attach`` a membership change restarts the workers; with ``ElasticCallback.run(make)``
(``make`` builds a Trainer) the group re-forms in the same process and the next Trainer
resumes from the newest committed state: the last Trainer's own, in memory, where no
rank holds a newer one (``State.run``). FSDP and DeepSpeed keep sharded
checkpoints of their own: with them the callback stands aside (it says so once) and the
Trainer's own resume is used.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import get_last_checkpoint

from elastic.contract import SnapshotPolicy
from elastic.integrations._group import ensure_group
from elastic.integrations._loader import Position, ResumedEpoch, batch_sampler, filler_batches
from elastic.worker import rng
from elastic.worker.state import State

log = logging.getLogger("elastic.transformers")

__all__ = ["ElasticCallback"]

_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
# the Trainer's steps of a resume that the adapter redirects to a snapshot
_RESUME_STEPS = (
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
    "_init_training_state",
    "get_train_dataloader",
)


class _Snapshot:
    """What a Trainer checkpoint folder holds, as the one object ``State`` saves, as of
    the last commit: a step cut short by a fault dies in its gradients' all-reduce, before
    the optimizer, so the model, optimizer, scheduler and ``TrainerState`` are still the
    committed step's, and the data position is the one ``committed`` at that step (the
    live one counts the cut step's micro-batches). Until this Trainer has committed a step
    its objects hold no committed state (``live_state`` False): a live re-formation then
    takes the newest snapshot."""

    def __init__(self, trainer: Trainer | None, position: Callable[[], Position]) -> None:
        self.trainer = trainer
        self.position = position
        self.committed: Position | None = None  # at this Trainer's last commit
        self.loaded: dict[str, Any] | None = None

    @property
    def live_state(self) -> bool:
        return self.committed is not None

    def on_commit(self) -> None:
        """``State`` calls this at each commit, before any snapshot of the step."""
        self.committed = self.position()

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        assert t is not None, "no Trainer is training"
        model: Any = t.model
        optimizer: Any = t.optimizer
        state = dataclasses.asdict(t.state)
        # the callbacks' own states, as the Trainer's _save_checkpoint writes them
        everyone = [*t.callback_handler.callbacks, t.control]
        saved: list[Any] = [c for c in everyone if isinstance(c, ExportableState)]
        state["stateful_callbacks"] = TrainerState(stateful_callbacks=saved).stateful_callbacks
        out = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "trainer_state": json.dumps(state),  # what a restart reads runs no code
            "position": dataclasses.asdict(self.committed or self.position()),
        }
        if t.lr_scheduler is not None:
            out["scheduler"] = t.lr_scheduler.state_dict()
        scaler = getattr(t.accelerator, "scaler", None)
        if scaler is not None:
            out["scaler"] = scaler.state_dict()
        return out

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.loaded = saved


def steps_left(batches: int, skipped: int, accumulate: int) -> int:
    """Optimizer steps the Trainer takes in an epoch of ``batches`` per rank once it skips
    ``skipped``: it steps after every ``accumulate``-th batch of the epoch and after its
    last."""
    if skipped >= batches:
        return 0
    return batches // accumulate - skipped // accumulate + (1 if batches % accumulate else 0)


def _folder_step(folder: str | None) -> int:
    """The global step of a Trainer checkpoint folder, -1 when there is none."""
    if not folder:
        return -1
    try:
        return int(json.loads((Path(folder) / _STATE_FILE).read_text())["global_step"])
    except (OSError, ValueError, KeyError):
        return -1


class ElasticCallback(TrainerCallback):
    """Snapshots a Trainer's state through ``elastic.State`` after optimizer steps and
    resumes ``train()`` from the newest one (see the module doc). Made and added by
    ``attach``. Under torchrun or plain python it changes nothing."""

    def __init__(self, snapshot_policy: SnapshotPolicy | None = None) -> None:
        self._policy = snapshot_policy
        self._trainer: Trainer | None = None
        self._state: State | None = None
        self._start = Position()  # of the epoch being trained
        self._batches = 0  # of this epoch, per rank, as the loop counts them
        self._epoch_begun = False
        self._resume: Position | None = None  # of the snapshot resumed from, until its epoch
        self._rng: dict[str, Any] | None = None  # the restored RNG states, until the loop's turn
        self._epoch_batches = 0  # per rank, of the resumed epoch's loader
        self._live: _Snapshot | None = None  # inside run(): the State outlives each Trainer

    @staticmethod
    def _check(trainer: Trainer) -> None:
        missing = [m for m in _RESUME_STEPS if not callable(getattr(trainer, m, None))]
        if missing:
            raise RuntimeError(
                f"this Trainer (transformers {transformers.__version__}) has no "
                f"{', '.join(missing)}: ElasticCallback needs transformers 5.3 or newer"
            )

    @classmethod
    def run(
        cls,
        make: Callable[[], Trainer],
        resume_from_checkpoint: str | bool | None = None,
        snapshot_policy: SnapshotPolicy | None = None,
        backend: str | None = None,
        **train_kw: Any,
    ) -> Any:
        """Keep the workers through membership changes: ``make()`` builds this round's
        Trainer, its ``TrainingArguments`` included (they hold the world size), and it
        trains as ``attach`` would have it; after a change the process group re-forms in
        this process and ``make()``'s next Trainer resumes from the newest snapshot
        (``State.run``). Anywhere but elastic-run's live mode it is called once.

        The process group must exist before the first Trainer, to be re-formed: under a
        launcher it is made here with ``backend`` (default: NCCL where this local rank has
        a GPU, else gloo), and every Trainer finds it made."""
        ensure_group(backend)
        cb = cls(snapshot_policy)
        snapshot = _Snapshot(None, cb._position)
        state = cb._state = State(snapshot_policy, transformers=snapshot)
        cb._live = snapshot

        def one_round() -> Any:
            from accelerate.state import AcceleratorState

            # accelerate keeps the world size of the first Accelerator in the process:
            # the Trainer (through TrainingArguments) would see the old group's
            AcceleratorState._reset_state(reset_partial_state=True)
            if snapshot.loaded is None and snapshot.live_state:
                # the re-formation kept this rank's own state, the newest: the last
                # Trainer hands it to the next one in memory
                snapshot.loaded = snapshot.state_dict()
            snapshot.committed = None
            t = make()
            cls._check(t)
            cb._trainer = snapshot.trainer = t
            t.add_callback(cb)
            return cb._train(t.train, resume_from_checkpoint, **train_kw)

        try:
            return state.run(one_round)
        finally:
            cb._live = None
            state.close()
            cb._state = None

    @classmethod
    def attach(
        cls, trainer: Trainer, snapshot_policy: SnapshotPolicy | None = None
    ) -> ElasticCallback:
        """Add the callback to ``trainer`` and wrap its ``train`` (see the module doc)."""
        cls._check(trainer)
        cb = cls(snapshot_policy)
        cb._trainer = trainer
        trainer.add_callback(cb)
        train = trainer.train

        def elastic_train(resume_from_checkpoint: str | bool | None = None, **kw: Any) -> Any:
            return cb._train(train, resume_from_checkpoint, **kw)

        trainer.train = elastic_train
        return cb

    # -- start: restore --------------------------------------------------------------------
    def _train(self, train: Callable[..., Any], folder: str | bool | None, **kw: Any) -> Any:
        t = self._trainer
        assert t is not None
        if t.is_fsdp_enabled or t.is_deepspeed_enabled:
            log.warning(
                "FSDP and DeepSpeed keep sharded checkpoints of their own: elastic-run's "
                "snapshots stand aside and the Trainer resumes from its own checkpoints"
            )
            return train(resume_from_checkpoint=folder, **kw)
        path = get_last_checkpoint(t.args.output_dir) if folder is True else folder or None
        if self._live is not None:  # run(): restored already, or again after a re-formation
            snapshot, state = self._live, self._state
            assert state is not None
        else:
            snapshot = _Snapshot(t, self._position)
            state = self._state = State(self._policy, transformers=snapshot)
            state.restore(tell=False)
        self._start, self._batches, self._epoch_begun = Position(), 0, False
        scratch = None
        undo: list[Callable[[], None]] = []
        try:
            if snapshot.loaded is not None:
                step = json.loads(snapshot.loaded["trainer_state"])["global_step"]
                if _folder_step(path) > step:
                    log.info("%s (step %d) is newer than the snapshot", path, _folder_step(path))
                else:
                    scratch = tempfile.mkdtemp(prefix="elastic-trainer-")
                    Path(scratch, _STATE_FILE).write_text(snapshot.loaded["trainer_state"])
                    self._rng = rng.capture()  # as restored: the loop applies them later
                    undo = self._resume_from(t, snapshot.loaded, scratch)
                    log.info("resuming from the snapshot of step %d, not %s", step, path)
                    path = scratch
            snapshot.loaded = None  # read once: a later Trainer reads the next one
            state.resumed_from(_folder_step(path))
            # True with no folder and no snapshot: the Trainer says there is nothing
            return train(resume_from_checkpoint=path or (folder is True or None), **kw)
        finally:
            for put_back in reversed(undo):
                put_back()
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            if self._live is None:
                state.close()  # the snapshot copy in flight, if any, completes
                self._state = None
            self._resume, self._rng = None, None

    def _resume_from(
        self, t: Trainer, saved: dict[str, Any], scratch: str
    ) -> list[Callable[[], None]]:
        """Make the Trainer's folder-reading steps read ``saved`` for ``scratch``; returns
        what puts them back."""
        self._resume = Position(**saved["position"])
        ours = os.path.realpath(scratch)

        def load_model(folder: str, model: Any = None) -> None:
            into: Any = model or t.model
            into.load_state_dict(saved["model"])

        def load_optimizer_and_scheduler(folder: str | None) -> None:
            optimizer: Any = t.optimizer
            optimizer.load_state_dict(saved["optimizer"])
            if t.lr_scheduler is not None and "scheduler" in saved:
                t.lr_scheduler.load_state_dict(saved["scheduler"])

        def load_scaler(folder: str | None) -> None:
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None and "scaler" in saved:
                scaler.load_state_dict(saved["scaler"])

        def load_rng(folder: str | None) -> None:
            if self._rng is not None:
                rng.apply(self._rng)

        undo = []
        for name, ours_fn in (
            ("_load_from_checkpoint", load_model),
            ("_load_optimizer_and_scheduler", load_optimizer_and_scheduler),
            ("_load_scaler", load_scaler),
            ("_load_rng_state", load_rng),
        ):
            undo.append(self._wrap(t, name, ours, ours_fn))
        undo.append(self._wrap_loader(t))
        undo.append(self._wrap_counts(t))
        return undo

    @staticmethod
    def _wrap(t: Trainer, name: str, ours: str, fn: Callable[..., None]) -> Callable[[], None]:
        """``t.name`` runs ``fn`` for the snapshot's folder, the Trainer's own otherwise."""
        theirs = getattr(t, name)

        def either(folder: Any = None, *args: Any) -> None:
            if folder is not None and os.path.realpath(folder) == ours:
                fn(folder, *args)
            else:
                theirs(folder, *args)

        setattr(t, name, either)
        return lambda: setattr(t, name, theirs)

    def _wrap_loader(self, t: Trainer) -> Callable[[], None]:
        """The train loader's sampler starts the resumed epoch with filler batches."""
        theirs = t.get_train_dataloader

        def get_train_dataloader() -> Any:
            loader: Any = theirs()
            resume, batches = self._resume, batch_sampler(loader)
            if resume is None or t.args.ignore_data_skip:
                return loader
            if batches is None:
                log.warning(
                    "the train loader does not deal one sampler's batches over the ranks: "
                    "the Trainer skips the batches trained on, right only at the same world size"
                )
                self._resume = None
                return loader
            sampler: Any = batches.sampler
            world, size = t.args.world_size, t._train_batch_size
            even = bool(getattr(t.accelerator, "even_batches", True))
            lead = filler_batches(
                len(sampler), resume.consumed, size, batches.drop_last, world, even
            )
            self._resume = dataclasses.replace(resume, lead=lead)
            loader.set_sampler(ResumedEpoch(sampler, resume.consumed, lead * world * size))
            self._epoch_batches = len(loader)  # a whole epoch's, filler included
            return loader

        t.get_train_dataloader = get_train_dataloader
        return lambda: setattr(t, "get_train_dataloader", theirs)

    def _wrap_counts(self, t: Trainer) -> Callable[[], None]:
        """The Trainer's epoch and batch counts for the resumed epoch are the snapshot's
        (it would derive them from the global step, right only at the same world size)."""
        theirs = t._init_training_state

        def init_training_state(
            max_steps: int, per_epoch: int, epochs: int, folder: Any, trial: Any
        ) -> tuple[int, int]:
            counts: tuple[int, int] = theirs(max_steps, per_epoch, epochs, folder, trial)
            resume = self._resume
            if resume is None or t.args.ignore_data_skip:
                return counts  # the Trainer's own (the loader has no sampler to resume)
            if t.args.max_steps <= 0:  # given in epochs: the steps still to go, in this world
                accumulate = t.args.gradient_accumulation_steps
                left = steps_left(self._epoch_batches, resume.lead, accumulate)
                later = math.ceil((t.args.num_train_epochs - resume.epoch - 1) * per_epoch)
                t.state.max_steps = t.state.global_step + left + max(later, 0)
            return resume.epoch, resume.lead

        t._init_training_state = init_training_state
        return lambda: setattr(t, "_init_training_state", theirs)

    # -- training: count and commit --------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._trainer is None:
            raise RuntimeError(
                "ElasticCallback is added with ElasticCallback.attach(trainer), which also "
                "lets train() resume from the snapshots, not through callbacks=[...]"
            )

    def on_epoch_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        train_dataloader: Any = None,
        **kw: Any,
    ) -> None:
        resume = self._resume
        if resume is not None:  # the resumed epoch: its position, its filler counted
            self._start, self._batches, self._resume = resume, resume.lead, None
        elif self._epoch_begun:
            self._start, self._batches = Position(self._start.epoch + 1), 0
        else:  # from the start, or the Trainer's own resume from a folder: its arithmetic
            accumulate = args.gradient_accumulation_steps
            per_epoch = max(math.ceil(len(train_dataloader) / accumulate), 1)
            self._start = Position(state.global_step // per_epoch)
            self._batches = state.global_step % per_epoch * accumulate
        self._epoch_begun = True

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._batches += 1

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._batches += 1
        if self._state is not None:
            self._state.step = state.global_step - 1
            self._state.commit()

    def _position(self) -> Position:
        """Where the epoch stands now (what a snapshot saves)."""
        t = self._trainer
        assert t is not None
        batches = batch_sampler(t.callback_handler.train_dataloader)
        if batches is None:
            return self._start  # nothing to resume a position on: the Trainer skips
        sampler = batches.sampler
        inner = sampler.inner if isinstance(sampler, ResumedEpoch) else sampler
        samples = len(inner)  # type: ignore[arg-type]
        return self._start.after(self._batches, t.args.world_size, t._train_batch_size, samples)
