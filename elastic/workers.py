"""The local worker processes of one round: start, poll, signal, stop.

Workers start from the agent's main thread, each in its own session (so a terminal's
Ctrl-C reaches only the agent, which forwards it) and with a parent-death signal, so
they never outlive the agent.
"""

from __future__ import annotations

import enum
import subprocess
import time
from dataclasses import dataclass
from signal import SIGTERM

from elastic.failures import WorkerFailure, collect
from elastic.logs import LogRouter, WorkerStreams
from elastic.procs import die_with_parent, signal_group, stop_group
from elastic.worker_env import Placement, worker_env


class GroupState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class Worker:
    placement: Placement
    proc: subprocess.Popen
    streams: WorkerStreams
    exited_at: float | None = None

    @property
    def local_rank(self) -> int:
        return self.placement.local_rank


class WorkerGroup:
    def __init__(self, command: tuple[str, ...], router: LogRouter, *, role: str, run_id: str,
                 max_restarts: int, virtual_local_rank: bool = False,
                 extra_env: dict[str, str] | None = None) -> None:
        self.command = command
        self.router = router
        self.role = role
        self.run_id = run_id
        self.max_restarts = max_restarts
        self.virtual_local_rank = virtual_local_rank
        self.extra_env = dict(extra_env or {})
        self.workers: list[Worker] = []

    def start(self, placements: list[Placement], extra_env: dict[str, str] | None = None) -> None:
        """Start one process per placement (call from the main thread: see module doc)."""
        assert not self.running, "stop the previous workers first"
        self.router.new_attempt()
        self.workers = []
        try:
            for p in placements:
                streams, plan = self.router.streams(p.local_rank)
                env = worker_env(p, role=self.role, run_id=self.run_id,
                                 max_restarts=self.max_restarts, error_file=streams.error_file,
                                 virtual_local_rank=self.virtual_local_rank,
                                 extra={**self.extra_env, **(extra_env or {})})
                proc = subprocess.Popen(
                    self.command, env=env, stdin=subprocess.DEVNULL, stdout=streams.stdout,
                    stderr=streams.stderr, start_new_session=True, preexec_fn=die_with_parent(),
                )
                streams.attach(proc, self.router.prefix(p.rank, p.local_rank), plan)
                self.workers.append(Worker(p, proc, streams))
        except BaseException:
            self.stop(grace=0)
            raise

    @property
    def running(self) -> bool:
        return any(w.proc.poll() is None for w in self.workers)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def poll(self) -> tuple[GroupState, list[WorkerFailure]]:
        """SUCCEEDED once all exited 0; FAILED as soon as one exited otherwise."""
        if not self.workers:
            return GroupState.IDLE, []
        now = time.time()
        failures = []
        done = 0
        for w in self.workers:
            rc = w.proc.poll()
            if rc is None:
                continue
            if w.exited_at is None:
                w.exited_at = now
            if rc == 0:
                done += 1
            else:
                failures.append(collect(w.placement.rank, w.local_rank, w.proc.pid, rc,
                                        w.streams.error_file, w.exited_at))
        if failures:
            return GroupState.FAILED, failures
        if done == len(self.workers):
            return GroupState.SUCCEEDED, []
        return GroupState.RUNNING, []

    def signal(self, sig: int) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                signal_group(w.proc, sig)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every worker to exit by itself; True if they did."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.running

    def stop(self, grace: float, sig: int = SIGTERM) -> None:
        """``sig`` to every worker's process group, SIGKILL after ``grace``; logs drained."""
        stop_group([w.proc for w in self.workers], grace, sig)
        for w in self.workers:
            w.streams.close()
