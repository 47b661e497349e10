"""``accelerate`` scripts on ``elastic.State``: the prepared train loader's place, resumable.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    data = ElasticLoader(loader)
    state = elastic.State(model=model, optimizer=optimizer, data=data, epoch=0)
    state.restore()
    for epoch in range(state.epoch, epochs):
        state.epoch = epoch
        for batch in data.epoch(epoch):
            ...  # forward, accelerator.backward, optimizer.step()
            if accelerator.sync_gradients:
                state.commit()

What accelerate's ``save_state``/``load_state`` keep, ``State`` keeps already (a prepared
model, optimizer and scheduler have ``state_dict``), in the node's shared memory instead
of a folder. What a script resumes by hand with ``skip_first_batches`` (the batches of
the epoch trained on) is right only at the same world size. ``ElasticLoader`` counts the
batches it hands out, saves the epoch's place with the other state, and on a restart
resumes the epoch at the exact sample over whatever the world size is now (``_loader``).

To keep the workers through membership changes (``State.run``), ``State`` holds the
plain model and optimizer, and the training function makes this round's Accelerator
(``round_accelerator``), prepares them again and hands the loader to ``data.use``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator, skip_first_batches
from accelerate.data_loader import SeedableRandomSampler
from torch.utils.data import RandomSampler, Sampler

from elastic.integrations._loader import Position, ResumedEpoch, batch_sampler, filler_batches

log = logging.getLogger("elastic.accelerate")

__all__ = ["ElasticLoader", "round_accelerator"]


def round_accelerator(**kwargs: Any) -> Accelerator:
    """An ``Accelerator`` for the process group as it is now. accelerate keeps one state
    per process (world size, rank, device), made with the first ``Accelerator`` and never
    again: after a live re-formation (``State.run``) it would describe the old group. This
    drops it first; call it at the top of the training function, and ``prepare`` the
    plain model, optimizer and loader again with it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(**kwargs)


class ElasticLoader:
    """A loader that ``accelerator.prepare`` returned, with its place in the epoch saved
    and restored through ``elastic.State`` (name it among the State's objects)."""

    def __init__(self, loader: Any) -> None:
        self._start = Position()  # of the epoch being iterated
        self._count = 0  # batches of it handed out, per rank (filler counted)
        self._done = 0  # of those, the ones trained as of the last State.commit
        self._resume: Position | None = None
        self._resume_order: Drawn | None = None
        self._batches: Any = None
        self.use(loader)

    def use(self, loader: Any) -> None:
        """Go on with ``loader``, the same loader prepared again for a new round (under
        ``State.run``, after a membership change): the epoch resumes where the last commit
        left it, over the new world size."""
        if self._batches is not None and self._resume is None:
            self.load_state_dict(self.state_dict())  # the place this process holds
        self.loader = loader
        self._batches = batch_sampler(loader)
        if self._batches is None:
            raise ValueError(
                "ElasticLoader needs a loader accelerate prepared over a sized dataset, "
                "dealing one sampler's batches (not an iterable dataset, dispatch_batches "
                "or split_batches)"
            )
        shard = loader.batch_sampler  # accelerate's BatchSamplerShard, or the BatchSampler
        self.world = int(getattr(shard, "num_processes", 1))
        self.even = bool(getattr(shard, "even_batches", True))
        # a random order not seeded by the epoch (accelerate's SeedableRandomSampler is) is
        # recorded; anything else is the sampler's own, for accelerate's save_state as well
        sampler: Any = self._batches.sampler
        self._recorded: _Recorded | None = None
        if isinstance(sampler, _Recorded):
            self._recorded = sampler
        elif isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
            self._recorded = _Recorded(sampler)
            loader.set_sampler(self._recorded)

    def __len__(self) -> int:
        return len(self.loader)

    def _samples(self) -> int:
        assert self._batches is not None
        sampler: Any = self._batches.sampler
        inner: Any = sampler.inner if isinstance(sampler, ResumedEpoch) else sampler
        return len(inner)

    def on_commit(self) -> None:
        """``State.commit`` (every optimizer step): the batches handed out are trained. A
        batch handed out and cut short by a fault is not, and is trained again."""
        self._done = self._count

    def state_dict(self) -> dict[str, Any]:
        assert self._batches is not None
        size = self._batches.batch_size or 1
        at = self._start.after(self._done, self.world, size, self._samples())
        out: dict[str, Any] = dataclasses.asdict(at)
        drawn = self._recorded.drawn_from if self._recorded is not None else None
        if drawn is not None:  # the RNG state this epoch's order was drawn from
            out["order_from"], out["order"] = drawn
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        order, kind = state.pop("order", None), state.pop("order_from", None)
        self._resume_order = (kind, order) if order is not None else None
        self._resume = Position(**state)

    def epoch(self, epoch: int) -> Iterator[Any]:
        """The batches of ``epoch``: the untrained rest of it when it is the one resumed."""
        batches = self._batches
        assert batches is not None
        resume, self._resume = self._resume, None
        saved, self._resume_order = self._resume_order, None
        if resume is not None and resume.epoch != epoch:
            finished = resume.consumed >= self._samples()
            if not (finished and resume.epoch == epoch - 1):
                log.warning(
                    "the saved place is in epoch %d, not %d: epoch %d starts from its first batch",
                    resume.epoch,
                    epoch,
                    epoch,
                )
            resume, saved = None, None
        self.loader.set_epoch(epoch)
        sampler: Any = batches.sampler
        if self._recorded is not None:
            self._recorded.replay = saved
        self._start, self._count, self._done = Position(epoch), 0, 0
        if resume is None or resume.consumed == 0:
            yield from self._counted(self.loader)
            return
        size = batches.batch_size or 1
        lead = filler_batches(
            len(sampler), resume.consumed, size, batches.drop_last, self.world, self.even
        )
        self._start, self._count = dataclasses.replace(resume, lead=lead), lead
        self._done = lead
        self.loader.set_sampler(ResumedEpoch(sampler, resume.consumed, lead * self.world * size))
        try:
            yield from self._counted(skip_first_batches(self.loader, lead))
        finally:
            self.loader.set_sampler(sampler)  # later epochs: the sampler's own

    def _counted(self, loader: Any) -> Iterator[Any]:
        for batch in loader:
            self._count += 1  # before the step trains it: a commit inside counts it
            yield batch


Drawn = tuple[str, torch.Tensor]  # ("generator" or "global", the RNG state drawn from)


class _Recorded(Sampler[int]):
    """A ``RandomSampler`` that remembers the RNG state its epoch's order was drawn from,
    and draws a resumed epoch's order from the saved one. The sampler draws from its
    generator (accelerate gives it one over several ranks, synchronized just before) or,
    with none, from a seed it takes from the global RNG: a new process has neither state,
    and after a resize it may draw the other way. Draws nothing itself, so without a
    fault the order is the sampler's own."""

    def __init__(self, inner: RandomSampler) -> None:
        self.inner = inner
        self.drawn_from: Drawn | None = None  # of the epoch last drawn
        self.replay: Drawn | None = None  # to draw the next epoch from, once

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        sampler, own = self.inner, self.inner.generator
        replay, self.replay = self.replay, None
        if replay is None:
            self.drawn_from = ("generator", own.get_state()) if own else ("global", _global())
            return iter(list(sampler))
        self.drawn_from = replay
        kind, state = replay
        if kind == "generator" and own is not None:
            own.set_state(state)  # and it goes on from there, as it would have
            return iter(list(sampler))
        try:
            if kind == "generator":  # this world's sampler has none: one for this epoch
                sampler.generator = torch.Generator()
                sampler.generator.set_state(state)
                return iter(list(sampler))
            sampler.generator = None  # it drew a seed from the global RNG then
            with torch.random.fork_rng(devices=[]):  # the global RNG is the restored step's
                torch.set_rng_state(state)
                return iter(list(sampler))
        finally:
            sampler.generator = own


def _global() -> torch.Tensor:
    return torch.get_rng_state()
