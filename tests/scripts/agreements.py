"""For the agreement tests' scripts: count a State's agreements of its own, ask rank 1
alone to stop once a step is committed, and commit until the ranks stop."""

from __future__ import annotations

from typing import Any

from elastic.worker import comm


class Agreements:
    """The agreements (all-reduces of the control group) this process takes part in."""

    def __init__(self) -> None:
        self.count = 0
        self.steps: list[int] = []  # the State's committed step at each (once ``state`` set)
        self.state: Any = None
        control = comm.control()
        real = control.all_reduce

        def counted(values: list[int], op: str) -> list[int]:
            self.count += 1
            if self.state is not None:
                self.steps.append(int(self.state._core.values["step"]))
            return real(values, op)

        control.all_reduce = counted  # type: ignore[method-assign]


def stop_rank_1_at(state: Any, rank: int, step: int) -> None:
    """Rank 1 is asked to stop (as its agent would) once ``step`` is committed."""
    if rank == 1:
        core = state._core
        core.stopping = lambda: core.values["step"] >= step


def stopped_at(state: Any) -> int | None:
    """``state.commit()``; the step the ranks stopped at, if they stopped for a resize."""
    try:
        state.commit()
    except SystemExit:  # saved and stopping for a resize (exit code 75)
        return int(state.step)
    return None
