"""The contract between an agent and its workers: the one place both sides agree on.

The agent (``elastic.agent``) and the worker-side API (``elastic.worker``) run in
different processes and never import each other. What passes between them is defined
here and nowhere else: the environment variables the agent adds on top of torchrun's,
the exit code of a worker that stopped because it was asked to, the layout of the
shared-memory control block, and the encoding of the snapshot policy.

No torch and no etcd here: both sides import this module.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# -- environment variables the agent gives every worker (besides torchrun's) ----------------
CONTROL_ENV = "ELASTIC_RUN_CONTROL"  # path of this worker's control block
NODE_DIR_ENV = "ELASTIC_RUN_NODE_DIR"  # the node's shared-memory directory (snapshots)
NODE_ID_ENV = "ELASTIC_RUN_NODE_ID"  # this node's id in the job (metrics labels)
POLICY_ENV = "ELASTIC_RUN_SNAPSHOT_POLICY"  # SnapshotPolicy.encode()
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where workers' metrics go (prometheus-client)

WORKER_ENV = (CONTROL_ENV, NODE_DIR_ENV, NODE_ID_ENV, POLICY_ENV, MULTIPROC_ENV)

# -- exit codes -----------------------------------------------------------------------------
EXIT_RESIZE = 75  # a worker that saved and stopped because it was asked to: not a failure


def control_path(node_dir: Path, local_rank: int) -> Path:
    """Where the agent puts the control block of the worker with ``local_rank``."""
    return node_dir / f"control-{local_rank}"


# -- the snapshot policy ----------------------------------------------------------------------
@dataclass(frozen=True)
class SnapshotPolicy:
    """When ``elastic.State`` snapshots (to the node's shared memory) and checkpoints (to
    ``checkpoint_dir``). The agent's flags set it for the workers through ``POLICY_ENV``."""

    # steps between snapshots; 0: only when stopping for a resize; "auto": as often as
    # keeps their cost within ``budget`` of the step time (elastic.worker.cadence)
    every: int | str = "auto"
    budget: float = 0.02
    checkpoint_every: int = 100  # snapshots between checkpoints to checkpoint_dir
    keep: int = 3  # checkpoints kept in checkpoint_dir
    checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, str):
            if self.every != "auto":
                raise ValueError(f"snapshot every {self.every!r}: a number of steps, or auto")
        elif self.every < 0:
            raise ValueError(f"snapshot every {self.every}: must be >= 0")
        if not 0 < self.budget < 1:
            raise ValueError(f"snapshot budget {self.budget}: must be between 0 and 1")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint every {self.checkpoint_every}: must be >= 1")
        if self.keep < 1:
            raise ValueError(f"keep {self.keep}: at least one checkpoint must be kept")

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> SnapshotPolicy:
        try:
            fields = json.loads(text)
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"${POLICY_ENV}={text!r} is not a snapshot policy: {e}") from None

    @classmethod
    def from_env(cls) -> SnapshotPolicy:
        """The agent's policy, or the defaults outside elastic-run."""
        text = os.environ.get(POLICY_ENV)
        return cls.decode(text) if text else cls()


# -- the control block --------------------------------------------------------------------------
MAGIC = 0x454C5243_00000002  # "ELRC", layout 2
SIZE = 64

USES_STATE = 1  # flag: the worker runs elastic.State (it can save and stop when asked)
REPORTS = 2  # flag: the worker reports progress (State.commit or elastic.report)

_Q = struct.Struct("<q")
_OFF = {"stop": 8, "heartbeat": 16, "step": 24, "flags": 32, "snapshot": 40, "samples": 48}


class ControlBlock:
    """A tiny shared-memory block per worker: the agent asks, the worker reports.

    The agent creates one file per local rank and passes its path in ``CONTROL_ENV``;
    both sides map it and use plain 8-byte loads and stores: no syscalls on the training
    path, and nothing to lose when either side dies.

        offset  field                                                  written by
        0       magic and layout version                               agent
        8       stop request generation ("save at the next step")      agent
        16      heartbeat, ns since the epoch                          worker
        24      step                                                   worker
        32      flags: USES_STATE, REPORTS                             worker
        40      newest snapshot step, -1 for none                      worker
        48      samples processed                                      worker
    """

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
            self._map.close()
            raise ValueError(f"{self.path} is not an elastic-run control block (layout 2)")

    def _get(self, off: int) -> int:
        value: int = _Q.unpack_from(self._map, off)[0]
        return value

    def _put(self, off: int, value: int) -> None:
        _Q.pack_into(self._map, off, value)

    # -- agent side ------------------------------------------------------------------------
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

    # -- worker side -----------------------------------------------------------------------
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
        path = os.environ.get(CONTROL_ENV)
        if path:
            try:
                _mine = ControlBlock(path)
            except (OSError, ValueError):
                _mine = None
    return _mine
