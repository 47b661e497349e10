"""The re-sharding plan (``elastic.worker.reshard_plan``): who sends which rows, and when
no step is held whole. Pure: offers and needs built by hand."""

from __future__ import annotations

from elastic.worker.reshard_plan import Move, Need, NoPlan, Offer, Plan, plan


def rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """Rows of part ``index`` when ``total`` rows are cut in ``parts`` as ``torch.chunk``
    (FSDP2's ``Shard(0)``) cuts them."""
    size = -(-total // parts)
    lo = min(total, index * size)
    return lo, min(total, lo + size)


def shards(key: str, total: int, world: int, step: int, ranks: list[int]) -> list[Offer]:
    """What ``ranks`` (old rank i at position i) hold of ``key`` cut over ``world``."""
    return [
        Offer(rank=r, step=step, key=key, lo=lo, hi=hi)
        for i, r in enumerate(ranks)
        for lo, hi in [rows(total, world, i)]
    ]


def needs(key: str, total: int, world: int) -> list[Need]:
    return [
        Need(rank=i, key=key, lo=lo, hi=hi)
        for i in range(world)
        for lo, hi in [rows(total, world, i)]
    ]


def test_rows_are_cut_as_torch_chunk_cuts_them() -> None:
    import torch

    for total, parts in ((32, 3), (1, 2), (5, 4), (7, 3)):
        chunks = torch.arange(total).chunk(parts)
        cut = [rows(total, parts, i) for i in range(parts)]
        assert [c.tolist() for c in chunks] == [list(range(lo, hi)) for lo, hi in cut if hi > lo]


def test_a_join_moves_only_the_rows_that_change_hands() -> None:
    """Two ranks hold 32 rows; three need them: each survivor keeps what it has, the
    newcomer (rank 2, no offers, no values) gets its rows from the lowest holder."""
    got = plan(shards("w", 32, 2, 7, [0, 1]), needs("w", 32, 3), {0: {7}, 1: {7}})
    assert isinstance(got, Plan) and got.step == 7 and got.values_from == 0
    assert got.moves == (
        Move("w", src=0, dst=0, lo=0, hi=11),
        Move("w", src=0, dst=1, lo=11, hi=16),
        Move("w", src=1, dst=1, lo=16, hi=22),
        Move("w", src=1, dst=2, lo=22, hi=32),
    )
    assert got.sent() == 5 + 10


def test_a_lost_shard_leaves_no_plan_and_says_which_rows() -> None:
    """Old rank 0 of three is gone (the survivors are new ranks 0 and 1)."""
    offers = [o for o in shards("fc.bias", 32, 3, 9, [9, 0, 1]) if o.rank != 9]
    got = plan(offers, needs("fc.bias", 32, 2), {0: {9}, 1: {9}})
    assert isinstance(got, NoPlan)
    assert "rows 0-10 of 'fc.bias' are held by no rank" in got.reason


def test_replicas_cover_a_lost_replica_group() -> None:
    """HSDP: two replica groups of two shards each; the second group (ranks 2, 3) is lost,
    the first holds every row."""
    offers = shards("w", 8, 2, 4, [0, 1])
    got = plan(offers, needs("w", 8, 2), {0: {4}, 1: {4}})
    assert isinstance(got, Plan) and got.sent() == 0


def test_the_newest_whole_step_wins_over_a_newer_partial_one() -> None:
    """Rank 1 stepped once more than rank 0 before the fault (its optimizer ran, rank 0's
    did not) but kept a copy of step 5 (a snapshot): step 6 is not whole, step 5 is."""
    offers = [Offer(0, 5, "w", 0, 4), Offer(1, 6, "w", 4, 8), Offer(1, 5, "w", 4, 8)]
    got = plan(offers, needs("w", 8, 2), {0: {5}, 1: {5, 6}})
    assert isinstance(got, Plan) and got.step == 5 and got.values_from == 0
    assert "newer steps are not: rows 0-3 of 'w' are held by no rank" in got.reason
    assert got.moves == (Move("w", 0, 0, 0, 4), Move("w", 1, 1, 4, 8))


def test_a_step_needs_someone_holding_its_values() -> None:
    """Every row of step 5 is held, but only as rows (a buddy's copy) with no values."""
    offers = [Offer(0, 5, "w", 0, 4), Offer(1, 5, "w", 4, 8)]
    assert isinstance(plan(offers, needs("w", 8, 2), {0: {6}, 1: {6}}), NoPlan)
    got = plan(offers, [], {0: {6}, 1: {6}})
    assert isinstance(got, Plan) and got.step == 6  # nothing needed of 5: 6 it is
    got = plan(offers, needs("w", 8, 2), {0: {6}, 1: {5, 6}})
    assert isinstance(got, Plan) and got.step == 5 and got.values_from == 1


def test_nothing_held_anywhere() -> None:
    assert isinstance(plan([], needs("w", 8, 2), {}), NoPlan)
    got = plan([], [], {0: {3}})  # a model with no sharded tensors: the values are all
    assert isinstance(got, Plan) and got.moves == () and got.step == 3


def test_empty_shards_need_nothing() -> None:
    got = plan(shards("b", 1, 1, 2, [0]), needs("b", 1, 2), {0: {2}})
    assert isinstance(got, Plan)
    assert got.moves == (Move("b", src=0, dst=0, lo=0, hi=1),)


def test_a_row_comes_from_the_rank_that_needs_it_where_it_can() -> None:
    """Both ranks hold every row (replicas): nobody sends anything."""
    offers = [Offer(r, 1, "w", 0, 8) for r in (0, 1)]
    got = plan(offers, needs("w", 8, 2), {0: {1}, 1: {1}})
    assert isinstance(got, Plan) and got.sent() == 0
