"""A seeded storm of faults on one live job, and the promises checked at its end.

Nodes (an elastic-run agent and its workers, each a process tree on this machine) train
``tests/scripts/live_train.py`` (DDP in ``State.run``, a fixed global batch, every
micro-batch's sample indices logged) on one etcd, ``--nnodes 1:4`` (``--max-nodes 2``:
1:2, and the nodes past 2 of the up to 4 wait as standbys). While it trains,
events drawn from ``--seed`` hit it one after another, each 0-4 s after the previous
one, so many land while the job is still recovering from the one before:

    kill      SIGKILL of a node (agent and workers)
    term      SIGTERM to a node's agent: it leaves
    join      a new node
    rejoin    a killed node started again under its old name (a restarted pod)
    hang      SIGSTOP of one worker whose agent lives (only once it has trained a few
              steps: before that the agent cannot learn its step time)
    freeze    SIGSTOP of a whole node for 2x the lease TTL + 1 s, then SIGCONT
    agent-freeze  SIGSTOP of a node's agent alone (its workers train on) for as long
    junk      a value no agent wrote (not JSON, JSON of other shapes) put at one of the
              job's keys in etcd, drawn from those there (off any lease)
              (these two only with --only, so that the default storms of a seed stay the
              same)
    etcd-freeze  etcd SIGSTOPped for 2x the lease TTL + 1 s
    etcd-restart etcd SIGKILLed and started again 1 s later

At the end (the job trains to its last step, or stalls for ``--stall`` seconds): every
agent not killed exits 0, no sample of any epoch is lost, the final model equals the one
an undisturbed run computes (so nothing was applied twice or skipped), committed steps
trained again are never silent (an agent said how many: short by no more than the steps
of the job's progress record's interval, the blind spot a kill of its writer leaves, and
of any etcd outage then: no step trained in one can be recorded until etcd is back), and
no event alone (none other within 12 s) paused training for more than 12 s. Printed per
event: the longest pause of training until the next event, and the steps trained again
after it.

    python benchmarks/chaos.py [--seed 1] [--events 12] [--nproc 1] [--mode live]
                               [--only kill,join,...] [--width 1024 --depth 2]
                               [--max-nodes 4]

``--width`` and ``--depth`` make the model big enough that its gradients and state take
more than a socket's buffer to send (1024 and 2: 8 MB of gradients a step), where gloo
behaves otherwise when a peer goes mid-send.

Exit status 1 when a promise broke; the logs stay under the printed directory.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import etcd3
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._nodes import Node, steps
from elastic.agent.etcd_server import EtcdServer, EtcdServerError
from rendezvous.rules import PROGRESS_EVERY

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "live_train.py"
TTL = 3
# is_host=false: a node that starts while etcd is down waits for it, instead of serving
# an etcd of its own on the endpoint, as it would for a job's first node on that host
CONF = f"lease_ttl={TTL},last_call_timeout=1,is_host=false"
MAX_NODES = 4
GAPS = (0.0, 0.1, 0.3, 0.6, 1.0, 2.0, 4.0)  # seconds between events: many compound
EVENTS = ("kill", "term", "join", "rejoin", "hang", "freeze", "etcd-freeze", "etcd-restart")
KNOWN = (*EVENTS, "agent-freeze", "junk")
JUNK = (b"\x80junk", b"{}", b"[]", b"null", b'{"id": 7, "members": "x", "round": -1}')
PAUSE_BOUND = 12.0  # a pause longer than this after an event alone is a stall


@dataclass
class Event:
    at: float
    kind: str
    target: str = ""
    pause: float = 0.0
    redone: int = 0
    etcd_out: float = 0.0  # seconds etcd could record nothing (etcd-freeze, etcd-restart)


@dataclass
class Storm:
    etcd: EtcdServer
    work: Path
    a: argparse.Namespace
    nodes: dict[str, Node] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)  # killed: its exit status says nothing
    left: set[str] = field(default_factory=set)  # SIGTERMed
    stopped: set[int] = field(default_factory=set)  # worker pids SIGSTOPped for good
    thawed_at: dict[str, float] = field(default_factory=dict)  # a frozen node's SIGCONT
    named: int = 0

    @property
    def out(self) -> Path:
        return self.work / "steps"

    def start(self, name: str) -> None:
        cmd = [sys.executable, "-m", "elastic", "--nnodes", f"1:{self.a.max_nodes}",
               "--nproc-per-node", str(self.a.nproc), "--rdzv-endpoint", self.etcd.endpoint,
               "--rdzv-id", "chaos", "--rdzv-conf", CONF, "--node-id", name,
               "--local-addr", "127.0.0.1", "--restart-mode", self.a.mode,
               "--max-restarts", "20", str(SCRIPT), *self.script_args()]  # fmt: skip
        log = self.work / f"{name}.log"
        if name in self.nodes:  # a rejoin: the old log goes on
            log = self.work / f"{name}.{int(time.time() * 1000)}.log"
        self.nodes[name] = Node(cmd, {"RESULT_DIR": str(self.out)}, log)
        self.gone.discard(name)
        self.left.discard(name)

    def script_args(self) -> list[str]:
        a = self.a
        return ["--samples", str(a.samples), "--epochs", str(a.epochs), "--micro-batch",
                "2", "--global-batch", str(self.global_batch()),
                "--step-time", str(a.step_time), "--width", str(a.width), "--depth",
                str(a.depth)]  # fmt: skip

    def global_batch(self) -> int:
        return 24 * self.a.nproc  # split evenly over 1-4 nodes of nproc ranks, micro-batch 2

    def fresh_name(self) -> str:
        name = "abcdefghijklmnopqrstuvwxyz"[self.named % 26] + (
            str(self.named // 26) if self.named >= 26 else ""
        )
        self.named += 1
        return name

    def alive(self) -> list[str]:
        return [
            n for n, node in self.nodes.items() if node.proc.poll() is None and n not in self.gone
        ]

    def targets(self) -> list[str]:
        """Nodes a fault can hit: alive, not leaving, not frozen now."""
        now = time.time()
        return [n for n in self.alive() if n not in self.left and self.thawed_at.get(n, 0) < now]

    def rows(self) -> list[dict]:
        return steps(self.out)

    def workers(self, name: str) -> list[psutil.Process]:
        out = []
        for p in self.nodes[name].tree()[1:]:
            with contextlib.suppress(psutil.Error):  # one that just ended (a zombie)
                if "live_train" in " ".join(p.cmdline()):
                    out.append(p)
        return out

    def finished(self) -> bool:
        return (self.out / "final.pt").exists() and not self.alive()


def frozen_for(procs: list[psutil.Process], seconds: float) -> None:
    """SIGSTOP now, SIGCONT after ``seconds`` (in the background)."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGSTOP)

    def thaw() -> None:
        time.sleep(seconds)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)

    threading.Thread(target=thaw, daemon=True).start()


def steps_by_pid(rows: list[dict]) -> dict[int, int]:
    """How many steps each worker process trained."""
    seen: dict[int, set[int]] = {}
    for r in rows:
        seen.setdefault(r["pid"], set()).add(r["step"])
    return {pid: len(done) for pid, done in seen.items()}


def strike(s: Storm, kind: str, rng: random.Random) -> Event | None:
    """Do one event of ``kind`` if the job's state allows it; None if not."""
    alive, targets = s.alive(), s.targets()
    staying = [n for n in alive if n not in s.left]  # a leaving node may take a while
    now = time.time()
    if kind in ("kill", "term", "freeze", "agent-freeze") and len(staying) >= 2 and targets:
        name = rng.choice(targets)
        if kind == "kill":
            s.nodes[name].kill()
            s.gone.add(name)
        elif kind == "term":
            s.nodes[name].term()
            s.left.add(name)
        else:
            node = s.nodes[name]
            frozen_for(node.tree() if kind == "freeze" else node.tree()[:1], 2 * TTL + 1)
            s.thawed_at[name] = now + 2 * TTL + 1
        return Event(now, kind, name)
    if kind == "join" and len(alive) < MAX_NODES:
        name = s.fresh_name()
        s.start(name)
        return Event(now, kind, name)
    if kind == "rejoin" and len(alive) < MAX_NODES:
        dead = sorted(n for n in s.gone if s.nodes[n].proc.poll() is not None)
        if dead:
            name = rng.choice(dead)
            s.start(name)
            return Event(now, kind, name)
    if kind == "hang" and len(alive) >= 2:
        trained = steps_by_pid(s.rows())
        ready = [(n, w) for n in alive for w in s.workers(n) if trained.get(w.pid, 0) >= 8]
        if ready:
            name, worker = rng.choice(ready)
            with contextlib.suppress(psutil.Error):
                worker.send_signal(signal.SIGSTOP)  # its agent kills it: no SIGCONT needed
            return Event(now, kind, f"{name}/{worker.pid}")
    if kind == "junk":
        host, port = s.etcd.endpoint.rsplit(":", 1)
        client = etcd3.client(host, int(port), timeout=5)
        try:
            keys = sorted(m.key.decode() for _, m in client.get_prefix("/elastic-run/chaos/"))
            if keys:
                key = rng.choice(keys)
                client.put(key, rng.choice(JUNK))
                return Event(now, kind, key.removeprefix("/elastic-run/chaos/"))
        except (etcd3.exceptions.ConnectionFailedError, etcd3.exceptions.ConnectionTimeoutError):
            pass  # etcd is frozen or restarting (an event before this one): no junk now
        finally:
            client.close()
        return None
    if kind == "etcd-freeze":
        assert s.etcd.proc is not None
        frozen_for([psutil.Process(s.etcd.proc.pid)], 2 * TTL + 1)
        return Event(now, kind, etcd_out=2 * TTL + 1)
    if kind == "etcd-restart":
        s.etcd.stop(signal.SIGKILL)
        time.sleep(1.0)
        for _ in range(10):  # an agent's outgoing connection may hold a port a moment
            try:
                s.etcd.start()
                break
            except EtcdServerError as e:
                why = str(e)[-900:-400]  # the message, not its stack
                time.sleep(1.0)
        else:
            raise RuntimeError(f"etcd did not start again on its ports: {why}")
        return Event(now, kind, etcd_out=time.time() - now)
    return None


def reference(a: argparse.Namespace, global_batch: int) -> dict[str, torch.Tensor]:
    """The model after the same steps with no change at all."""
    sys.path.insert(0, str(SCRIPT.parent))
    from live_train import undisturbed

    return undisturbed(a.samples, a.epochs, global_batch, a.width, a.depth)


def learning_rate(width: int) -> float:
    sys.path.insert(0, str(SCRIPT.parent))
    from live_train import learning_rate as lr

    return float(lr(width))


@dataclass(frozen=True)
class Jump:
    """A round that trained committed steps again: from ``resumed`` (the first step it
    trained), ``lost`` steps behind the newest trained before it, at time ``at``."""

    at: float
    resumed: int
    lost: int
    lag: int  # steps trained in the record's interval before the newest: a kill's blind spot


# seconds the job's progress record may lag the newest step: its interval, and a second for
# the agent's read of its workers' step and the write (a warning from it says "at least")
RECORD_LAG = PROGRESS_EVERY + 1.0
WARNED = re.compile(r"round (\d+) resumes from step (\d+), (?:at least )?(\d+) step\(s\) behind")


def blind_from(newest_at: float, outages: list[tuple[float, float]]) -> float:
    """Since when the steps trained up to ``newest_at`` may be missing from the job's
    progress record: its interval, and back to the start of any etcd outage (``outages``:
    (start, end)) that reaches into that blind spot, chained."""
    since = newest_at - RECORD_LAG
    moved = True
    while moved:
        moved = False
        for start, end in outages:
            if start <= newest_at and end >= since and start - RECORD_LAG < since:
                since, moved = start - RECORD_LAG, True
    return since


def jumps(rows: list[dict], outages: list[tuple[float, float]]) -> list[Jump]:
    """Each round that resumed below the newest step trained so far (the step in flight,
    retried, is not below it). Only where a worker starts training in a placement (its
    first row, a new rank or world, or a step below its own last): a frozen worker that
    thaws in a round that is over logs its old step once more, and trains nothing.
    ``outages``: when etcd could record nothing (``blind_from``)."""
    out: list[Jump] = []
    newest, newest_at = 0, 0.0
    trained: list[tuple[float, int]] = []
    last: dict[int, tuple[int, int, int]] = {}  # pid: (world, rank, step) of its last row
    for r in rows:
        prev = last.get(r["pid"])
        last[r["pid"]] = (r["world"], r["rank"], r["step"])
        starts = prev is None or prev[:2] != (r["world"], r["rank"]) or r["step"] < prev[2]
        same_round = out and out[-1].resumed <= r["step"] and r["t"] - out[-1].at < 5.0
        if starts and r["step"] < newest and not same_round:
            since = blind_from(newest_at, outages)
            lag = newest - min((s for t, s in trained if t >= since), default=0)
            out.append(Jump(r["t"], r["step"], newest - r["step"], lag))
            newest, trained = r["step"], []
        if r["step"] > newest:
            newest, newest_at = r["step"], r["t"]
            trained.append((r["t"], r["step"]))
    return out


def warnings(work: Path) -> dict[int, int]:
    """What the agents warned, as {step resumed from: steps it said are trained again}."""
    said: dict[int, int] = {}
    for f in work.glob("*.log"):
        for _, start, count in WARNED.findall(f.read_text(errors="replace")):
            said[int(start)] = max(said.get(int(start), 0), int(count))
    return said


def unsaid(found: list[Jump], said: dict[int, int], events: list[Event]) -> list[str]:
    """Each jump charged to the event before it; a jump no agent warned of, or warned of
    short by more than the record's blind spot after a kill, is a broken promise."""
    problems = []
    for j in found:
        before = [e for e in events if e.at <= j.at]
        if before:
            before[-1].redone += j.lost
        warned = said.get(j.resumed - 1, 0)  # restored step S: the first trained is S + 1
        if warned < j.lost - j.lag:
            problems.append(
                f"{j.lost} step(s) trained again from step {j.resumed}; "
                f"the agents said {warned} (the record may lag by {j.lag})"
            )
    return problems


def pauses(rows: list[dict], events: list[Event], end: float) -> None:
    """Each event's longest gap between logged steps until the next event (or the end)."""
    times = [r["t"] for r in rows]
    for i, e in enumerate(events):
        until = events[i + 1].at if i + 1 < len(events) else end
        inside = [t for t in times if e.at <= t <= until]
        prior = [t for t in times if t < e.at]
        points = ([prior[-1]] if prior else []) + inside
        after = [t for t in times if t > until][:1]
        points += after
        e.pause = max((b - a for a, b in itertools.pairwise(points)), default=0.0)


def run(a: argparse.Namespace) -> int:
    rng = random.Random(a.seed)
    kinds = [k.strip() for k in a.only.split(",")]
    work = Path(tempfile.mkdtemp(prefix=f"elastic-run-chaos-{a.seed}-"))
    problems: list[str] = []
    with EtcdServer(name="chaos") as etcd:
        s = Storm(etcd, work, a)
        s.out.mkdir()
        try:
            for _ in range(a.initial):
                s.start(s.fresh_name())
                time.sleep(0.3)
            deadline = time.monotonic() + 120
            first = min(a.initial, a.max_nodes) * a.nproc  # the others wait as standbys
            while len({r["rank"] for r in s.rows()}) < first:
                if time.monotonic() > deadline:
                    raise RuntimeError("the job never trained at its first size")
                time.sleep(0.1)
            events: list[Event] = []
            while len(events) < a.events and not (s.out / "final.pt").exists():
                time.sleep(rng.choice(GAPS))
                event = strike(s, rng.choice(kinds), rng)
                if event is not None:
                    events.append(event)
                    at = event.at - events[0].at
                    print(f"{at:7.2f}s {event.kind} {event.target}", flush=True)
            last_step = time.time()
            seen = 0
            while not s.finished():
                rows = s.rows()
                if len(rows) != seen:
                    seen, last_step = len(rows), time.time()
                if time.time() - last_step > a.stall:
                    problems.append(f"stalled: no step for {a.stall:.0f}s, nodes {s.alive()} alive")
                    break
                if not s.alive() and not (s.out / "final.pt").exists():
                    problems.append("every node is gone and the job did not finish")
                    break
                time.sleep(0.2)
            end = time.time()
            for name, node in s.nodes.items():
                rc = node.proc.poll()
                # a node told to leave exits 143, or dies of the signal if it came too
                # early in its start to be handled
                left = (128 + signal.SIGTERM, -signal.SIGTERM) if name in s.left else ()
                if name not in s.gone and rc not in (0, None, *left):
                    problems.append(f"node {name} exited {rc}")
        finally:
            for node in s.nodes.values():
                node.stop()
    rows = s.rows()
    found = jumps(rows, [(e.at, e.at + e.etcd_out) for e in events if e.etcd_out])
    problems += unsaid(found, warnings(work), events)
    pauses(rows, events, end)
    print(f"\n{'t (s)':>7}  {'event':<13}{'target':<10}{'pause':>7}  redone")
    for e in events:
        # alone: no other event within the bound before or after it (a storm's pauses
        # overlap, and a frozen node or etcd stays frozen 2x TTL + 1 s)
        near = [x for x in events if x is not e and abs(x.at - e.at) < PAUSE_BOUND]
        alone = not near and e.kind not in ("freeze", "etcd-freeze")
        mark = "" if alone else "  (compound)"
        at = e.at - events[0].at
        print(f"{at:7.2f}  {e.kind:<13}{e.target:<10}{e.pause:6.2f}s  {e.redone}{mark}")
        if alone and e.pause > PAUSE_BOUND:
            problems.append(f"{e.kind} {e.target}: training paused {e.pause:.1f}s")
    storm = max((e.pause for e in events), default=0.0)
    print(f"longest pause: {storm:.2f}s")
    gb = s.global_batch()
    for epoch in range(a.epochs):
        used = [i for r in rows if r["epoch"] == epoch for i in r["indices"]]
        lost = set(range(a.samples)) - set(used)
        if lost:
            problems.append(f"epoch {epoch}: {len(lost)} sample(s) never trained on")
    if (s.out / "final.pt").exists():
        final = torch.load(s.out / "final.pt")
        if final["step"] != a.epochs * a.samples // gb:
            problems.append(f"final step {final['step']}, expected {a.epochs * a.samples // gb}")
        # a step applied twice or skipped moves a weight by about the learning rate;
        # rounding far less (a wide model's: 1.1e-5 at --width 1024, undisturbed)
        atol = 1e-5 if a.width <= 16 else learning_rate(a.width) / 4
        for k, v in reference(a, gb).items():
            if not torch.allclose(final["model"][k], v, rtol=1e-4, atol=atol):
                problems.append(f"the final model differs from the undisturbed one ({k})")
                break
    elif not problems:
        problems.append("no final model")
    said = warnings(work)
    print(
        f"\nsteps trained again: {sum(j.lost for j in found)} in {len(found)} round(s); "
        f"the agents said {sum(said.get(j.resumed - 1, 0) for j in found)}"
    )
    for p in problems:
        print(f"BROKEN: {p}")
    print(f"{'OK' if not problems else 'FAILED'} (seed {a.seed}; logs under {work})")
    return 1 if problems else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--events", type=int, default=12)
    ap.add_argument("--initial", type=int, default=3, help="nodes before the first event")
    ap.add_argument("--nproc", type=int, default=1, help="workers per node")
    ap.add_argument(
        "--max-nodes",
        type=int,
        default=MAX_NODES,
        help=f"the job's MAX (--nnodes 1:MAX); of up to {MAX_NODES} nodes, those past it wait",
    )
    ap.add_argument("--mode", default="live", choices=("live", "respawn"))
    ap.add_argument("--only", default=",".join(EVENTS), help="event kinds, comma-separated")
    ap.add_argument("--samples", type=int, default=9600)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--step-time", type=float, default=0.03)
    ap.add_argument("--width", type=int, default=16, help="the model's width ...")
    ap.add_argument("--depth", type=int, default=0, help="... and hidden width x width layers")
    ap.add_argument("--stall", type=float, default=90.0, help="seconds without a step: stalled")
    a = ap.parse_args()
    unknown = [k for k in a.only.split(",") if k.strip() not in KNOWN]
    if unknown:
        ap.error(f"unknown event(s) {unknown}; known: {', '.join(KNOWN)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the nodes are stopped too
    sys.exit(run(a))


if __name__ == "__main__":
    main()
