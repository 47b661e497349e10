"""When a live worker's main thread will never let go of a group it was asked to leave.

An abandon cuts the group's connections and every operation pending on them fails at
once, but one: gloo never fails a send it could not write whole (the peer's socket was
full, or closed under it) when the connection then breaks, and the rank waits for that
send until the group's timeout (30 minutes by default), cut or not (``group``'s module
doc; a broadcast's root whose receiver died meets it, and so does a collective on a group
the script made itself, whose connections are not the group's). Nothing in the process
can end that wait. So after a cut the worker's watcher looks at its main thread: still
inside a collective (a frame of ``torch.distributed``, DDP or autograd innermost) and
using no CPU for ``AFTER`` seconds, it is stuck. The worker says so to its agent, which
replaces the node's workers at once rather than after ``--shutdown-timeout``; a thread
that computes, sleeps or waits for data is never stuck by this rule.
"""

from __future__ import annotations

from dataclasses import dataclass

AFTER = 1.0  # seconds blocked in one place after the cut (an operation that fails, fails in ms)
IDLE_CPU = 0.02  # CPU seconds the main thread may use meanwhile and still be blocked
WAITS = (  # where a main thread blocked in a collective's native wait shows, innermost
    "/torch/distributed/",
    "/torch/nn/parallel/",
    "/torch/autograd/",  # DDP's reducer waits for its all-reduces at the end of backward
    "/elastic/worker/comm.py",
)


@dataclass(frozen=True)
class Blocked:
    """Where the main thread has been since when, and its CPU time then."""

    since: float
    cpu: float
    where: str  # "file:function" of its innermost Python frame


def observe(last: Blocked | None, now: float, cpu: float, where: str) -> Blocked:
    """The main thread's block as of ``now``: the same one while it stays where it was
    using no CPU, else a new one from now."""
    if last is None or where != last.where or cpu - last.cpu > IDLE_CPU:
        return Blocked(now, cpu, where)
    return last


def stuck(block: Blocked, now: float) -> str | None:
    """Why the main thread will not let go by itself, or None while it may."""
    if now - block.since < AFTER:
        return None
    if not any(w in block.where for w in WAITS):
        return None
    return (
        f"blocked in {block.where.rpartition('/')[2]} for {now - block.since:.1f}s after its "
        "group was cut, using no CPU: a send gloo never fails (its peer is gone) holds it "
        "until the group's timeout"
    )
