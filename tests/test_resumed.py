"""The rule that a round training committed steps again is never silent."""

from __future__ import annotations

import pytest

from elastic.agent.resumed import redone


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
