"""The rule that says a live worker's main thread will never let go of a group it was
asked to leave (``elastic.worker.stuck``): blocked in one collective, using no CPU,
for ``AFTER`` seconds after the cut."""

from __future__ import annotations

import pytest

from elastic.worker.stuck import AFTER, IDLE_CPU, Blocked, observe, stuck

BROADCAST = "/site-packages/torch/distributed/distributed_c10d.py:broadcast"
BACKWARD = "/site-packages/torch/autograd/graph.py:_engine_run_backward"
REBUILD = "/site-packages/torch/nn/parallel/distributed.py:_pre_forward"
AGREE = "/work/elastic/worker/comm.py:all_reduce"
SLEEP = "/work/train.py:train"
DATA = "/site-packages/torch/utils/data/dataloader.py:_next_data"


@pytest.mark.parametrize(
    ("where", "blocked_for", "cpu_used", "is_stuck"),
    [
        (BROADCAST, AFTER, 0.0, True),  # gloo's unfinished send to a peer that is gone
        (BACKWARD, AFTER + 5, 0.0, True),  # DDP's reducer waits for its all-reduce
        (REBUILD, AFTER, 0.0, True),  # DDP's bucket broadcast at a forward
        (AGREE, AFTER, 0.0, True),  # State's own agreement
        (BROADCAST, AFTER - 0.1, 0.0, False),  # not yet: a failing operation fails in ms
        (BACKWARD, AFTER + 5, IDLE_CPU * 10, False),  # it computes: it reaches a collective
        (SLEEP, AFTER + 5, 0.0, False),  # the script's own wait, not a collective's
        (DATA, AFTER + 5, 0.0, False),  # waits for a batch from its loader's workers
        ("", AFTER + 5, 0.0, False),  # no Python frame to judge by
    ],
)
def test_who_is_stuck(where: str, blocked_for: float, cpu_used: float, is_stuck: bool) -> None:
    first = observe(None, 100.0, 3.0, where)
    block = observe(first, 100.0 + blocked_for, 3.0 + cpu_used, where)
    assert (stuck(block, 100.0 + blocked_for) is not None) is is_stuck


def test_a_block_starts_over_where_the_thread_moves_or_computes() -> None:
    block = observe(None, 10.0, 1.0, BROADCAST)
    assert observe(block, 10.5, 1.0 + IDLE_CPU / 2, BROADCAST) is block  # the same wait
    moved = observe(block, 10.5, 1.0, AGREE)
    assert moved == Blocked(10.5, 1.0, AGREE) and stuck(moved, 11.0) is None
    computed = observe(block, 10.5, 1.5, BROADCAST)
    assert computed.since == 10.5 and stuck(computed, 11.0) is None


def test_the_reason_names_the_wait() -> None:
    why = stuck(Blocked(0.0, 0.0, BROADCAST), AFTER + 0.5)
    assert why is not None and why.startswith("blocked in distributed_c10d.py:broadcast for 1.5s")
    assert "using no CPU" in why and "group's timeout" in why
