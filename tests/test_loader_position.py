"""The data position in a loader accelerate prepared, through accelerate's own samplers:
an epoch resumed after any number of batches, at the same or another world size, trains
every sample not yet trained exactly once, and the same world size sees the undisturbed
epoch."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("accelerate")
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from torch import Generator
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from elastic.integrations._loader import Position, ResumedEpoch, filler_batches, per_rank


def batches(make: Callable[[], Any], batch: int, drop: bool, world: int, skip: int = 0) -> list:
    """Each rank's batches of one epoch, as the Trainer's prepared loader deals them: every
    rank has a sampler of its own (``make``), seeded alike."""
    out = []
    for rank in range(world):
        dealer: object = BatchSampler(make(), batch, drop)
        if world > 1:
            dealer = BatchSamplerShard(dealer, world, rank, split_batches=False, even_batches=True)
        out.append(list(SkipBatchSampler(dealer, skip)))
    return out


def dealt(make: Callable[[], Any], batch: int, drop: bool, world: int, skip: int = 0) -> list:
    """Each rank's samples of one epoch."""
    return [[i for b in rank for i in b] for rank in batches(make, batch, drop, world, skip)]


def permutation(n: int) -> Callable[[], RandomSampler]:
    return lambda: RandomSampler(range(n), generator=Generator().manual_seed(7))


CASES = [
    (n, batch, drop, old, new, k)
    for n, batch, drop in [(96, 4, False), (50, 4, False), (50, 3, True), (7, 2, False)]
    for old, new in [(2, 2), (2, 1), (1, 3), (3, 2)]
    for k in (0, 1, 3)
    if k < per_rank(n, batch, drop, old, True)  # the epoch has that many batches
]


@pytest.mark.parametrize(("n", "batch", "drop", "old", "new", "k"), CASES)
def test_a_resumed_epoch_trains_the_rest_once(
    n: int, batch: int, drop: bool, old: int, new: int, k: int
) -> None:
    trained = sorted(
        i for rank in dealt(permutation(n), batch, drop, old) for i in rank[: k * batch]
    )
    at = Position().after(k, old, batch, n)
    assert at.consumed == min(k * old * batch, n)
    whole = per_rank(n, batch, drop, new, True)
    lead = filler_batches(n, at.consumed, batch, drop, new, True)

    def resumed() -> ResumedEpoch:
        return ResumedEpoch(permutation(n)(), at.consumed, lead * new * batch)

    assert per_rank(len(resumed()), batch, drop, new, True) == whole  # the Trainer's length
    rest = dealt(resumed, batch, drop, new, skip=lead)
    order = list(permutation(n)())
    got = sorted(i for rank in rest for i in rank)
    assert trained == sorted(order[: at.consumed])  # an epoch trains a prefix of its order
    left = Counter(order[at.consumed :])
    if not drop:  # every sample not yet trained once, and the last batches padded
        assert not left - Counter(got)
        assert sum((Counter(got) - left).values()) < new * batch
    else:  # or the remainder dropped
        assert not Counter(got) - left and len(left) - len(got) < new * batch
    if old == new:  # the undisturbed epoch, sample for sample
        assert rest == [rank[k * batch :] for rank in dealt(permutation(n), batch, drop, new)]


def test_later_epochs_are_the_samplers_own() -> None:
    inner = SequentialSampler(range(10))
    sampler = ResumedEpoch(inner, 6, 8)
    assert len(sampler) == 12 and list(sampler) == [0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9]
    assert len(sampler) == 10 and list(sampler) == list(range(10))


def test_a_finished_epoch_resumes_with_nothing_left() -> None:
    done = Position(2).after(13, 2, 4, 96)  # the last batches padded: 104 dealt of 96
    assert done == Position(2, consumed=96)
    lead = filler_batches(96, done.consumed, 4, False, 3, True)
    assert lead == per_rank(96, 4, False, 3, True)  # every batch of the epoch is skipped
    assert dealt(lambda: ResumedEpoch(range(96), 96, lead * 12), 4, False, 3, skip=lead) == [
        [],
        [],
        [],
    ]
    resumed = Position(1, consumed=40, lead=5)  # 40 trained, then 5 filler batches
    assert resumed.after(7, 2, 4, 96) == Position(1, consumed=56, lead=5)


@pytest.mark.parametrize(("world", "drop"), list(itertools.product((1, 2, 3), (False, True))))
def test_per_rank_is_the_loaders_length(world: int, drop: bool) -> None:
    for n in (1, 5, 24, 25):
        samples = range(n)
        assert per_rank(n, 4, drop, world, True) == len(
            batches(lambda: samples, 4, drop, world)[0]  # noqa: B023 (used at once)
        )


@pytest.mark.parametrize(("batches", "accumulate"), [(12, 1), (12, 2), (13, 2), (13, 3), (1, 4)])
def test_steps_left_is_the_trainers_count_of_optimizer_steps(batches: int, accumulate: int) -> None:
    pytest.importorskip("transformers")
    from elastic.integrations.transformers import steps_left

    for skipped in range(batches + 1):
        # the Trainer's rule (_run_epoch): step after batch s when (s + 1) % accumulate == 0
        # or s + 1 == the epoch's batches
        rule = sum(
            1 for s in range(skipped, batches) if (s + 1) % accumulate == 0 or s + 1 == batches
        )
        assert steps_left(batches, skipped, accumulate) == rule, skipped
