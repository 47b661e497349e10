"""How often ``elastic.State`` snapshots: as often as keeps the cost within a budget.

``--snapshot-every auto`` (the default) measures, as training runs, what a step takes and
what a snapshot adds to it, and snapshots every N steps for the smallest N whose cost
stays at or below ``--snapshot-budget`` of the step time (CheckFreq's rule). A snapshot's
cost is measured, not assumed: it is the time it blocked the training thread (inside
``commit()``) plus the time the steps it disturbed (the step right after it, and any
step started while its copy was still running) took beyond a clean step, so the copy's
competition for cores and memory bandwidth is counted too. The steps' excess is noise
around that competition (on a busy host, tens of milliseconds either way beside a
100 ms step), so a snapshot never costs less than the time it blocked: a median of
noise at or below zero made a 16 MB model snapshot at every step, 1.7x its step time.

Sharded state kept live snapshots to memory and writes its DCP checkpoint to the disk at
an interval of its own (``apart``): each then has a share of the budget, so the two
together stay within it.

Torch-free, and the clock is injected: tested on synthetic step times.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

WARMUP = 2  # the first steps allocate (optimizer state, snapshot slots): not measured
PROBE = 3  # clean steps measured before the first snapshot
REFRESH = 20  # at interval 1, one step in this many is left clean to re-measure steps
PAUSE = 10  # a step this many times the median is a pause, not a step
PAUSE_RUN = 3  # unless this many come in a row
LIMIT = 1000  # the longest interval chosen, whatever the measurements say
BLOCK = 8  # clean steps to a block: its median is taken once it is full
BLOCKS = 9  # block medians kept: their median is a step's time (72 clean steps)
COSTS_KEPT = 5  # snapshot costs kept: their median is a snapshot's cost
AIM = 0.8  # a new interval aims at this share of the budget: room for noise
LOW = 0.4  # and is kept while its cost stays between this share and all of the budget
APART = 0.5  # the budget's share for memory where the disk is written apart; the disk's: the rest


def median(xs: Iterable[float]) -> float:
    """``statistics.median``, at a third of its cost: it runs at every step."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class StepTimes:
    """A step's time: the median of the medians of the last ``BLOCKS`` blocks of ``BLOCK``
    steps (of the steps so far until the first block is full); the cadence feeds it clean
    steps, the agreement schedule every step. The median of the last 9 steps, 10 ms of a
    tiny model's steps, moved 0.7-4 ms with this VM's slow spells, and the interval
    chosen from it 40-310 steps: each move took an agreement of the ranks (150 in 6000
    steps, 3% of the step time). A step costs an append here; two short sorts every
    ``BLOCK`` steps."""

    def __init__(self) -> None:
        self.value: float | None = None
        self.count = 0  # steps taken in since the last ``clear``
        self._block: list[float] = []
        self._blocks: deque[float] = deque(maxlen=BLOCKS)

    def add(self, seconds: float) -> bool:
        """Take in a step; True if ``value`` changed."""
        self.count += 1
        self._block.append(seconds)
        if len(self._block) == BLOCK:
            self._blocks.append(median(self._block))
            self._block.clear()
        elif self._blocks:
            return False
        else:  # the first block: what there is
            self.value = median(self._block)
            return True
        self.value = median(self._blocks)
        return True

    def clear(self) -> None:
        self.value, self.count = None, 0
        self._block.clear()
        self._blocks.clear()


@dataclass(frozen=True)
class Choice:
    """An interval and why: the figures it came from, for the log."""

    interval: int
    reason: str


def choose(step_s: float, cost_s: float, budget: float, aim: float = AIM) -> Choice:
    """The smallest interval N with ``cost_s / (N * step_s) <= aim * budget``, within
    1..LIMIT."""
    if cost_s <= 0 or step_s <= 0:
        return Choice(1, f"a snapshot costs nothing measurable beside a {step_s * 1e3:.0f} ms step")
    n = max(1, math.ceil(cost_s / (aim * budget * step_s) - 1e-9))
    capped = n > LIMIT
    n = min(n, LIMIT)
    share = cost_s / (n * step_s)
    reason = (
        f"a snapshot costs {cost_s * 1e3:.0f} ms, a step {step_s * 1e3:.0f} ms: "
        f"{share:.1%} of step time (budget {budget:.1%})"
    )
    if capped:
        reason += f"; capped at {LIMIT} steps"
    return Choice(n, reason)


class Cadence:
    """When to snapshot. ``fixed``: every that many steps (0: only before a stop), not
    measured; None: by the budget. All ranks must agree: ``agree`` takes the interval the
    ranks reduced with MAX from their ``proposal``s."""

    def __init__(
        self,
        budget: float,
        fixed: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if fixed is None and not 0 < budget < 1:
            raise ValueError(f"snapshot budget {budget}: must be between 0 and 1")
        self.budget = budget
        self.fixed = fixed
        self.clock = clock  # what State times the steps with
        self.interval = fixed if fixed is not None else 0  # 0: not chosen yet
        self.proposal = self.interval
        self._told = self.proposal  # the proposal this rank last took to an agreement
        self.last = 0  # the step of the latest snapshot
        self.choice: Choice | None = None  # this rank's latest choice, for the log
        self._steps = StepTimes()  # clean steps' times
        self._costs: deque[float] = deque(maxlen=COSTS_KEPT)  # snapshots' costs
        self._seen = 0  # steps observed
        self._excess = 0.0  # the cost of the latest snapshot so far
        self._blocked = 0.0  # ... of it, the time it held the training thread
        self._measuring = False  # its disturbed steps are being added up
        self._long = 0  # steps in a row far longer than the median
        self.apart = False  # the disk is written at an interval of its own (``taken``)

    @property
    def step_s(self) -> float | None:
        """A clean step's time (``StepTimes``)."""
        return self._steps.value

    @property
    def cost_s(self) -> float | None:
        """A snapshot's cost: the median of the latest ones."""
        return max(median(self._costs), 0.0) if self._costs else None

    @property
    def at_risk(self) -> int:
        """The most committed steps a crash can lose at this interval (at interval 1 by
        the budget, the refresh step left clean makes that 2)."""
        if self.fixed is not None:
            return self.fixed
        return 2 if self.interval == 1 else self.interval

    def due(self, step: int) -> bool:
        """Whether to snapshot at ``step`` (all ranks compute the same)."""
        if self.fixed is not None:
            return self.fixed > 0 and step % self.fixed == 0
        if self.interval == 0:  # one probe snapshot, once steps are measured
            return self.last == 0 and self._steps.count >= PROBE
        if self.interval == 1:
            return step % REFRESH != 0
        return step - self.last >= self.interval

    def observe(self, seconds: float, disturbed: bool) -> None:
        """One step took ``seconds`` (commit to commit); ``disturbed``: a snapshot was
        taken at its start or its copy was still running then."""
        self._seen += 1
        if self.fixed is not None or self._seen <= WARMUP or self._pause(seconds):
            return
        if disturbed:  # not clamped at 0: noise either way cancels out in the median
            step_s = self.step_s
            if self._measuring and step_s is not None:
                self._excess += seconds - step_s
            return
        self._finish_cost()
        if self._steps.add(seconds):
            self._reconsider()

    def _pause(self, seconds: float) -> bool:
        """A step far longer than the median (an evaluation, a pause between commits)
        says nothing about steps or snapshots: it is left out, and the snapshot being
        measured goes unmeasured. A few in a row are the new normal: steps are re-measured."""
        step_s = self.step_s
        if step_s is None or seconds <= PAUSE * step_s:
            self._long = 0
            return False
        self._long += 1
        self._measuring = False
        self._excess = self._blocked = 0.0
        if self._long < PAUSE_RUN:
            return True
        self._steps.clear()  # what a snapshot costs has not changed
        self._long = 0
        return False

    def taken(self, step: int, apart: bool = False) -> None:
        """A snapshot was taken at ``step``: its cost is measured from the next step.
        ``apart``: it went to memory, and the disk is written at an interval of its own
        (``disk_due``): memory's interval is then chosen within its share of the budget."""
        self._finish_cost()
        self.last = step
        self._measuring = self.fixed is None and self.step_s is not None
        if apart != self.apart:
            self.apart = apart
            self._reconsider(moved=True)

    @property
    def _memory_budget(self) -> float:
        return self.budget * APART if self.apart else self.budget

    @property
    def urgent(self) -> bool:
        """This rank's proposal is worth agreeing on before the next snapshot falls due
        (where the ranks agree anyway): a new one, while none is agreed yet or wanting
        snapshots twice as often or more (not one another rank's longer one outbid)."""
        if not self._new:
            return False
        return self.interval == 0 or 2 * self.proposal <= self.interval

    def asks(self, snapshot: bool) -> bool:
        """Whether this rank asks the ranks to agree on its proposal at a step where
        ``snapshot`` is due or not: an urgent one at once, any other new one with the
        next snapshot (where the ranks' own schedule agrees anyway; without asking, a
        bell that rang for the snapshot alone would never carry it)."""
        return self.urgent or (snapshot and self._new)

    @property
    def _new(self) -> bool:
        """A proposal this rank has not yet taken to an agreement, nor agreed already."""
        return 0 < self.proposal != self.interval and self.proposal != self._told

    def blocked(self, seconds: float) -> None:
        """The snapshot just taken held the training thread for ``seconds`` (inside
        ``commit()``, which no step's time includes): part of its cost."""
        if self._measuring:
            self._excess += seconds
            self._blocked += seconds

    def disk_due(self, step: int, last: int, cost_s: float) -> bool:
        """Whether a snapshot at ``step`` also writes the disk, where memory keeps every
        one (sharded state kept live: the rows live on the next node too, and the disk
        serves only a loss memory cannot cover): where the disk was written last at
        ``last`` (-1: not by this rank yet) and it costs ``cost_s``, at the interval the
        disk's share of the budget allows (memory's snapshots spend the rest: ``taken``).
        Fixed, or before steps are measured: every time."""
        step_s = self.step_s
        if self.fixed is not None or step_s is None or last < 0 or cost_s <= 0:
            return True
        return step - last >= choose(step_s, cost_s, self.budget * (1 - APART)).interval

    def agree(self, interval: int) -> bool:
        """The interval every rank uses from now on (the MAX of the proposals); True if
        it changed."""
        self._told = self.proposal
        if self.fixed is not None or interval <= 0 or interval == self.interval:
            return False
        self.interval = interval
        return True

    def _finish_cost(self) -> None:
        if not self._measuring:
            return
        self._measuring = False
        self._costs.append(max(self._excess, self._blocked))
        self._excess = self._blocked = 0.0
        self._reconsider()

    def _reconsider(self, moved: bool = False) -> None:
        """A new proposal when the current one is over the budget, or well under it
        (``moved``: the budget itself moved)."""
        step_s, cost_s = self.step_s, self.cost_s
        if step_s is None or cost_s is None:
            return
        current, budget = self.proposal, self._memory_budget
        share = cost_s / (current * step_s) if current and step_s > 0 else 0.0
        if current == 0 or moved or share > budget or share < LOW * budget:
            choice = choose(step_s, cost_s, budget)
            if self.apart:
                why = f"{choice.reason}; the disk's writes take the rest"
                choice = Choice(choice.interval, why)
            self.proposal = choice.interval
            self.choice = choice


def interval_moved(logged: int | None, interval: int) -> bool:
    """Whether the snapshot interval moved far enough from the one last logged to log
    again: the first choice, and moves of 2x or more (from or to 0, ``--snapshot-every
    0``, too). The agreements' gap, which a slow spell of the machine moves 2x within
    seconds, is logged with it but never by itself: the metrics follow it."""
    if logged is None:
        return True
    return interval != logged and not logged / 2 < interval < logged * 2
