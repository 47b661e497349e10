"""When the ranks of ``elastic.State`` agree: every few steps, not every step.

``commit()`` learns from the other ranks whether to snapshot, stop or pause for a
membership change: one small all-reduce. Beside a step of a few milliseconds that is
most of the step's cost again, and at a thousand ranks a collective of its own every
step is a real cost whatever the step. So the ranks agree every ``gap`` steps: the
smallest gap whose agreements cost at most ``SHARE`` of the time of the steps they
cover, and never more than ``LATENCY`` seconds of steps, so a stop, a pause or a due
snapshot waits at most that long (plus a step). A gap is only ever used once every rank
agreed on it (the MIN of their proposals), so all ranks agree at the same steps: the
multiples of the gap. With ``--snapshot-every N`` the gap divides N, so every N-th step
is an agreement and snapshots land exactly there. A new process group starts again at a
gap of 1. Where DDP's gradient all-reduce carries ``doorbell``, the ranks agree exactly
when one of them rang it, and the schedule is only the fallback.

Torch-free and clock-free: fed measured seconds, tested on synthetic ones.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from elastic.worker.cadence import StepTimes, median

SHARE = 0.02  # of step time the agreements may cost
LATENCY = 0.05  # seconds of steps a stop, pause or due snapshot may wait, at most
LIMIT = 100  # the longest gap, whatever the figures say
KEPT = 9  # agreements timed: their median is an agreement's cost
SETTLED = 18  # steps timed before the bell is weighed against a step: the first ones,
# on a new group, are its warm-up


@dataclass(frozen=True)
class Gap:
    """Steps between agreements, and why."""

    steps: int
    reason: str


def choose(step_s: float | None, cost_s: float | None) -> Gap:
    """The smallest gap with ``cost_s / (gap * step_s) <= SHARE``, cut to ``LATENCY``
    seconds of steps and to ``LIMIT`` (a gap of 1 until both are measured)."""
    if step_s is None or cost_s is None or step_s <= 0:
        return Gap(1, "the step is not measured yet")
    if cost_s <= SHARE * step_s:
        return Gap(1, f"agreeing costs {cost_s * 1e3:.2f} ms beside a {step_s * 1e3:.1f} ms step")
    wanted = math.ceil(cost_s / (SHARE * step_s) - 1e-9)
    bound = max(1, min(LIMIT, math.floor(LATENCY / step_s + 1e-9)))
    steps = min(wanted, bound)
    reason = (
        f"agreeing costs {cost_s * 1e3:.2f} ms beside a {step_s * 1e3:.1f} ms step: "
        f"{cost_s / (steps * step_s):.1%} of step time every {steps} step(s)"
    )
    if steps < wanted:
        reason += f" (at most {LATENCY * 1e3:.0f} ms of steps between agreements)"
    return Gap(steps, reason)


@dataclass(frozen=True)
class Bell:
    """Whether DDP's reduction carries the bell, and why."""

    pays: bool
    reason: str


HOOK_S = 100e-6  # seconds a Python comm hook adds to each bucket's reduction, beside
# DDP's C++ one (its call from C++, the all-reduce issued from Python, the ``then`` on
# gloo's thread): 30-120 us here, measured as 2 ranks of a tiny DDP step in turns


def bell_pays(pass_s: float, step_s: float, buckets: int) -> Bell:
    """Whether DDP's reduction carries the bell (``doorbell``). Its comm hook costs a
    pass over the gradients each step, ``pass_s`` (DDP's C++ reduction scales them as it
    copies them into its buckets; under a hook they are copied, then scaled), and
    ``HOOK_S`` for each of the ``buckets`` it is called for. It may cost what the
    agreements it replaces may: ``SHARE`` of a step of ``step_s``. (Their measured time is
    no guide: it holds the wait for the slowest rank.) So a model whose step is a few
    milliseconds keeps DDP's C++ reduction and agrees on the schedule."""
    cost = pass_s + buckets * HOOK_S
    figures = (
        f"{cost * 1e6:.0f} us ({pass_s * 1e6:.0f} us over the gradients, "
        f"{buckets} bucket(s) at {HOOK_S * 1e6:.0f} us), "
        f"{cost / step_s:.1%} of a {step_s * 1e3:.1f} ms step"
    )
    if cost <= SHARE * step_s:
        return Bell(True, f"the bell's hook costs {figures}")
    return Bell(False, f"the bell's hook would cost {figures}")


class Agreement:
    """The steps at which the ranks agree. ``due(step, group)`` says whether this is one
    (always the first step on a new ``group``: the ranks' schedules start together);
    ``stepped`` and ``timed`` feed a step's and an agreement's time (its own: a fixed
    snapshot interval measures no steps); ``agreed`` takes the gap the ranks reduced."""

    def __init__(self) -> None:
        self.gap = 1
        self.choice = choose(None, None)
        self._next: int | None = None  # None: at the next commit
        self._group: int | None = None  # the control group generation agreed in
        self._steps = StepTimes()  # a step's time, as the snapshot cadence takes it
        self._costs: deque[float] = deque(maxlen=KEPT)

    def due(self, step: int, group: int, bell: bool | None = None) -> bool:
        """``bell``: whether a rank rang ``doorbell`` in this step's gradient reduction
        (None: none carried it); where it did, it alone says."""
        if group != self._group:
            self._group, self._next, self.gap = group, None, 1
            return True
        if bell is not None:
            return bell
        return self._next is None or step >= self._next

    def stepped(self, seconds: float) -> None:
        """A step took ``seconds``, commit to commit, agreement and snapshot left out."""
        self._steps.add(seconds)

    def timed(self, seconds: float) -> None:
        self._costs.append(seconds)

    def proposal(self, every: int | None = None) -> int:
        """This rank's gap, from its figures; with a fixed snapshot interval ``every``,
        the largest divisor of it that is no longer (the least of such proposals is one)."""
        step_s = self._steps.value
        cost_s = median(self._costs) if self._costs else None
        self.choice = choose(step_s, cost_s)
        gap = self.choice.steps
        if every:
            gap = max(d for d in range(1, min(gap, every) + 1) if every % d == 0)
        return gap

    def step_s(self) -> float | None:
        """A step's time, once ``SETTLED`` steps were timed; None before."""
        return self._steps.value if self._steps.count >= SETTLED else None

    def agreed(self, step: int, gap: int) -> bool:
        """The ranks agreed at ``step`` on ``gap``: the next agreement is at the next
        multiple of ``gap``. True if the gap changed."""
        gap = max(1, gap)
        changed = gap != self.gap
        self.gap, self._next = gap, (step // gap + 1) * gap
        return changed
