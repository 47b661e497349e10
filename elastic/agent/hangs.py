"""When a silent worker is hung: learned from the run itself, without a flag.

As NVIDIA Resiliency Extension learns its timeouts, the allowance is a multiple of the
recent step times (3x the longest of the last 16, plus 1 s), judged only once a few steps
were seen (start-up, compilation and the first steps take what they take). A worker is
hung when it has made no progress for longer than that *and* its process gave no sign
of life for as long (``elastic.worker.alive``): a rank blocked in a collective, waiting
for a frozen peer, keeps its sign of life and is not blamed. ``--worker-hang-timeout``
overrides all of it with a fixed time for any script that reports progress.
"""

from __future__ import annotations

from collections.abc import Sequence

FACTOR = 3.0  # the allowance: FACTOR x the longest recent step ...
MARGIN = 1.0  # ... plus MARGIN seconds
FLOOR = 2.0  # and never less than FLOOR seconds
LEARN = 3  # step intervals seen before any judgement
KEEP = 16  # the recent intervals that count


def allowance(intervals: Sequence[float]) -> float | None:
    """Seconds of silence allowed after these intervals between progress reports (oldest
    first); None while too few were seen to judge."""
    if len(intervals) < LEARN:
        return None
    return max(FACTOR * max(intervals[-KEEP:]) + MARGIN, FLOOR)


def hung(now: float, progress_at: float, alive_at: float, allowed: float | None) -> str | None:
    """Why a worker silent since ``progress_at`` (alive at ``alive_at``, 0: it gives no
    sign of life) is hung at ``now``; None if it is not, or cannot be told."""
    if allowed is None or not progress_at or not alive_at:
        return None
    silent, still = now - progress_at, now - alive_at
    if silent <= allowed or still <= allowed:
        return None
    return (
        f"hung: no progress for {silent:.1f}s and no sign of life for {still:.1f}s "
        f"(allowed {allowed:.1f}s: {FACTOR:g}x its recent step time + {MARGIN:g}s)"
    )
