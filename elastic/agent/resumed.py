"""Whether a round trains again what this node's workers had committed: never silently.

A new round resumes from the newest state any of its members holds; when that is older
than the newest step this node's workers committed before, or than the job's recorded
progress (the state's holder was lost, or no member had a snapshot yet, or every node
that trained those steps is gone), steps are trained again. The rule is here; the agent
logs its verdict as a warning and counts the steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from rendezvous.rules import PROGRESS_EVERY


@dataclass(frozen=True)
class Redone:
    """Committed steps a round trains again, and why."""

    steps: int
    reason: str


def baseline(last_step: int, pending: int | None) -> int:
    """The newest step this node's workers committed before a new round, against which
    that round's resumption is judged: their newest step now (``last_step``), but not
    below the baseline of a round that ended before its workers said where they resumed
    (``pending``): they may have rewound to an older state in it (a live re-formation
    restores before it says so), and a second change then would hide the steps lost."""
    return last_step if pending is None else max(last_step, pending)


def redone(
    committed: int,
    restored: int,
    round_number: int,
    recorded: int = -1,
    by: str = "",
    lags: bool = False,
) -> Redone | None:
    """``committed``: the newest step this node's workers committed before the round
    (-1: none, as on a node's first round); ``restored``: the step its workers resumed
    from (-1: nothing restored, the job starts over); ``recorded``: the newest step the
    job recorded as committed (``job/progress``, written by node ``by``; -1: none), which
    a round of new nodes alone knows; ``lags``: that record was not its writer's last
    word, so the writer may have committed up to an interval's steps more: the count is
    then a floor, and the warning says so. None: nothing is trained again."""
    start = max(restored, 0)
    newest = max(committed, recorded)
    if newest <= start:
        return None
    steps = newest - start
    behind, floor = f"{steps} step(s) behind", ""
    if committed >= recorded:
        whose = f"the newest this node's workers committed ({committed})"
    else:
        whose = f"the newest the job recorded as committed ({recorded}, by node {by})"
        if lags:
            behind = f"at least {behind}"
            floor = (
                f" (node {by} records its step every {PROGRESS_EVERY:g} s or so,"
                " and may have committed more since)"
            )
    if restored < 0:
        why = "no member of the round held a snapshot or checkpoint: training starts over"
    else:
        why = f"the newest state any member of the round held is step {restored}"
    return Redone(
        steps,
        f"round {round_number} resumes from step {start}, {behind} {whose}: {why}{floor}",
    )
