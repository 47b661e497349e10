"""A tiny shared-memory block per worker: the agent asks, the worker reports.

The agent creates one file per local rank and passes its path in ``ELASTIC_RUN_CONTROL``.
The worker-side API (``State``, ``elastic.heartbeat``) maps it and reads a stop request
or writes its progress with plain 8-byte stores: no syscalls on the training path, and
nothing to lose when either side dies. Knows nothing about etcd or torch.

    offset  field
    0       magic, layout version
    8       stop request generation (agent increments: "save at the next step and exit")
    16      heartbeat, ns since the epoch (worker, at each step or heartbeat)
    24      step (worker)
    32      flags (worker): bit 0 uses State, bit 1 reports progress
    40      newest snapshot step (worker), -1 for none
    48      samples processed (worker)
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

ENV = "ELASTIC_RUN_CONTROL"
SNAPSHOT_DIR_ENV = "ELASTIC_RUN_SNAPSHOT_DIR"  # the node's shared-memory directory
SIZE = 64
MAGIC = 0x454C5243_00000001  # "ELRC", layout 1
EXIT_RESIZE = 75  # a worker that stopped because it was asked to: not a failure

USES_STATE = 1
REPORTS = 2

_Q = struct.Struct("<q")
_OFF = {"stop": 8, "heartbeat": 16, "step": 24, "flags": 32, "snapshot": 40, "samples": 48}


class ControlBlock:
    """One worker's block, mapped by the agent (create) or the worker (open)."""

    def __init__(self, path: str | Path, create: bool = False) -> None:
        self.path = str(path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        if create:
            self._map[:] = bytes(SIZE)
            self._put(0, MAGIC)
            self._put(_OFF["snapshot"], -1)
        elif self._get(0) != MAGIC:
            raise ValueError(f"{self.path} is not an elastic-run control block")

    def _get(self, off: int) -> int:
        return _Q.unpack_from(self._map, off)[0]

    def _put(self, off: int, value: int) -> None:
        _Q.pack_into(self._map, off, value)

    # agent side
    def request_stop(self) -> None:
        self._put(_OFF["stop"], self._get(_OFF["stop"]) + 1)

    @property
    def uses_state(self) -> bool:
        return bool(self._get(_OFF["flags"]) & USES_STATE)

    @property
    def reports(self) -> bool:
        return bool(self._get(_OFF["flags"]) & (USES_STATE | REPORTS))

    @property
    def heartbeat(self) -> float:
        """Seconds since the epoch of the last progress report; 0 if never."""
        return self._get(_OFF["heartbeat"]) / 1e9

    @property
    def step(self) -> int:
        return self._get(_OFF["step"])

    @property
    def snapshot_step(self) -> int:
        return self._get(_OFF["snapshot"])

    @property
    def samples(self) -> int:
        return self._get(_OFF["samples"])

    # worker side
    @property
    def stop_generation(self) -> int:
        return self._get(_OFF["stop"])

    def mark(self, flag: int) -> None:
        self._put(_OFF["flags"], self._get(_OFF["flags"]) | flag)

    def beat(self, step: int | None = None, samples: int | None = None) -> None:
        if step is not None:
            self._put(_OFF["step"], step)
        if samples is not None:
            self._put(_OFF["samples"], samples)
        self._put(_OFF["heartbeat"], time.time_ns())

    def snapshot_taken(self, step: int) -> None:
        self._put(_OFF["snapshot"], step)

    def close(self) -> None:
        self._map.close()


_mine: ControlBlock | None = None
_looked = False


def worker_block() -> ControlBlock | None:
    """This worker's block, if it runs under elastic-run (None under torchrun or alone)."""
    global _mine, _looked
    if not _looked:
        _looked = True
        path = os.environ.get(ENV)
        if path:
            try:
                _mine = ControlBlock(path)
            except (OSError, ValueError):
                _mine = None
    return _mine
