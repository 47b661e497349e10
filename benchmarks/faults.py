"""Each fault the runner promises to absorb, timed: to the first step at the new size.

"Nodes" (an elastic-run agent and its one worker, each a process tree) on this machine
train ``ddp_steps.py --live`` (the loop in ``State.run``, ``commit()`` every step, the
job's step counter logged) on one etcd. For each fault, under ``--restart-mode live``
and ``respawn``, printed: the seconds from the fault to the first step at the new size
(for the frozen worker: to the first step of its replacement; for a join: the
survivors' pause; for Ctrl-C: to the agent's exit; for etcd frozen: the longest pause
of training), the committed steps trained again (the step in flight, whose commit the
fault cut short, is counted: at most 1 is the promise), and the restarts charged to the
job's budget, with the nodes whose own failure they were.

    kill          SIGKILL of node c (agent and worker), a and b train on
    kill forming  c joins; as the round of three forms, a (rank 0, the store host) is
                  SIGKILLed
    kill newcomer c joins; as the round of three forms, c is SIGKILLed
    kill resyncing  c joins; as its worker receives the state from a (rank 0), a is
                  SIGKILLed (the state must take a while to send: a --width of 2048 or
                  more)
    kill receiving  c joins; as its worker receives the state from a (rank 0), c is
                  SIGKILLed (a --width of 2048 or more: a's send may be cut short)
    Ctrl-C receiving  c joins; as its worker receives the state from a, c's terminal
                  gets a Ctrl-C (SIGINT to agent and worker): a and b go on without it
                  (a --width of 2048 or more: the send takes a while)
    two kills     c SIGKILLed, then a (the leader) 0.45 s later: b trains alone
    kill standby  --nnodes 1:2: a and b train, c waits as a standby; b is SIGKILLed and
                  c takes its place (to the first step of a and c)
    kill early standby  the same, c started with a and b (it registers before their
                  workers re-form in place: live, it steps back to start its workers ahead)
    kill re-forming  c (rank 1) SIGKILLed; as b's agent re-forms for it, a (the leader,
                  rank 0, the store host) too: b, rank 0 moments after rank 1, trains alone
    kill resized  c joins; two steps at three, then a is SIGKILLed
    hung worker   c's worker SIGSTOPped, its agent alive: found by the learned bound
    join          c joins a and b
    two joins     c and d join a and b at once (each expects rank 2 of 3)
    join building  c joins a and b; as c's worker, placed, builds its model (8 s before
                  State.run), d joins: from c's placement to the first step at world 4
    join starting  a and b start the job, their workers building for 4 s before
                  State.run; c starts: from c's start to the first step at world 3
    join rebuilding  a and b start, building for 20 s; a's worker is SIGKILLed, and c
                  starts 2 s into its new worker's build: from c's start to world 3
    kill building  c joins a and b; 1 s into its worker's 6 s model build, b is
                  SIGKILLed: from the kill to the first step of a and c
    leave handing over  a trains alone; c starts to join (live: its worker starts before
                  it registers; respawn: it registers) and a is told to leave (SIGTERM) at
                  once: a hands the state to c first (from the SIGTERM to c's first step
                  alone)
    own connection  the script keeps a connection of its own (opened before the process
                  group) to an echo service, one request a step; c is SIGKILLed: the
                  requests that failed are printed (the group's connections alone are cut)
    junk leader   a value no leader wrote over the live leader's record at job/leader,
                  then c SIGKILLed: a and b train on without it
    Ctrl-C        SIGINT to the agent of a one-node job
    etcd frozen   etcd SIGSTOPped for 2x the lease TTL + 1 s, no node lost
    quorum lost   two members of a three-member etcd cluster SIGSTOPped for 2x the
                  lease TTL + 1 s, no node lost
    kill etcd restarting  etcd and c SIGKILLed together, etcd started again 1 s later

    python benchmarks/faults.py [--repeat 1] [--only kill,join] [--modes live,respawn]
                                [--device cuda --width 2048]

With ``--device cuda`` every worker's model and optimizer state live on cuda:0 (gloo
ranks sharing one GPU): a live survivor keeps its CUDA context and its model on the
device, a respawned worker initialises CUDA, builds the model and restores it again.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # etcd_servers, harness

from etcd_servers import EtcdCluster
from harness import echo_server

from benchmarks._nodes import Node, first_step, steps
from elastic.agent.etcd_server import EtcdServer
from rendezvous import records
from rendezvous.client import EtcdClient
from rendezvous.config import build_options

SCRIPT = str(Path(__file__).resolve().parent / "ddp_steps.py")
TTL = 3
CONF = f"lease_ttl={TTL},last_call_timeout=1"
STEP_S = "0.02"  # the script's pause between steps: ~25 ms steps
TIMEOUT = 90.0


@dataclass
class Outcome:
    seconds: float | None  # None: not within TIMEOUT
    redone: int
    charged: str  # "0", or "1 (c)"


class Job:
    """Nodes named a, b, c... of one job, their logs and their steps."""

    def __init__(
        self,
        etcd: EtcdServer,
        work: Path,
        mode: str,
        nnodes: str = "1:3",
        script_args: tuple[str, ...] = (),
    ) -> None:
        self.etcd, self.work, self.mode, self.nnodes = etcd, work, mode, nnodes
        self.endpoint = etcd.endpoint  # a fault may give the job another etcd
        self.script_args = script_args
        self.cleanups: list[Callable[[], None]] = []  # after the nodes stop
        self.results = work / "steps"
        self.results.mkdir(parents=True)
        self.nodes: dict[str, Node] = {}

    def start(self, name: str, *script_args: str) -> Node:
        cmd = [sys.executable, "-m", "elastic", "--nnodes", self.nnodes, "--nproc-per-node",
               "1", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.work.name,
               "--rdzv-conf", CONF, "--node-id", name, "--local-addr", "127.0.0.1",
               "--restart-mode", self.mode, "--max-restarts", "3", SCRIPT, STEP_S,
               "--live", *self.script_args, *script_args]  # fmt: skip
        node = Node(cmd, {"RESULT_DIR": str(self.results)}, self.work / f"{name}.log")
        self.nodes[name] = node
        return node

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")

    def wait_log(self, name: str, text: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} never logged {text!r}; see {self.work}")
            time.sleep(0.02)

    def since(self, world: int, at: float) -> float | None:
        """Seconds from ``at`` to the first step at ``world`` (None: not within TIMEOUT)."""
        t = first_step(self.results, world, at, TIMEOUT)
        return None if t is None else t - at

    def training(self, world: int, after: float = 0.0) -> float:
        waited = self.since(world, after)
        if waited is None:
            raise RuntimeError(f"the job never trained at world size {world}; see {self.work}")
        return after + waited

    def steps_at(self, world: int, after: float, count: int) -> None:
        """Wait until ``count`` steps were trained at ``world`` after ``after``."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            at = {s["step"] for s in steps(self.results) if s["world"] == world and s["t"] > after}
            if len(at) >= count:
                return
            time.sleep(0.02)
        raise RuntimeError(f"no {count} steps at world size {world}; see {self.work}")

    def worker(self, name: str) -> psutil.Process:
        return next(p for p in self.nodes[name].tree()[1:] if "ddp_steps" in " ".join(p.cmdline()))

    def outcome(self, fault: float, seconds: float | None) -> Outcome:
        rows = steps(self.results)
        before = [s["step"] for s in rows if s["t"] <= fault]
        after = [s["step"] for s in rows if s["t"] > fault + (seconds or 0)]
        redone = max(0, max(before) - (after[0] - 1)) if before and after else 0
        restarts = 0
        charged: set[str] = set()
        for name in self.nodes:
            text = self.log(name)
            for n in re.findall(r"restart (\d+) after a worker failure", text):
                restarts = max(restarts, int(n))
            if "workers failed: " in text:  # its own failure, reported
                charged.add(name)
        who = f" ({','.join(sorted(charged))})" if charged else ""
        return Outcome(seconds, redone, f"{restarts}{who}")

    def stop(self) -> None:
        for n in self.nodes.values():
            n.stop()
        for cleanup in self.cleanups:
            cleanup()


def start_training(job: Job, names: str) -> None:
    """Nodes ``names`` started in order, trained 5 steps together."""
    for name in names:
        job.start(name)
        time.sleep(0.3)  # a registers first: it leads and hosts the first round's store
    job.steps_at(len(names), job.training(len(names)), 5)


def kill(job: Job) -> Outcome:
    start_training(job, "abc")
    at = time.time()
    job.nodes["c"].kill()
    return job.outcome(at, job.since(2, at))


def killed_as_c_joins(job: Job, victim: str) -> Outcome:
    """c joins a and b; as the round of three forms, ``victim`` is SIGKILLed."""
    start_training(job, "ab")
    job.start("c")
    job.wait_log("b", "joined c")
    at = time.time()
    job.nodes[victim].kill()
    return job.outcome(at, job.since(2, at))


def kill_forming(job: Job) -> Outcome:
    return killed_as_c_joins(job, "a")  # rank 0, the store host


def kill_newcomer(job: Job) -> Outcome:
    return killed_as_c_joins(job, "c")


def as_c_receives(job: Job, victim: str, fault: Callable[[Node], None]) -> Outcome:
    """c joins a and b; ``fault`` strikes node ``victim`` as c's fresh worker receives the
    state: to the first step at world 2."""
    start_training(job, "ab")
    job.start("c")
    job.wait_log("c", "receiving step")
    at = time.time()
    fault(job.nodes[victim])
    return job.outcome(at, job.since(2, at))


def kill_resyncing(job: Job) -> Outcome:
    """c joins a and b; as c's fresh worker receives the state from a (rank 0, the lowest
    rank holding it), a is SIGKILLed: b, which holds it too, sends it in the next round."""
    return as_c_receives(job, "a", Node.kill)


def kill_receiving(job: Job) -> Outcome:
    """c joins a and b; as c's fresh worker receives the state from a, c is SIGKILLed: a
    and b go on without it. gloo never fails a send cut short by its receiver's death (a
    would wait for it until the group's timeout): where the kill lands mid-send, a's
    worker says it is stuck and a's node takes new workers."""
    return as_c_receives(job, "c", Node.kill)


def ctrl_c_receiving(job: Job) -> Outcome:
    """c joins a and b; as c's fresh worker receives the state from a, Ctrl-C reaches c's
    agent and worker: c leaves, its worker gives the round up at once (nothing trained
    in it), and a and b re-form without it: from the press to their first step."""
    return as_c_receives(job, "c", Node.interrupt)


def kill_standby(job: Job, early: bool = False) -> Outcome:
    """--nnodes 1:2: c waits as a standby beside a and b; b is SIGKILLed: to the first
    step of a and c (world size 2 again: told from a's and b's by c's worker's pid).
    ``early``: c starts with a and b, registered before their workers re-form in place."""
    job.nnodes = "1:2"
    if early:
        for name in "abc":
            job.start(name)
            job.wait_log(name, f"registered as {name}")
        job.steps_at(2, job.training(2), 5)
        if job.mode == "live":  # it steps back once they re-form in place
            job.wait_log("c", "joining the job with them")
    else:
        start_training(job, "ab")
        job.start("c")
        job.wait_log("c", "registered as c")
    time.sleep(1.0)  # c settled as a standby
    old = {s["pid"] for s in steps(job.results)}
    at = time.time()
    job.nodes["b"].kill()
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        new = [s for s in steps(job.results) if s["world"] == 2 and s["pid"] not in old]
        if new:  # c's first step, taken with a's
            return job.outcome(at, new[0]["t"] - at)
        time.sleep(0.05)
    return job.outcome(at, None)


def two_kills(job: Job) -> Outcome:
    start_training(job, "abc")
    at = time.time()
    job.nodes["c"].kill()
    time.sleep(0.45)
    job.nodes["a"].kill()
    second = job.since(1, at + 0.45)  # from the first kill: both are the fault
    return job.outcome(at, None if second is None else second + 0.45)


def kill_re_forming(job: Job) -> Outcome:
    """c is killed; as b re-forms for it, a (the leader, rank 0, the store host) is too."""
    for name in "acb":  # c is rank 1: b becomes rank 1, then rank 0, in quick succession
        job.start(name)
        job.wait_log(name, f"registered as {name}")
    job.steps_at(3, job.training(3), 5)
    at = time.time()
    job.nodes["c"].kill()
    job.wait_log("b", "lost c: ")  # b's agent acts on it: its workers re-form, or stop
    job.nodes["a"].kill()
    return job.outcome(at, job.since(1, at))


def kill_resized(job: Job) -> Outcome:
    start_training(job, "ab")
    job.start("c")
    job.steps_at(3, job.training(3), 2)
    at = time.time()
    job.nodes["a"].kill()
    return job.outcome(at, job.since(2, at))


def hung_worker(job: Job) -> Outcome:
    start_training(job, "abc")
    job.steps_at(3, job.training(3), 40)  # c's agent has timed its steps: the bound is learned
    worker = job.worker("c")
    at = time.time()
    worker.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        new = [s for s in steps(job.results) if s["t"] > at and s["pid"] != worker.pid]
        fresh = [s for s in new if s["rank"] == 2 or s["world"] == 2]
        if fresh:
            return job.outcome(at, fresh[0]["t"] - at)
        time.sleep(0.05)
    return job.outcome(at, None)


def join(job: Job) -> Outcome:
    start_training(job, "ab")
    at = time.time()
    job.start("c")
    resumed = first_step(job.results, 3, at, TIMEOUT)
    if resumed is None:
        return job.outcome(at, None)
    last = max(s["t"] for s in steps(job.results) if s["world"] == 2 and s["t"] < resumed)
    return job.outcome(last, resumed - last)


def two_joins(job: Job) -> Outcome:
    """c and d join a and b at the same moment: each started its workers for rank 2 of 3."""
    job.nnodes = "1:4"
    start_training(job, "ab")
    at = time.time()
    job.start("c")
    job.start("d")
    resumed = first_step(job.results, 4, at, TIMEOUT)
    if resumed is None:
        return job.outcome(at, None)
    last = max(s["t"] for s in steps(job.results) if s["world"] < 4 and s["t"] < resumed)
    return job.outcome(last, resumed - last)


def join_building(job: Job) -> Outcome:
    """c joins a and b; its worker, placed, builds its model for 8 s before State.run, and
    d starts meanwhile (its worker is ready in 2-4 s). Timed: from c's placement to the
    first step at world 4, whose floor is c's build; whether c's worker was kept is
    printed (a replaced one starts and builds again)."""
    job.nnodes = "1:4"
    start_training(job, "ab")
    job.start("c", "--build-s", "8")
    job.wait_log("c", "round 2:")  # placed: its worker builds now
    at = time.time()
    job.start("d")
    resumed = first_step(job.results, 4, at, TIMEOUT)
    if resumed is None:
        return job.outcome(at, None)
    kept = "new workers follow" not in job.log("c") and "resizing" not in job.log("c")
    print(f"join building ({job.mode}): c's worker {'kept' if kept else 'replaced'}", flush=True)
    return job.outcome(at, resumed - at)


def say_builds(job: Job, fault: str, whose: str, kept: bool) -> None:
    """Print whether ``whose`` workers were kept through ``fault``, and how many times a
    model was built (``building.PID``, one per worker that began a build)."""
    builds = len(list(job.results.glob("building.*")))
    state = "kept" if kept else "replaced"
    print(f"{fault} ({job.mode}): {whose} {state}, {builds} model builds", flush=True)


def join_starting(job: Job) -> Outcome:
    """a and b start the job, their workers building their model for 4 s before
    State.run; c starts once both build (the job's workers were never live). Timed: from
    c's start to the first step at world 3; whether a's and b's first workers were kept
    is printed (replaced ones start and build again)."""
    job.nnodes = "1:3"
    for name in "ab":
        job.start(name, "--build-s", "4")
        time.sleep(0.3)
    deadline = time.monotonic() + TIMEOUT
    while len(list(job.results.glob("building.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    first = {int(p.suffix[1:]) for p in job.results.glob("building.*")}
    at = time.time()
    job.start("c", "--build-s", "4")
    resumed = first_step(job.results, 3, at, TIMEOUT)
    if resumed is None:
        return job.outcome(at, None)
    kept = len(first) == 2 and first <= {s["pid"] for s in steps(job.results)}
    say_builds(job, "join starting", "a's and b's first workers", kept)
    return job.outcome(at, resumed - at)


def join_rebuilding(job: Job) -> Outcome:
    """a and b start the job, their workers building their model for 20 s before
    State.run. a's worker is SIGKILLed: a steps out while b trains on, and a's new
    worker, started ahead, builds again once placed; c starts 2 s into that build.
    Timed: from c's start to the first step at world 3; whether a's new worker was kept
    is printed. The join waits up to 10 s (``core.COMING_LIVE_S``) for it, then replaces
    it: kept, c's build (after its placement) follows the rest of a's; replaced, a's new
    worker starts and builds again, beside c's build."""
    job.nnodes = "1:3"
    build = ("--build-s", "20")
    for name in "ab":
        job.start(name, *build)
        time.sleep(0.3)
    job.steps_at(2, job.training(2), 3)
    before = set(job.results.glob("building.*"))
    job.worker("a").kill()
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and len(set(job.results.glob("building.*")) - before) < 1:
        time.sleep(0.05)
    new = set(job.results.glob("building.*")) - before
    if not new:
        return job.outcome(time.time(), None)
    rebuilding = int(next(iter(new)).suffix[1:])
    time.sleep(2.0)  # into its build
    at = time.time()
    job.start("c", *build)
    resumed = first_step(job.results, 3, at, TIMEOUT)
    if resumed is None:
        return job.outcome(at, None)
    kept = rebuilding in {s["pid"] for s in steps(job.results) if s["world"] == 3}
    say_builds(job, "join rebuilding", "a's rebuilding worker", kept)
    return job.outcome(at, resumed - at)


def kill_building(job: Job) -> Outcome:
    """c joins a and b; its worker, placed, builds its model for 6 s before State.run, and
    b is SIGKILLed 1 s into that. Timed: from the kill to the first step at world 2 (a and
    c), whose floor is the rest of c's build; whether c's worker was kept is printed (a
    replaced one starts and builds again)."""
    start_training(job, "ab")
    job.start("c", "--build-s", "6")
    job.wait_log("c", "round 2:")  # placed: its worker builds now
    time.sleep(1.0)
    at = time.time()
    job.nodes["b"].kill()
    resumed = first_step(job.results, 2, at, TIMEOUT, ranks=2)
    if resumed is None:
        return job.outcome(at, None)
    said = job.log("c")
    kept = "new workers follow" not in said and "stopping workers" not in said
    print(f"kill building ({job.mode}): c's worker {'kept' if kept else 'replaced'}", flush=True)
    return job.outcome(at, resumed - at)


def leave_handing_over(job: Job) -> Outcome:
    start_training(job, "a")
    job.start("c")
    # live: c's worker starts before it registers; respawn: it registers at once
    job.wait_log("c", "starting workers" if job.mode == "live" else "registered as c")
    at = time.time()
    job.nodes["a"].proc.send_signal(signal.SIGTERM)
    job.wait_log("a", "summary:")  # left: a step at world 1 now is c's alone
    left = time.time()
    alone = job.since(1, left)
    if alone is None:
        return job.outcome(at, None)
    job.steps_at(1, left, 3)  # the steps after c's first say where it resumed
    return job.outcome(at, left - at + alone)


def ctrl_c(job: Job) -> Outcome:
    job.nnodes = "1"
    node = job.start("a")
    job.steps_at(1, job.training(1), 5)
    at = time.time()
    node.proc.send_signal(signal.SIGINT)
    try:
        node.proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        return Outcome(None, 0, "-")
    return Outcome(time.time() - at, 0, "-")


def frozen_for(job: Job, pids: list[int]) -> Outcome:
    """The job's etcd processes ``pids`` SIGSTOPped for 2x the lease TTL + 1 s while a, b
    and c train: the longest pause of training (rank 0's steps), and new workers."""
    start_training(job, "abc")
    before = {s["pid"] for s in steps(job.results)}
    servers = [psutil.Process(pid) for pid in pids]
    at = time.time()
    for server in servers:
        server.send_signal(signal.SIGSTOP)
    try:
        time.sleep(2 * TTL + 1)
    finally:
        for server in servers:
            server.send_signal(signal.SIGCONT)
    job.steps_at(3, time.time(), 10)
    rows = [s for s in steps(job.results) if s["t"] > at - 1 and s["rank"] == 0]
    pause = max(b["t"] - a["t"] for a, b in itertools.pairwise(rows))
    out = job.outcome(at, None)  # redone: counted from the freeze on
    new = {s["pid"] for s in steps(job.results)} - before
    more = f", {len(new)} new worker(s)" if new else ""
    return replace(out, seconds=pause, charged=out.charged + more)


def etcd_frozen(job: Job) -> Outcome:
    assert job.etcd.proc is not None
    return frozen_for(job, [job.etcd.proc.pid])


def quorum_lost(job: Job) -> Outcome:
    """The same with two of a three-member cluster frozen: the one left has no quorum."""
    cluster = EtcdCluster(3).start()
    job.cleanups.append(cluster.close)
    job.endpoint = cluster.endpoints
    return frozen_for(job, [m.proc.pid for m in cluster.members[1:] if m.proc is not None])


def own_connection(job: Job) -> Outcome:
    """A plain kill of c, each worker keeping a connection of its own through it: to the
    first step at world 2, and the requests on those connections that failed."""
    job.script_args = (*job.script_args, "--echo", str(echo_server()))
    start_training(job, "abc")
    at = time.time()
    job.nodes["c"].kill()
    out = job.outcome(at, job.since(2, at))
    job.steps_at(2, at, 10)
    failed = sum(
        max((s.get("echo_failed", 0) for s in steps(job.results) if s["pid"] == pid), default=0)
        for pid in {s["pid"] for s in steps(job.results)}
    )
    print(f"own connection ({job.mode}): {failed} request(s) failed", flush=True)
    return out


def junk_leader(job: Job) -> Outcome:
    """A value no leader wrote put over the live leader's record, then c SIGKILLed: to
    the first step at world 2 (it was: no node could claim the lead over it, and the
    job hung until join_timeout)."""
    start_training(job, "abc")
    options, rdzv = build_options(job.endpoint, job.work.name, 1, 1)
    client = EtcdClient(options)
    try:
        client.put(rdzv.job_prefix + records.LEADER, b"\x80junk")
    finally:
        client.close()
    time.sleep(0.5)  # every node saw it (nothing happens: no event to wait on)
    at = time.time()
    job.nodes["c"].kill()
    return job.outcome(at, job.since(2, at))


def kill_etcd_restarting(job: Job) -> Outcome:
    """etcd SIGKILLed and c with it; etcd is started again 1 s later, on its data: the
    survivors find c gone while etcd is away, and re-form once it answers."""
    start_training(job, "abc")
    at = time.time()
    job.etcd.stop(signal.SIGKILL)
    job.nodes["c"].kill()
    time.sleep(1.0)
    job.etcd.start()
    return job.outcome(at, job.since(2, at))


FAULTS: dict[str, Callable[[Job], Outcome]] = {
    "kill": kill,
    "kill forming": kill_forming,
    "kill newcomer": kill_newcomer,
    "kill resyncing": kill_resyncing,
    "kill receiving": kill_receiving,
    "Ctrl-C receiving": ctrl_c_receiving,
    "kill standby": kill_standby,
    "kill early standby": functools.partial(kill_standby, early=True),
    "two kills": two_kills,
    "kill re-forming": kill_re_forming,
    "kill resized": kill_resized,
    "hung worker": hung_worker,
    "join": join,
    "two joins": two_joins,
    "join building": join_building,
    "join starting": join_starting,
    "join rebuilding": join_rebuilding,
    "kill building": kill_building,
    "leave handing over": leave_handing_over,
    "own connection": own_connection,
    "junk leader": junk_leader,
    "Ctrl-C": ctrl_c,
    "etcd frozen": etcd_frozen,
    "quorum lost": quorum_lost,
    "kill etcd restarting": kill_etcd_restarting,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--only", default=",".join(FAULTS), help="faults, comma-separated")
    ap.add_argument("--modes", default="live,respawn")
    ap.add_argument(
        "--device", default="cpu", help="where the workers' model lives (cuda: all on cuda:0)"
    )
    ap.add_argument(
        "--width", type=int, default=0, help="the model's hidden width (0: Linear(32, 1))"
    )
    a = ap.parse_args()
    script_args = ("--device", a.device, "--width", str(a.width))
    faults = [f.strip() for f in a.only.split(",")]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    modes = a.modes.split(",")
    base = Path(tempfile.mkdtemp(prefix="elastic-run-faults-"))
    results: dict[tuple[str, str], list[Outcome]] = {}
    for i in range(a.repeat):
        for fault in faults:
            for mode in modes:
                with EtcdServer(name="faults") as etcd:
                    slug = fault.replace(" ", "-").replace("Ctrl-C", "ctrl-c")
                    job = Job(etcd, base / f"{slug}-{mode}-{i}", mode, script_args=script_args)
                    try:
                        out = FAULTS[fault](job)
                    except RuntimeError as e:
                        print(f"{fault} ({mode}): {e}", flush=True)
                        out = Outcome(None, 0, "?")
                    finally:
                        job.stop()
                results.setdefault((fault, mode), []).append(out)
                s = f"{out.seconds:.2f}s" if out.seconds is not None else f">{TIMEOUT:.0f}s"
                print(f"run {i + 1} {fault} ({mode}): {s}, redone {out.redone}, "
                      f"charged {out.charged}", flush=True)  # fmt: skip
    print(f"\n{'fault':<22}{'mode':<9}{'median':>9}   {'redone':>6}   charged   runs (s)")
    for (fault, mode), outs in results.items():
        secs = [o.seconds if o.seconds is not None else TIMEOUT for o in outs]
        runs = " ".join(f"{x:.2f}" for x in secs)
        print(
            f"{fault:<22}{mode:<9}{statistics.median(secs):>8.2f}s   "
            f"{max(o.redone for o in outs):>6}   {outs[-1].charged:<9} {runs}"
        )
    print(f"(logs under {base})")


if __name__ == "__main__":
    main()
