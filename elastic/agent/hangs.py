"""When a silent worker is hung: learned from the run itself, without a flag.

As NVIDIA Resiliency Extension learns its timeouts, the allowance is a multiple of the
recent step times (3x the longest of the last 16, plus 1 s), learned once a few steps
were seen; until then (start-up, compilation and the first steps take what they take)
a worker that reported progress once gets a generous ``START`` (10 minutes, NCCL's own
default timeout), so one frozen in its first steps is still found. A worker is
hung when it has made no progress for longer than that *and* its process gave no sign
of life for as long (``elastic.worker.alive``): a rank blocked in a collective, waiting
for a frozen peer, keeps its sign of life and is not blamed. ``--worker-hang-timeout``
overrides all of it with a fixed time for any script that reports progress.

What is learned survives a re-formation (``carried``): a worker frozen in its first
steps after a change is found as fast as before it. Silence is counted only while the
agent itself was there to watch (``hung``'s ``since``): a whole node paused (SIGSTOP, a
VM suspended) resumes agent and workers together, and the workers are not blamed for
the pause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rendezvous.records import HUNG

FACTOR = 3.0  # the allowance: FACTOR x the longest recent step ...
MARGIN = 1.0  # ... plus MARGIN seconds
FLOOR = 2.0  # and never less than FLOOR seconds
LEARN = 3  # step intervals seen before the allowance is learned
START = 600.0  # the allowance until then
KEEP = 16  # the recent intervals that count


@dataclass(frozen=True)
class Allowance:
    """Seconds of silence allowed, and where the figure comes from (for the report)."""

    seconds: float
    why: str


def allowance(intervals: Sequence[float]) -> Allowance:
    """The silence allowed after these intervals between progress reports (oldest first):
    ``START`` while too few were seen to learn from."""
    if len(intervals) < LEARN:
        return Allowance(START, f"only {len(intervals)} step(s) timed yet, {LEARN} to learn from")
    seconds = FACTOR * max(intervals[-KEEP:]) + MARGIN
    if seconds < FLOOR:
        return Allowance(FLOOR, "the floor, above its recent step times")
    return Allowance(seconds, f"{FACTOR:g}x its recent step time + {MARGIN:g}s")


PAUSED = 1.0  # seconds between two looks at the workers that mean the agent was not running


def interval(
    last: tuple[float, int | None], beat: tuple[float, int | None], watched_from: float = 0.0
) -> float | None:
    """The step interval between two progress reports (time, the group each came from:
    ``ControlBlock.running_in``), if it is one: both in the same group, and the agent
    watching without a gap since ``watched_from`` (``watched_since``) from before the
    first. One that spans a re-formation, a wait for a placement (which beats too), or a
    pause of the whole node (SIGSTOP, a suspended VM: chaos seed 113 learned a 7 s step
    from a freeze, and a worker hung after it went unfound for 15 s) times no step."""
    (before, group), (now, same) = last, beat
    if not before or group is None or same != group or before < watched_from:
        return None
    return now - before


def carried(intervals: Sequence[float], old_world: int, new_world: int) -> list[float]:
    """The step intervals a worker re-formed from ``old_world`` ranks into ``new_world``
    keeps: a fixed global batch split over fewer ranks takes up to ``old/new`` times as
    long a step (and a rank's own batch no longer), so those bound its new steps until
    it has timed its own."""
    factor = max(1.0, old_world / max(new_world, 1))
    return [x * factor for x in intervals[-KEEP:]]


def watched_since(since: float, last_look: float, now: float) -> float:
    """From when a worker's silence counts, the agent looking at ``now`` (its last look
    at ``last_look``): a gap of ``PAUSED`` means the agent itself was stopped or busy,
    and what the workers did meanwhile cannot be told."""
    return now if now - last_look > PAUSED else since


def hung(
    now: float, progress_at: float, alive_at: float, allowed: Allowance, since: float = 0.0
) -> str | None:
    """Why a worker silent since ``progress_at`` (alive at ``alive_at``, 0: it gives no
    sign of life) is hung at ``now``, watched without a gap ``since``; None if it is
    not, or cannot be told."""
    if not progress_at or not alive_at:
        return None
    silent, still = now - progress_at, now - alive_at
    if min(silent, still, now - since) <= allowed.seconds:
        return None
    return (
        f"{HUNG}no progress for {silent:.1f}s and no sign of life for {still:.1f}s "
        f"(allowed {allowed.seconds:.1f}s: {allowed.why})"
    )
