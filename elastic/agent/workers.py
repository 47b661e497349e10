"""The local worker processes of one round: start, poll, signal, stop.

Workers start from the agent's main thread, each in its own session (so a terminal's
Ctrl-C reaches only the agent, which forwards it) and with a parent-death signal, so
they never outlive the agent.
"""

from __future__ import annotations

import enum
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import IO

import psutil

from elastic.agent import hangs, lobby
from elastic.agent.collectors import WorkerProc
from elastic.agent.failures import WorkerFailure, collect
from elastic.agent.filetimer import FILE_ENV, FileTimerServer
from elastic.agent.forkserver import ForkServer
from elastic.agent.logs import LogRouter, WorkerStreams
from elastic.agent.placement import Placement, round_env, worker_env
from elastic.agent.procs import Process, die_with_parent, signal_group, stop_group
from elastic.contract import (
    CONTROL_ENV,
    EXIT_RESIZE,
    LOBBY_ENV,
    NODE_DIR_ENV,
    ControlBlock,
    Phase,
    control_path,
)

EXIT_GRACE = 0.5  # seconds a leaving node's saved workers get to end before a SIGKILL
ESCALATE_EVERY = 0.05  # seconds between asks whether a pause must become an abandon


class GroupState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"  # they saved and exited for a resize (EXIT_RESIZE)
    FAILED = "failed"


class Drained(enum.Enum):
    """How a drain ended."""

    STOPPED = "stopped"  # all exited by themselves (saved for the resize, or on the signal)
    FINISHED = "finished"  # State users that all exited 0: training was over, not paused
    KILLED = "killed"  # some still ran after the timeout
    FROZEN = "frozen"  # one hung (``frozen``): it never saves, and the others wait for it


class Held(enum.Enum):
    """How a hold ended."""

    HELD = "held"  # every worker let go of its group and waits for a placement
    FINISHED = "finished"  # all exited 0: training was over before they could pause
    FAILED = "failed"  # one exited otherwise, did not let go, or was late
    HUNG = "hung"  # one hung by the learned rule (``frozen``): this node's own fault


@dataclass(frozen=True)
class ForkTarget:
    """What the fork server runs in each forked worker (``--start-method forkserver``)."""

    server: ForkServer
    target: str  # the script, or the module with ``module``
    args: tuple[str, ...]
    module: bool


@dataclass
class Worker:
    placement: Placement
    proc: Process
    streams: WorkerStreams
    control: ControlBlock
    exited_at: float | None = None
    beats: list[float] = field(default_factory=list)  # seconds between progress reports
    last_beat: tuple[float, int | None] = (0.0, None)  # and the group it came from

    @property
    def local_rank(self) -> int:
        return self.placement.local_rank


class WorkerGroup:
    def __init__(
        self,
        command: tuple[str, ...],
        router: LogRouter,
        node_dir: Path,
        *,
        role: str,
        run_id: str,
        max_restarts: int,
        virtual_local_rank: bool = False,
        extra_env: dict[str, str] | None = None,
        forkserver: ForkTarget | None = None,
        watchdog: FileTimerServer | None = None,
    ) -> None:
        """``forkserver``: (server, script or module, its arguments, is a module) to fork
        workers from instead of starting ``command``."""
        self.command = command
        self.forkserver = forkserver
        self.router = router
        self.node_dir = node_dir
        self.role = role
        self.run_id = run_id
        self.max_restarts = max_restarts
        self.virtual_local_rank = virtual_local_rank
        self.extra_env = dict(extra_env or {})
        self.workers: list[Worker] = []
        self.ahead: tuple[Placement, ...] = ()  # the placements started ahead (lobby.py)
        self._newest_step = -1  # of workers already stopped
        self._used_state = False  # ... and whether they all ran elastic.State
        self._closed = False  # their control blocks are closed
        self._looked = 0.0  # when the agent last looked at the workers' silence
        self._since = 0.0  # ... and since when it has looked without a gap
        self.drain_frozen: list[WorkerFailure] = []  # the hung ones that ended the last drain
        self.hold_frozen: list[WorkerFailure] = []  # ... and those that ended the last hold
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.workers = lambda: self.pids
            self.extra_env[FILE_ENV] = watchdog.path

    def start(self, placements: list[Placement], ahead: bool = False) -> None:
        """Start one process per placement (call from the main thread: see module doc).
        ``ahead``: before this node joins (``lobby``); the workers wait in their
        ``init_process_group`` for the placement ``reform`` publishes."""
        assert not self.running, "stop the previous workers first"
        self.router.new_attempt()
        self.workers = []
        self.ahead = tuple(placements) if ahead else ()
        self._closed = False
        lobby_env = {LOBBY_ENV: "1"} if ahead else {}
        try:
            for p in placements:
                streams = self.router.streams(p.rank, p.local_rank)
                block_path = control_path(self.node_dir, p.local_rank)
                block = ControlBlock(block_path, create=True)
                env = worker_env(
                    p,
                    role=self.role,
                    run_id=self.run_id,
                    max_restarts=self.max_restarts,
                    error_file=streams.error_file,
                    virtual_local_rank=self.virtual_local_rank,
                    extra={
                        **self.extra_env,
                        CONTROL_ENV: str(block_path),
                        NODE_DIR_ENV: str(self.node_dir),
                        **lobby_env,
                    },
                )
                if ahead:
                    env["PYTHONPATH"] = lobby.site_path(env.get("PYTHONPATH"))
                proc = self._launch(env, streams)
                streams.attach(proc)
                self.workers.append(Worker(p, proc, streams, block))
        except BaseException:
            self.stop(grace=0)
            raise

    def _launch(self, env: dict[str, str], streams: WorkerStreams) -> Process:
        """Start one worker; its stdin is the agent's, as under torchrun."""
        if self.forkserver is None:
            return subprocess.Popen(
                self.command,
                env=env,
                stdin=None,
                stdout=streams.stdout,
                stderr=streams.stderr,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        fork = self.forkserver
        ours: list[IO[bytes]] = []  # our ends of the pipes, for the log pumps
        theirs: list[int] = []  # the worker's stdin, stdout, stderr: closed here once sent
        try:
            theirs.append(_dup_or_null(0, os.O_RDONLY))
            for target, inherited in ((streams.stdout, 1), (streams.stderr, 2)):
                if target == subprocess.PIPE:
                    r, w = os.pipe()
                    ours.append(os.fdopen(r, "rb"))
                    theirs.append(w)
                elif target == subprocess.DEVNULL:
                    theirs.append(os.open(os.devnull, os.O_WRONLY))
                elif target is None:
                    theirs.append(_dup_or_null(inherited, os.O_WRONLY))
                else:
                    assert not isinstance(target, int)
                    theirs.append(os.dup(target.fileno()))
            stdin, stdout, stderr = theirs
            proc = fork.server.spawn(
                fork.target, fork.args, fork.module, env, (stdin, stdout, stderr)
            )
        except BaseException:
            for f in ours:
                f.close()
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        pipes = iter(ours)
        proc.stdout = next(pipes) if streams.stdout == subprocess.PIPE else None
        proc.stderr = next(pipes) if streams.stderr == subprocess.PIPE else None
        return proc

    @property
    def running(self) -> bool:
        return any(w.proc.poll() is None for w in self.workers)

    def last_step(self) -> int:
        """The newest step any worker of this group reported (-1: none)."""
        if self._closed:
            return self._newest_step
        return max([self._newest_step, *(w.control.step for w in self.workers)])

    def restored(self) -> int | None:
        """The step this group's workers resumed from in their placement (-1: from the
        start); None until every worker running ``elastic.State`` said, or if none does."""
        if self._closed or not self.use_state:
            return None
        steps = [w.control.restored_step for w in self.workers]
        if any(s is None for s in steps):
            return None
        return min(s for s in steps if s is not None)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def poll(self) -> tuple[GroupState, list[WorkerFailure]]:
        """SUCCEEDED once all exited 0, STOPPED once all exited and some for a resize,
        FAILED as soon as one exited otherwise."""
        if not self.workers:
            return GroupState.IDLE, []
        now = time.time()
        failures = []
        done = resized = 0
        for w in self.workers:
            rc = w.proc.poll()
            if rc is None:
                continue
            if w.exited_at is None:
                w.exited_at = now
            if rc == 0:
                done += 1
            elif rc == EXIT_RESIZE:
                resized += 1
            else:
                w.streams.settle()  # what it printed last, before judging it
                failure = collect(
                    w.placement.rank,
                    w.local_rank,
                    w.proc.pid,
                    rc,
                    w.streams.error_file,
                    w.exited_at,
                    w.streams.tail,
                )
                scope = self.watchdog.expired(w.proc.pid) if self.watchdog else None
                if scope is not None:
                    failure = replace(
                        failure,
                        message=f"its file timer {scope!r} expired (killed by the watchdog)",
                    )
                failures.append(failure)
        if failures:
            return GroupState.FAILED, failures
        if done + resized == len(self.workers):
            return (GroupState.STOPPED if resized else GroupState.SUCCEEDED), []
        return GroupState.RUNNING, []

    # -- live re-formation ---------------------------------------------------------------------
    @property
    def live(self) -> bool:
        """Every worker is alive and runs ``State.run``: they can re-form in place."""
        return bool(self.workers) and all(
            w.proc.poll() is None and w.control.live for w in self.workers
        )

    def starting(self, expected: bool) -> bool:
        """Workers started for this round (not ahead) on their way into State.run
        (``_on_the_way``), each having imported elastic (``ControlBlock.starting``) or,
        ``expected``, not yet: this node's workers went into State.run in an earlier
        round, and these run the same script."""
        return not self.ahead and self._on_the_way(lambda c: c.starting or (expected and c.fresh))

    @property
    def coming(self) -> bool:
        """Workers on their way into State.run (``_on_the_way``) from the group they formed
        in place, started ahead of their node's joining: asked to abandon that group, each
        lets go once there."""
        return self._on_the_way(lambda c: c.coming)

    def _on_the_way(self, going: Callable[[ControlBlock], bool]) -> bool:
        """Every worker is alive and either ``going`` into State.run or there already,
        and one at least is not there yet. Ranks get there one by one, the first waiting
        in State.run for the rest: a change acted on meanwhile replaced them all (likely
        what chaos seed 60 saw: a join drained a node 1 s into its wait for its two new
        workers, which never trained a step)."""
        ws = self.workers
        alive = all(w.proc.poll() is None for w in ws)
        return (
            bool(ws)
            and alive
            and all(w.control.live or going(w.control) for w in ws)
            and not all(w.control.live for w in ws)
        )

    def save_held(self, timeout: float) -> bool:
        """Before a kill: workers that run ``elastic.State`` and wait for a placement, out
        of their group (a hold that failed for another worker, a fenced node), hold their
        last committed step in memory, which may be the job's newest. Asked to stop, they
        save it at once (no step or collective to finish) and exit; waits until each
        saved or exited, up to ``timeout``. True if any was asked. The rest (frozen, or
        in a collective) are left to the kill."""
        held = [
            w
            for w in self.workers
            if self.use_state and w.proc.poll() is None and w.control.stranded
        ]
        for w in held:
            w.control.request_stop()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(self._saved(w) for w in held):
            time.sleep(0.005)
        return bool(held)

    @staticmethod
    def _saved(w: Worker) -> bool:
        """It exited, or saved and is exiting (EXIT_RESIZE): nothing of it is lost now."""
        return w.proc.poll() is not None or w.control.phase is Phase.LEAVING

    def stranded(self) -> list[WorkerFailure]:
        """Workers that left their group on their own (a collective failed) and wait for
        the agent, as failures in case no change of the job explains it."""
        now = time.time()
        return [
            WorkerFailure(
                w.placement.rank,
                w.local_rank,
                w.proc.pid,
                1,
                now,
                "its collective failed and no member of the job changed (see its stderr)",
            )
            for w in self.workers
            if w.proc.poll() is None and w.control.stranded
        ]

    def hold(
        self, urgent: bool, timeout: float, escalate: Callable[[], bool] | None = None
    ) -> tuple[Held, str]:
        """Ask the workers to let go of their group (``urgent``: now, out of a blocked
        collective too; else at their next step) and wait until every one waits for a
        placement: HELD, or FAILED and why not (then stop them); HUNG: one of them hung
        (``frozen``, kept in ``hold_frozen``), this node's own fault, not the change's
        that asked for the hold (a worker stopped as its peer failed). FINISHED: they all
        exited 0, having left their training loop before the ask (the ask came in the
        last step), so the job is done; a new round would train again from a snapshot.
        A worker still forming its group has no step to pause at, and its round has
        trained nothing: it gives that round up at once (chaos seed 125: its peer's node
        stopped its workers for a resize, and it waited in the round's store for 26 s).
        ``escalate()``, asked every ``ESCALATE_EVERY`` seconds while a pause is waited
        for, says the round broke meanwhile (a member went, a signal came): the pause
        becomes an abandon, which also frees a worker that waits in a collective with a
        peer that is gone, where it would never reach a step."""
        for w in self.workers:
            if not w.control.stranded:
                abandon = urgent or self._forming(w)
                (w.control.request_abandon if abandon else w.control.request_pause)()
        deadline = time.monotonic() + timeout
        asked = time.monotonic()
        while True:
            if not urgent and escalate is not None and time.monotonic() - asked >= ESCALATE_EVERY:
                asked = time.monotonic()
                if escalate():
                    urgent = True
                    for w in self.workers:
                        if not w.control.stranded:
                            w.control.request_abandon()
            gone = [w for w in self.workers if w.proc.poll() is not None]
            failed = [w for w in gone if w.proc.poll() != 0]
            if failed:
                return (
                    Held.FAILED,
                    f"rank {failed[0].placement.rank} exited ({failed[0].proc.poll()})",
                )
            if gone and self._finished():
                return Held.FINISHED, "the workers finished training"
            if all(w.control.stranded for w in self.workers if w not in gone):
                if not gone:
                    return Held.HELD, ""
                return Held.FAILED, f"rank {gone[0].placement.rank} exited (0) as the others let go"
            frozen = self.frozen()  # it would never let go
            if frozen:
                self.hold_frozen = frozen
                return Held.HUNG, f"rank {frozen[0].rank} did not let go: {frozen[0].message}"
            stuck = self._stuck()  # nor would it, before its group's timeout
            if stuck:
                return Held.FAILED, f"rank {stuck[0].rank} {stuck[0].message}"
            if time.monotonic() > deadline:
                late = [
                    w.placement.rank
                    for w in self.workers
                    if w not in gone and not w.control.stranded
                ]
                return Held.FAILED, f"rank(s) {late} still in their step after {timeout:g}s"
            time.sleep(0.005)

    def fits(self, placements: list[Placement]) -> bool:
        """Workers started ahead can take these placements (``lobby.fits``); any others
        can take any."""
        unplaced = bool(self.workers) and all(w.control.unplaced for w in self.workers)
        return not self.ahead or lobby.fits(self.ahead, placements, unplaced)

    def forming(self) -> bool:
        """A worker forms its new group in place and has not yet."""
        return any(self._forming(w) for w in self.workers)

    @staticmethod
    def _forming(w: Worker) -> bool:
        return w.proc.poll() is None and w.control.forming

    def in_lobby(self) -> bool:
        """Every worker started ahead waits in its ``init_process_group``."""
        return bool(self.workers) and all(
            w.proc.poll() is None and w.control.live and w.control.stranded for w in self.workers
        )

    def reform(self, placements: list[Placement]) -> None:
        """Publish each held worker's new placement: it forms the new group in place."""
        self.ahead = ()
        by_local = {p.local_rank: p for p in placements}
        assert set(by_local) == {w.local_rank for w in self.workers}, "same local ranks"
        for w in self.workers:
            old, w.placement = w.placement.world_size, by_local[w.local_rank]
            w.exited_at = None
            w.beats = hangs.carried(w.beats, old, w.placement.world_size)
            w.control.publish_placement(round_env(w.placement))

    @property
    def use_state(self) -> bool:
        """Every worker runs elastic.State: they can save and stop when asked (of workers
        stopped, what they said: asked by a signal while the node waits for its next
        round, chaos seed 124, it read their closed blocks and the agent died of it)."""
        if self._closed:
            return self._used_state
        return bool(self.workers) and all(w.control.uses_state for w in self.workers)

    def drain(self, sig: int, timeout: float, let_go: Callable[[], None] | None = None) -> Drained:
        """Stop without losing a step: State users save at their next step and exit
        EXIT_RESIZE, other scripts get ``sig``; SIGKILL after ``timeout``. A State user
        forming a new group has no step to stop at: it gives that group up (an abandon)
        and exits from its wait for a placement. ``let_go`` runs as soon as every one
        has exited or saved and is exiting (the job need not wait for their interpreters
        to end; this node leaves, so they get ``EXIT_GRACE`` to end before a SIGKILL,
        which loses nothing: they saved). A State user that exits 0 instead had left its
        training loop before the ask: it finished (only for State users: a script may
        well exit 0 on a SIGTERM). One found hung (``frozen``, in ``drain_frozen``) would
        never save: all are killed at once, their last snapshot is what the job keeps.
        A live one that reached no step within its learned allowance waits in a
        collective on a peer that is frozen or gone, where no step comes: it too gives
        its group up and saves from its wait (chaos seed 127: it waited out the timeout,
        and the others waited for this node to go)."""
        use_state = self.use_state
        if use_state:
            for w in self.workers:
                w.control.request_stop()
        else:
            self.signal(sig)
        asked = time.monotonic()
        deadline = asked + timeout
        saved = False
        broken: set[int] = set()  # local ranks broken out of their group
        stopped: dict[int, float] = {}  # local rank: since when its process is seen stopped
        self.drain_frozen = []
        while self.running and time.monotonic() < deadline:
            for w in self.workers:
                if use_state and w.local_rank not in broken and self._stepless(w, asked):
                    w.control.request_abandon()
                    broken.add(w.local_rank)
            self.drain_frozen = self.frozen() if use_state and not saved else []
            if not self.drain_frozen and not saved:
                self.drain_frozen = self._stopped(stopped) or self._stuck()
            if self.drain_frozen:
                self.stop(0)
                return Drained.FROZEN
            if let_go is not None and all(self._saved(w) for w in self.workers):
                let_go()
                let_go, saved = None, True  # this node leaves: their ends are not awaited
                deadline = min(deadline, time.monotonic() + EXIT_GRACE)
            time.sleep(0.005)
        done = not self.running
        if let_go is not None and done:
            let_go()
        self.stop(0)
        if not done and not saved:
            return Drained.KILLED
        return Drained.FINISHED if use_state and self._finished() else Drained.STOPPED

    def _stepless(self, w: Worker, asked: float) -> bool:
        """Asked to stop at ``asked`` (monotonic), ``w`` has no step to stop at: it forms
        its group or agrees on the state in it, or, live, it reached none within its
        learned allowance (it waits on a peer); given its group up, it saves from its wait
        for a placement."""
        if self._forming(w) or (w.proc.poll() is None and w.control.resyncing):
            return True  # nothing trained in the new group yet: it is given up at once
        late = time.monotonic() - asked > hangs.allowance(w.beats).seconds
        return late and w.control.live and not w.control.stranded and not self._saved(w)

    def _stopped(self, since: dict[int, float]) -> list[WorkerFailure]:
        """Workers whose process has stayed stopped (SIGSTOP, a debugger) for
        ``hangs.FLOOR`` seconds while asked to stop (``since``: local rank to since when,
        kept by the caller): they can act on no ask and no signal, and those that gave up
        their signs of life with ``State`` (done training) escape ``frozen``."""
        now, out = time.monotonic(), []
        for w in self.workers:
            if w.proc.poll() is not None or _status(w.proc.pid) not in _STOPPED:
                since.pop(w.local_rank, None)
                continue
            first = since.setdefault(w.local_rank, now)
            if now - first >= hangs.FLOOR:
                why = f"{hangs.HUNG}stopped for {now - first:.1f}s while asked to stop"
                out.append(_hung(w, time.time(), why))
        return out

    def _stuck(self) -> list[WorkerFailure]:
        """Workers that say their main thread is stuck in a collective that only its
        group's timeout ends (``elastic.worker.stuck``): they can neither let go nor
        save. Not a failure of their own: a peer went."""
        now = time.time()
        why = "is stuck in a collective that only its group's timeout ends (its log says where)"
        return [
            WorkerFailure(w.placement.rank, w.local_rank, w.proc.pid, 1, now, why)
            for w in self.workers
            if w.proc.poll() is None and w.control.stuck
        ]

    def _finished(self) -> bool:
        """Every worker exited 0: State users asked to stop or to let go of their group
        had left their training loop before the ask (a drain's FINISHED, a hold's)."""
        return all(w.proc.poll() == 0 for w in self.workers)

    def finish(self, timeout: float, grace: float) -> bool:
        """Let the workers end on their own for ``timeout``, then stop them (SIGTERM,
        SIGKILL after ``grace``). True if they ended by themselves."""
        done = self.wait(timeout)
        self.stop(0 if done else grace)
        return done

    def _watched(self, now: float) -> float:
        """Since when the agent has watched the workers without a gap (``hangs``)."""
        self._since = hangs.watched_since(self._since, self._looked, now)
        self._looked = now
        return self._since

    def hung(self, timeout: float) -> list[WorkerFailure]:
        """Running workers that reported progress, then none for ``timeout`` seconds
        (while the agent watched)."""
        now = time.time()
        since = self._watched(now)
        out = []
        for w in self.workers:
            beat = w.control.heartbeat
            watched = now - max(beat, since)
            if w.proc.poll() is None and w.control.reports and beat and watched > timeout:
                silent = f"no progress for {now - beat:.0f}s"
                why = f"{hangs.HUNG}{silent} (--worker-hang-timeout {timeout:g})"
                out.append(_hung(w, now, why))
        return out

    def frozen(self) -> list[WorkerFailure]:
        """Running workers hung by the rule learned from their own steps
        (``hangs``): silent past the allowance, and no sign of life either."""
        now, out = time.time(), []
        since = self._watched(now)
        for w in self.workers:
            beat = w.control.heartbeat
            if beat != w.last_beat[0]:
                now_in = (beat, w.control.running_in)
                step = hangs.interval(w.last_beat, now_in, since)
                if step is not None:
                    w.beats.append(step)
                    del w.beats[: -hangs.KEEP]
                w.last_beat = now_in
            if w.proc.poll() is not None or not w.control.uses_state:
                continue
            why = hangs.hung(now, beat, w.control.alive, hangs.allowance(w.beats), since)
            if why is not None:
                out.append(_hung(w, now, why))
        return out

    def processes(self) -> list[WorkerProc]:
        """The workers as the metrics collectors see them."""
        return [
            WorkerProc(w.placement.rank, w.local_rank, w.proc.pid, w.proc.poll() is None)
            for w in self.workers
        ]

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

    def release_withheld(self, show: bool) -> dict[int, Path]:
        """Tracebacks held back because they only say a peer vanished (see ``logs``):
        print them (``show``), or keep them in the workers' stderr.log files, returned
        by local rank."""
        kept = {}
        for w in self.workers:
            path = w.streams.release(show)
            if path is not None:
                kept[w.local_rank] = path
        return kept

    def stop(self, grace: float, sig: int = SIGTERM) -> None:
        """``sig`` to every worker's process group, SIGKILL after ``grace``; logs drained."""
        stop_group([w.proc for w in self.workers], grace, sig)
        self._newest_step, self._used_state = self.last_step(), self.use_state
        self._closed = True
        for w in self.workers:
            w.streams.close()
            w.control.close()


def _dup_or_null(fd: int, flags: int) -> int:
    """A copy of this process's ``fd`` for a worker, or /dev/null if it is closed."""
    try:
        return os.dup(fd)
    except OSError:
        return os.open(os.devnull, flags)


def _hung(w: Worker, now: float, why: str) -> WorkerFailure:
    """A hung worker as the failure its agent reports (it is killed): ``why``, its last
    step and what its process is doing."""
    message = f"{why} after step {w.control.step}; {_why_still(w.proc.pid)}"
    return WorkerFailure(w.placement.rank, w.local_rank, w.proc.pid, -int(SIGKILL), now, message)


_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def _status(pid: int) -> str | None:
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return None


def _why_still(pid: int) -> str:
    """What a silent worker's process is doing: a frozen one is the likely root cause,
    a sleeping one is usually blocked in a collective, waiting for a frozen peer."""
    status = _status(pid)
    if status is None:
        return "process gone"
    if status in _STOPPED:
        return "process stopped (SIGSTOP or a debugger)"
    if status == psutil.STATUS_SLEEPING:
        return "process sleeping (blocked, perhaps waiting for a peer)"
    return f"process {status}"
