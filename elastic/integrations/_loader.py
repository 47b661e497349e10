"""The data position in a loader that accelerate prepared (the HF Trainer's, or one an
``accelerate`` script passes to ``prepare``), resumable over another world size.

Such a loader deals the batches of one sampler (an order of the samples) round-robin over
the ranks, so what an epoch trained on is always a prefix of that permutation. To resume
an epoch, the loader skips whole batches per rank (``skip_first_batches``): right only at
the same world size. So the resumed epoch's sampler puts ahead of the rest of the
permutation as many filler samples as make a whole number of the new world's batches,
and exactly those are skipped. At the same world size the filler is the trained prefix
itself: the epoch is the one an undisturbed run sees, sample for sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import BatchSampler, Sampler

__all__ = ["Position", "ResumedEpoch", "batch_sampler", "filler_batches", "per_rank"]


@dataclasses.dataclass(frozen=True)
class Position:
    """Where an epoch stands: ``consumed`` samples of its order trained on (all ranks
    together); ``lead``: the filler batches per rank the epoch began with (a resumed one)."""

    epoch: int = 0
    consumed: int = 0
    lead: int = 0

    def after(self, batches: int, world: int, batch_size: int, samples: int) -> Position:
        """The position once the loop counted ``batches`` of this epoch. A finished epoch
        stays this epoch, all consumed: resumed, it has nothing left (the loop that
        resumes it goes on to the next, as the one that finished it would have)."""
        trained = max(batches - self.lead, 0) * world * batch_size
        return dataclasses.replace(self, consumed=min(self.consumed + trained, samples))


def per_rank(samples: int, batch_size: int, drop_last: bool, world: int, even: bool) -> int:
    """Batches a rank gets from ``samples`` samples: accelerate's own arithmetic."""
    batches = BatchSampler(range(samples), batch_size, drop_last)
    if world == 1:
        return len(batches)
    from accelerate.data_loader import BatchSamplerShard

    return len(BatchSamplerShard(batches, world, 0, split_batches=False, even_batches=even))


def filler_batches(
    samples: int, consumed: int, batch_size: int, drop_last: bool, world: int, even: bool
) -> int:
    """Batches per rank to put ahead of the epoch's untrained samples so that, skipped,
    the epoch has its whole length in this world (the Trainer counts epochs by it)."""
    whole = per_rank(samples, batch_size, drop_last, world, even)
    return whole - per_rank(samples - consumed, batch_size, drop_last, world, even)


class ResumedEpoch(Sampler[int]):
    """The loader's sampler for the one resumed epoch: ``filler`` samples (skipped by the
    Trainer, never loaded), then the permutation's samples from ``start`` on; later
    epochs are the sampler's own."""

    def __init__(self, inner: Sampler[int], start: int, filler: int) -> None:
        self.inner, self.start, self.filler = inner, start, filler
        self.pending = True

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = list(self.inner)  # draws the epoch's permutation (and moves the epoch on)
        if not self.pending:
            return iter(order)
        self.pending = False
        # the filler is the permutation's start: at the same world size, the trained prefix
        filler = (order * (self.filler // max(len(order), 1) + 1))[: self.filler]
        return iter(filler + order[self.start :])

    def __len__(self) -> int:
        inner = len(self.inner)  # type: ignore[arg-type]
        return self.filler + inner - self.start if self.pending else inner


def batch_sampler(loader: Any) -> BatchSampler | None:
    """The loader's ``BatchSampler`` over one sampler, inside accelerate's shard; None
    for what deals samples otherwise (an iterable dataset, dispatched or split batches)."""
    if loader is None or type(loader).__name__ == "DataLoaderDispatcher":
        return None
    outer = getattr(loader, "batch_sampler", None)
    if getattr(outer, "split_batches", False):
        return None
    inner = getattr(outer, "batch_sampler", outer)
    if not isinstance(inner, BatchSampler) or not isinstance(inner.sampler, Sized):
        return None
    return inner
