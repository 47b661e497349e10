"""The rule that a round training committed steps again is never silent."""

from __future__ import annotations

import pytest

from elastic.agent.resumed import baseline, redone


@pytest.mark.parametrize(
    ("committed", "restored", "steps", "why"),
    [
        (-1, -1, 0, ""),  # a node's first round: nothing committed here before
        (0, -1, 0, ""),  # nothing committed yet: starting over loses nothing
        (220, 220, 0, ""),  # a graceful resize: saved at the stop, resumed there
        (221, 222, 0, ""),  # resumed ahead of this node (another node's newer state)
        (222, 220, 2, "the newest state any member of the round held is step 220"),
        (222, -1, 222, "no member of the round held a snapshot or checkpoint"),
    ],
)
def test_steps_trained_again(committed: int, restored: int, steps: int, why: str) -> None:
    verdict = redone(committed, restored, 3)
    if not steps:
        assert verdict is None
        return
    assert verdict is not None and verdict.steps == steps
    assert verdict.reason.startswith("round 3 resumes from step") and why in verdict.reason


@pytest.mark.parametrize(
    ("committed", "recorded", "restored", "steps", "whose"),
    [
        (-1, 292, -1, 292, "the newest the job recorded as committed (292, by node b)"),
        (-1, 292, 280, 12, "the newest the job recorded as committed (292, by node b)"),
        (295, 292, 280, 15, "the newest this node's workers committed (295)"),
        (-1, 292, 292, 0, ""),  # resumed where the job was
        (-1, -1, -1, 0, ""),  # a new job
    ],
)
def test_the_jobs_recorded_progress_counts_when_this_node_knows_less(
    committed: int, recorded: int, restored: int, steps: int, whose: str
) -> None:
    """A node that trained none of the steps (restarted, or new) still says how many the
    round trains again, from the progress the job recorded."""
    verdict = redone(committed, restored, 4, recorded, "b")
    if not steps:
        assert verdict is None
        return
    assert verdict is not None and verdict.steps == steps and whose in verdict.reason


@pytest.mark.parametrize(
    ("committed", "lags", "floor"),
    [
        (-1, True, True),  # the writer's steps after its last write are on no record
        (-1, False, False),  # its last word, as it left: nothing newer
        (295, True, False),  # this node's own newest is the count: exact
    ],
)
def test_a_count_from_a_record_its_writer_may_have_outrun_is_said_to_be_a_floor(
    committed: int, lags: bool, floor: bool
) -> None:
    """The record lags its writer by up to an interval: a round of nodes that trained
    none of those steps knows only that many, and says the count is at least that."""
    verdict = redone(committed, 280, 4, 292, "b", lags)
    assert verdict is not None and verdict.steps == max(committed, 292) - 280
    said = "at least" in verdict.reason and "node b records its step every" in verdict.reason
    assert said is floor


def test_a_round_that_never_said_where_it_resumed_hands_its_baseline_on() -> None:
    assert baseline(41, None) == 41  # the round before was judged
    assert baseline(30, 41) == 41  # it rewound to 30 and ended before it said so
    assert baseline(50, 41) == 50  # it trained on past it
