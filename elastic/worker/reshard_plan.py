"""Which rank sends which rows to whom when sharded state (FSDP2 / HSDP) is re-sharded in
memory over a new process group: a pure function of what each rank holds and needs.

Every tensor of the state is cut along its first dimension (FSDP2's ``Shard(0)``; a
``Replicate`` dimension, as HSDP's, gives several ranks the same rows). After a
membership change each rank of the new group offers the rows it still holds, each at
the step it holds them at, and needs the rows of its new shard. The state can be rebuilt
at step ``s`` without a disk read when the offers at ``s`` cover every row needed; the
newest such step wins (a rank whose optimizer stepped once more than the others is
rolled back with them). A row comes from the rank that needs it where it can, else from
the lowest rank that has it: a survivor keeps what it had and sends only the rest.

No torch here: tests build offers and needs by hand.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Offer:
    """Rows ``[lo, hi)`` of tensor ``key`` that ``rank`` holds, as they were at ``step``."""

    rank: int
    step: int
    key: str
    lo: int
    hi: int


@dataclass(frozen=True)
class Need:
    """Rows ``[lo, hi)`` of tensor ``key`` that ``rank`` holds in the new sharding."""

    rank: int
    key: str
    lo: int
    hi: int


@dataclass(frozen=True)
class Move:
    """Rows ``[lo, hi)`` of ``key`` go from ``src`` to ``dst`` (the same rank: a local
    copy)."""

    key: str
    src: int
    dst: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Plan:
    """The state of ``step`` rebuilt from memory; ``values_from``: the rank whose plain
    values (step counter, samplers, optimizer settings...) everyone takes."""

    step: int
    moves: tuple[Move, ...]
    values_from: int
    reason: str

    def sent(self) -> int:
        """Rows that cross between ranks."""
        return sum(m.hi - m.lo for m in self.moves if m.src != m.dst)


@dataclass(frozen=True)
class NoPlan:
    """No step is held whole in memory; ``reason`` names what is missing."""

    reason: str


def plan(
    offers: Iterable[Offer], needs: Iterable[Need], values: dict[int, set[int]]
) -> Plan | NoPlan:
    """The newest step whose rows the offers cover, and the moves that rebuild it.

    ``values``: rank -> the steps whose plain values that rank holds (a newcomer holds
    none)."""
    by_step: dict[int, dict[str, list[Offer]]] = defaultdict(lambda: defaultdict(list))
    for o in offers:
        if o.hi > o.lo:
            by_step[o.step][o.key].append(o)
    wanted = [n for n in needs if n.hi > n.lo]
    steps = sorted(set(by_step).union(*values.values()), reverse=True)
    if not steps:
        return NoPlan("no rank holds any state")
    first_reason = ""
    for step in steps:
        holders = sorted(r for r, held in values.items() if step in held)
        result = _cover(by_step[step], wanted) if holders else None
        if isinstance(result, tuple):
            newest = step == steps[0]
            why = f"step {step} is held whole in memory" + (
                "" if newest else f" (newer steps are not: {first_reason})"
            )
            return Plan(step=step, moves=result, values_from=holders[0], reason=why)
        missing = result if result is not None else f"no rank holds the values of step {step}"
        first_reason = first_reason or missing
    return NoPlan(f"no step is held whole in memory: {first_reason}")


def _cover(held: dict[str, list[Offer]], needs: list[Need]) -> tuple[Move, ...] | str:
    """Moves that give every need its rows from ``held``, or what is missing."""
    moves: list[Move] = []
    for n in needs:
        have = held.get(n.key, [])
        at = n.lo
        while at < n.hi:
            here = [o for o in have if o.lo <= at < o.hi]
            if not here:
                upto = min([o.lo for o in have if o.lo > at] + [n.hi])
                return f"rows {at}-{upto - 1} of {n.key!r} are held by no rank"
            src = min(here, key=lambda o: (o.rank != n.rank, o.rank))
            end = min(n.hi, src.hi)
            moves.append(Move(key=n.key, src=src.rank, dst=n.rank, lo=at, hi=end))
            at = end
    return tuple(moves)
