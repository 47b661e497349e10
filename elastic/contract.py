"""The contract between an agent and its workers: the one place both sides agree on.

The agent (``elastic.agent``) and the worker-side API (``elastic.worker``) run in
different processes and never import each other. What passes between them is defined
here and nowhere else: the environment variables the agent adds on top of torchrun's,
the exit code of a worker that stopped because it was asked to, the layout of the
shared-memory control block, and the encoding of the snapshot policy.

No torch and no etcd here: both sides import this module.
"""

from __future__ import annotations

import enum
import json
import mmap
import os
import re
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
RESTART_MODE_ENV = "ELASTIC_RUN_RESTART_MODE"  # live | respawn (--restart-mode)
# set for workers started before their node joins (agent/lobby.py): init_process_group
# waits for the placement the agent publishes, and takes it
LOBBY_ENV = "ELASTIC_RUN_LOBBY"


class RestartMode(enum.Enum):
    """What follows a membership change for workers that run ``State.run``."""

    LIVE = "live"  # they keep their process and form the new process group in place
    RESPAWN = "respawn"  # they stop and new processes start (every other script, always)


# -- exit codes -----------------------------------------------------------------------------
ALIVE_EVERY = 0.1  # seconds between a State worker's signs of life (ControlBlock.alive)
EXIT_RESIZE = 75  # a worker that saved and stopped because it was asked to: not a failure


def control_path(node_dir: Path, local_rank: int) -> Path:
    """Where the agent puts the control block of the worker with ``local_rank``."""
    return node_dir / f"control-{local_rank}"


def placement_path(control: str | Path) -> Path:
    """Where the agent writes a live worker's next placement (next to its control block)."""
    return Path(f"{control}.placement")


def write_placement(control: str | Path, env: dict[str, str], asked: tuple[int, int]) -> None:
    """The torchrun variables of the worker's new round, and the (abandon, pause)
    generations the agent had asked for when it published them: the asks this placement
    answers (one made after it, before the worker read it, is for this placement's
    round). Atomic (written, then renamed), and published only when the agent bumps the
    block's placement generation."""
    path = placement_path(control)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"env": env, "asked": list(asked)}, sort_keys=True))
    tmp.replace(path)


def read_placement(control: str | Path) -> tuple[dict[str, str], tuple[int, int]]:
    """(the torchrun variables, the asks it answers): see ``write_placement``."""
    found = json.loads(placement_path(control).read_text())
    abandon, pause = found["asked"]
    return dict(found["env"]), (int(abandon), int(pause))


# What a collective says when a peer vanished under it (gloo, NCCL, the store, torch's
# own wrappers): a failure that shows only this is a consequence, not a cause. The agent
# reads it in tracebacks, a live worker in the exception it caught.
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"DistNetworkError|DistBackendError|NCCL communicator was aborted|ncclRemoteError|"
    r"remote process exited|Socket Timeout|Connection refused|recvBytes failed|"
    r"connectFullMesh failed|ProcessGroupNCCL.*(?:timeout|watchdog)"
)


def peer_gone(text: str) -> bool:
    """``text`` (an exception message or a traceback) is a collective failing because a
    peer went away, rather than an error of this worker's own."""
    return bool(_PEER_GONE.search(text))


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
MAGIC = 0x454C5243_00000003  # "ELRC", layout 3
SIZE = 128

USES_STATE = 1  # flag: the worker runs elastic.State (it can save and stop when asked)
REPORTS = 2  # flag: the worker reports progress (State.commit or elastic.report)
LIVE = 4  # flag: the worker runs State.run (it can form a new process group in place)
UNPLACED = 8  # flag: started ahead, it read no placement variable before it was placed
COMING = 16  # flag: it formed its first group in place (started ahead) and goes on to
# State.run: asked to abandon that group, it lets go once there
STUCK = 32  # flag: asked to abandon its group, its main thread is stuck in a collective
# that only the group's timeout ends (``elastic.worker.stuck``): replace it
ELASTIC = 64  # flag: the script imported elastic, in live mode: it may be on its way into
# State.run (importing torch, building its model), where it re-forms in place


class Phase(enum.IntEnum):
    """Where a worker is. RUNNING -> WAITING (live: it let go of its process group, asked
    to or because its collective failed) -> RUNNING (it formed the group of a new
    placement). RUNNING -> LEAVING: it saved and is exiting (EXIT_RESIZE)."""

    RUNNING = 0
    WAITING = 1
    LEAVING = 2


_Q = struct.Struct("<q")
_OFF = {
    "stop": 8,
    "heartbeat": 16,
    "step": 24,
    "flags": 32,
    "restored": 40,
    "alive": 48,
    "pause": 56,
    "abandon": 64,
    "placement": 72,
    "phase": 80,
    "formed": 88,
}


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
        32      flags: USES_STATE, REPORTS, LIVE, UNPLACED, COMING,    worker
                STUCK, ELASTIC
        40      restored: 0 not yet in this placement, else the step   worker
                it resumed from + 2 (1: nothing restored)              (agent: 0)
        48      alive: ns since the epoch, every ALIVE_EVERY s by a    worker
                thread of its own (a frozen process stops it; a main
                thread blocked in a collective does not)
        56      pause generation ("stop at the next step, keep going   agent
                live when the new placement comes")
        64      abandon generation ("the round is broken: leave the    agent
                process group now")
        72      placement generation (the placement file is new)       agent
        80      phase: RUNNING, WAITING or LEAVING                     worker
        88      the placement generation it formed (or tried) last     worker
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
        elif self._get(0) != MAGIC:
            self._map.close()
            raise ValueError(f"{self.path} is not an elastic-run control block (layout 3)")

    def _get(self, off: int) -> int:
        value: int = _Q.unpack_from(self._map, off)[0]
        return value

    def _put(self, off: int, value: int) -> None:
        _Q.pack_into(self._map, off, value)

    # -- agent side ------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._put(_OFF["stop"], self._get(_OFF["stop"]) + 1)

    def request_pause(self) -> None:
        self._put(_OFF["pause"], self._get(_OFF["pause"]) + 1)

    def request_abandon(self) -> None:
        self._put(_OFF["abandon"], self._get(_OFF["abandon"]) + 1)

    def publish_placement(self, env: dict[str, str]) -> None:
        """Write the next placement and bump its generation: the worker forms it."""
        self._put(_OFF["restored"], 0)  # it says again where the new group resumed
        write_placement(self.path, env, (self.abandon_generation, self.pause_generation))
        self._put(_OFF["placement"], self._get(_OFF["placement"]) + 1)

    @property
    def live(self) -> bool:
        return bool(self._get(_OFF["flags"]) & LIVE)

    @property
    def phase(self) -> Phase:
        return Phase(self._get(_OFF["phase"]))

    @property
    def running_in(self) -> int | None:
        """The placement generation whose group the worker trains in; None while it
        has none (it waits for a placement, forms one, or leaves)."""
        return self._get(_OFF["formed"]) if self.phase is Phase.RUNNING else None

    @property
    def stranded(self) -> bool:
        """The worker let go of its group and no placement is on its way: it waits for
        the agent (it was asked to, or its collective failed on its own)."""
        return self.phase is Phase.WAITING and self._get(_OFF["formed"]) == self._get(
            _OFF["placement"]
        )

    @property
    def forming(self) -> bool:
        """The worker forms the group of a placement published to it, and has not yet."""
        formed, placed = self._get(_OFF["formed"]), self._get(_OFF["placement"])
        return self.phase is Phase.WAITING and formed != placed

    @property
    def resyncing(self) -> bool:
        """It formed the group of a placement in place and agrees on the state there (a
        send of the whole state may take minutes): it trained nothing in that group yet."""
        placed = self._get(_OFF["placement"]) > 0 and self.phase is Phase.RUNNING
        return self.live and placed and self.restored_step is None

    @property
    def uses_state(self) -> bool:
        return bool(self._get(_OFF["flags"]) & USES_STATE)

    @property
    def unplaced(self) -> bool:
        """Started ahead, it read none of the variables of its expected placement
        (``elastic.worker.placed``): it can take any other in place."""
        return bool(self._get(_OFF["flags"]) & UNPLACED)

    @property
    def stuck(self) -> bool:
        """It will not let go of its group before the group's timeout (``STUCK``)."""
        return bool(self._get(_OFF["flags"]) & STUCK)

    @property
    def reports(self) -> bool:
        return bool(self._get(_OFF["flags"]) & (USES_STATE | REPORTS))

    @property
    def coming(self) -> bool:
        """On its way from its first group, formed in place, into State.run: it reported
        no step yet (a script that trains outside State.run never gets there)."""
        flags = self._get(_OFF["flags"])
        return bool(flags & COMING) and not flags & (LIVE | REPORTS)

    @property
    def starting(self) -> bool:
        """It imported elastic and has neither gone into State.run nor reported a step: a
        State.run script on its way there, or one that trains outside it and will say so
        at its first step (``REPORTS``)."""
        flags = self._get(_OFF["flags"])
        return bool(flags & ELASTIC) and not flags & (LIVE | REPORTS)

    @property
    def fresh(self) -> bool:
        """It said nothing yet: no flag, no step (it starts up: ``import torch``, say)."""
        return self._get(_OFF["flags"]) == 0 and self._get(_OFF["step"]) == 0

    @property
    def heartbeat(self) -> float:
        """Seconds since the epoch of the last progress report; 0 if never."""
        return self._get(_OFF["heartbeat"]) / 1e9

    @property
    def step(self) -> int:
        return self._get(_OFF["step"])

    @property
    def alive(self) -> float:
        """Seconds since the epoch of the worker process's last sign of life; 0 if it
        gives none (a script without ``elastic.State``)."""
        return self._get(_OFF["alive"]) / 1e9

    @property
    def restored_step(self) -> int | None:
        """The step the worker resumed from in its placement (-1: from the start); None
        until it says."""
        value = self._get(_OFF["restored"])
        return None if value == 0 else value - 2

    # -- worker side -----------------------------------------------------------------------
    @property
    def stop_generation(self) -> int:
        return self._get(_OFF["stop"])

    def mark(self, flag: int) -> None:
        self._put(_OFF["flags"], self._get(_OFF["flags"]) | flag)

    def unmark(self, flag: int) -> None:
        self._put(_OFF["flags"], self._get(_OFF["flags"]) & ~flag)

    def tick(self) -> None:
        """The process lives (see ``alive``)."""
        self._put(_OFF["alive"], time.time_ns())

    def quiet(self) -> None:
        """It gives no signs of life any more (done with State): never judged by them."""
        self._put(_OFF["alive"], 0)

    def restored(self, step: int) -> None:
        """It resumed from ``step`` (-1: nothing to restore) in its current placement."""
        self._put(_OFF["restored"], max(step, -1) + 2)

    def beat(self, step: int | None = None) -> None:
        if step is not None:
            self._put(_OFF["step"], step)
        self._put(_OFF["heartbeat"], time.time_ns())

    @property
    def pause_generation(self) -> int:
        return self._get(_OFF["pause"])

    @property
    def abandon_generation(self) -> int:
        return self._get(_OFF["abandon"])

    @property
    def placement_generation(self) -> int:
        return self._get(_OFF["placement"])

    def waiting(self, consumed: int) -> None:
        """It let go of its process group and waits for a placement newer than
        ``consumed`` (the last it formed, or tried to: a round given up while forming)."""
        self._put(_OFF["formed"], consumed)
        self._put(_OFF["phase"], Phase.WAITING)

    def leaving(self) -> None:
        """It saved and is exiting: nothing of its round depends on it any more."""
        self._put(_OFF["phase"], Phase.LEAVING)

    def running(self, generation: int) -> None:
        """It formed the process group of placement ``generation``."""
        self._put(_OFF["formed"], generation)
        self._put(_OFF["phase"], Phase.RUNNING)

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
