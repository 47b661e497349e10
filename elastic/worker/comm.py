"""The few collectives ``elastic.State`` itself needs, on a gloo group of its own.

The ranks agree on small things (stop now? snapshot now? who holds the newest state?)
with one tiny all-reduce, and the holder of the newest state sends it to the others.
These go through gloo even when training uses NCCL: they are CPU values, and the
default group's collectives must stay the script's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def dist() -> Any:
    """``torch.distributed`` when a default process group exists, else None."""
    import torch.distributed as d

    return d if d.is_available() and d.is_initialized() else None


def rank() -> int:
    d = dist()
    return int(d.get_rank()) if d else int(os.environ.get("RANK", 0))


def world() -> int:
    d = dist()
    return int(d.get_world_size()) if d else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


SETTLE = 0.2  # s: the most a collective waits for gloo's thread to let go of its tensor


@contextlib.contextmanager
def lent(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``, made in Python, lent to a gloo collective: on leaving, wait (the GIL let go;
    at most SETTLE) until gloo's thread let go of it too. Its work is freed by that
    thread after the caller saw it complete, and a tensor that has a Python object takes
    the GIL to be let go: if the interpreter finalizes meanwhile (the script ended right
    after its last commit), the thread exits inside a C++ destructor and the process
    aborts (SIGABRT) after its job succeeded. While a C++ owner holds it, torch holds
    its Python object, so the owners show in its reference count."""
    before = sys.getrefcount(t)
    yield t
    deadline = time.monotonic() + SETTLE
    while sys.getrefcount(t) > before and time.monotonic() < deadline:
        time.sleep(50e-6)


@dataclass(frozen=True)
class Round:
    """Where this worker is in the round it trains in now. A live re-formation changes it
    (a survivor may become rank 0), so read it where it is used, not once before
    ``State.run``: ``state.round.rank``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    restart_count: int

    @property
    def device(self) -> torch.device:
        """This local rank's GPU where there is one for it, else the CPU."""
        if torch.cuda.is_available() and self.local_rank < torch.cuda.device_count():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @classmethod
    def now(cls) -> Round:
        env = os.environ

        def var(name: str, default: int) -> int:
            return int(env.get(name, default))

        return cls(
            rank=rank(),
            world_size=world() if dist() is not None else var("WORLD_SIZE", 1),
            local_rank=local_rank(),
            local_world_size=var("LOCAL_WORLD_SIZE", 1),
            group_rank=var("GROUP_RANK", 0),
            restart_count=var("TORCHELASTIC_RESTART_COUNT", 0),
        )


class ControlGroup:
    """A gloo group over the default group's ranks, made on first use and remade when the
    default group changes (a new process group after a re-formation). One per process
    (``control()``): a re-formation (``group.Group.leave``) makes it forget the old one.

    It holds its groups weakly: the script's ``destroy_process_group`` ends them there,
    its threads joined, as without elastic (held, a group lives on to the interpreter's
    end, its threads with it: see ``lent``)."""

    def __init__(self) -> None:
        self._group: weakref.ref[Any] | None = None
        self._for: weakref.ref[Any] | None = None  # the default group it was made for
        self._generation = 0  # counts the groups made

    def _current(self, world_group: Any) -> bool:
        return self._for is not None and self._for() is world_group

    def group(self) -> Any:
        d = dist()
        if d is None or d.get_world_size() == 1:
            return None
        world_group = d.group.WORLD
        group = self._group() if self._group is not None else None
        if group is None or not self._current(world_group):
            gloo = d.get_backend() == "gloo"
            group = world_group if gloo else d.new_group(backend="gloo")
            self._group, self._for = weakref.ref(group), weakref.ref(world_group)
            self._generation += 1
        return group

    @property
    def generation(self) -> int:
        """Changes with the group (a new default group after a re-formation): what
        ``agreement.Agreement`` starts its schedule over on. Asked at every commit: one
        look at the default group while it is the one the control group was made for."""
        d = dist()
        if d is None or not self._current(d.group.WORLD):
            self.group()
        return self._generation

    def forget(self) -> None:
        """Drop the group (a re-formation): the next collective makes a new one."""
        self._group = self._for = None

    def all_reduce(self, values: list[int], op: str) -> list[int]:
        """``values`` reduced over all ranks with ``op`` (MAX, MIN, SUM)."""
        group = self.group()
        if group is None:
            return values
        d = dist()
        t = torch.tensor(values, dtype=torch.int64)
        with lent(t):
            d.all_reduce(t, op=getattr(d.ReduceOp, op), group=group)
        return [int(v) for v in t.tolist()]

    def broadcast(self, blob: memoryview | None, holder: int) -> memoryview:
        """``holder``'s bytes on every rank (``blob`` is ignored elsewhere). The receiving
        buffer is a bytearray that torch writes into: no numpy needed."""
        d = dist()
        group = self.group()
        size = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64)
        with lent(size):
            d.broadcast(size, src=holder, group=group)
        if blob is not None and rank() == holder:
            with warnings.catch_warnings():  # a read-only buffer is fine: it is only sent
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(blob, dtype=torch.uint8)
            with lent(data):
                d.broadcast(data, src=holder, group=group)
            return blob
        out = bytearray(int(size.item()))
        if out:
            with lent(torch.frombuffer(out, dtype=torch.uint8)) as into:
                d.broadcast(into, src=holder, group=group)
        return memoryview(out)

    def swap(self, blob: memoryview, to: int, source: int) -> memoryview:
        """Send ``blob`` to rank ``to`` while receiving ``source``'s (every rank calls it,
        each sending to one rank and receiving from one, as in a ring)."""
        d = dist()
        group = self.group()

        def both(send: torch.Tensor, recv: torch.Tensor | None) -> None:
            ops = [d.P2POp(d.isend, send, to, group)]
            if recv is not None:
                ops.append(d.P2POp(d.irecv, recv, source, group))
            for work in d.batch_isend_irecv(ops):
                work.wait()

        size = torch.zeros(1, dtype=torch.int64)
        both(torch.tensor([len(blob)], dtype=torch.int64), size)
        out = bytearray(int(size.item()))
        with warnings.catch_warnings():  # a read-only buffer is fine: it is only sent
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(blob, dtype=torch.uint8)
        both(data, torch.frombuffer(out, dtype=torch.uint8) if out else None)
        return memoryview(out)


_control = ControlGroup()


def control() -> ControlGroup:
    """This process's control group (every ``State`` agrees through it)."""
    return _control
