"""Rendezvous at scale: N participants on one etcd, elastic-run's etcd v3 rendezvous and
torch's c10d side by side, with etcd's own counters for what each round cost it.

For each N, two jobs of N participants, each participant a full ``Rendezvous`` (its own
lease, record, watches and probe port), no torch. Participants live as threads, up to 64
to a process, in up to 16 processes, sharing their process's connection to etcd and so
its one watch stream and one keep-alive stream (etcd sees each participant's watches,
keep-alives and requests as it would from separate agents); one of them, the victim,
has a process of its own so that it can be SIGKILLed for real.
The clock starts when all are connected and are released together, and stops when the
last holds round 1 ("form"). Then:

  - kill: the victim is SIGKILLed, and every survivor is told what an agent hears from
    its workers when a peer vanishes mid-collective (it probes: ``probe_members``); the
    clock stops when the last survivor holds round 2 ("kill");
  - leave: the victim leaves as an agent does on SIGTERM (``announce_leaving``, then
    ``shutdown``); the clock stops when the last survivor holds round 2 ("leave").

etcd's counters (its ``/metrics``) are read around round 1 of the kill job: bytes it
sent to clients, gRPC messages it received (requests, including stream messages), watch
events it sent, per round and per participant. torch's c10d (``torchrun --rdzv-backend
c10d``: a ``DynamicRendezvousHandler`` per participant, one TCPStore) forms round 1 beside
it, each participant a forked process, up to ``--c10d-max`` participants.

    python benchmarks/rendezvous_scale.py [--sizes 8,32,128,512,1024] [--repeat 1]
                                          [--c10d-max 128] [--timeout 120]
                                          [--rdzv-conf lease_ttl=15] [--etcd-cpus 2]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families

from elastic.agent.etcd_server import EtcdServer
from rendezvous.client import EtcdClient
from rendezvous.config import RdzvConf, build_options
from rendezvous.errors import RendezvousCancelled
from rendezvous.net import free_port
from rendezvous.protocol import NodeSpec, Rendezvous

PER_PROCESS = 64
PROCESSES = 16
REPORT = struct.Struct("iid")  # participant, round number (-1: failed), time
IDLE = 5.0  # seconds the keep-alive load is measured over


# -- elastic-run participants -----------------------------------------------------------------
def _participants(
    endpoint: str, run_id: str, n: int, conf: dict[str, str], ids: list[int], cmd_r: int, rep_w: int
) -> None:
    """A process's share of the participants (runs in a forked child, never returns)."""
    go = threading.Event()
    rdzvs: dict[int, Rendezvous] = {}

    def report(i: int, number: int) -> None:
        os.write(rep_w, REPORT.pack(i, number, time.time()))

    def run(i: int) -> None:
        rdzv = rdzvs[i]
        try:
            go.wait()
            rdzv.start()
            while True:  # an agent's loop, less the workers
                r = rdzv.next_round()
                report(i, r.number)
                version = rdzv.version
                while True:
                    rdzv.upkeep()
                    if rdzv.check() is not None:
                        break
                    version = rdzv.wait(version, 1.0)
        except RendezvousCancelled:
            return  # it left the job
        except Exception as e:
            print(f"participant {i}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            report(i, -1)

    etcd, opts = build_options(
        endpoint, run_id, max(1, n - 1), n, RdzvConf.parse(conf)
    )  # N, then N-1
    client = EtcdClient(etcd)  # one connection per process, shared as an agent's would be
    client.get_prefix(opts.job_prefix)  # connected before the clock starts
    for i in ids:
        rdzvs[i] = Rendezvous(
            client, opts, NodeSpec(id=f"p{i:05d}", addr="127.0.0.1", nproc=1, pid=os.getpid())
        )
    for i in ids:
        threading.Thread(target=run, args=(i,), daemon=True).start()
    report(-1, 0)  # ready
    while True:
        cmd = os.read(cmd_r, 1)
        if cmd == b"g":
            go.set()
        elif cmd == b"p":  # a peer vanished under this node's workers: probe
            for rdzv in rdzvs.values():
                try:
                    rdzv.probe_members()
                except Exception as e:
                    print(f"probe: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        elif cmd == b"l":  # SIGTERM: announce, drain (no workers here), leave, exit
            for rdzv in rdzvs.values():
                rdzv.announce_leaving()
                rdzv.shutdown(leave=True)
            os._exit(0)
        else:
            os._exit(0)


@dataclass
class Group:
    pid: int
    cmd_w: int


class Job:
    """N elastic-run participants in forked processes; the victim alone in the last."""

    def __init__(self, endpoint: str, run_id: str, n: int, conf: dict[str, str]) -> None:
        self.n = n
        self.rep_r, rep_w = os.pipe()
        others = list(range(n - 1))
        procs = min(PROCESSES, max(1, math.ceil(len(others) / PER_PROCESS)))
        shares = [others[k::procs] for k in range(procs)] if others else []
        self.groups: list[Group] = []
        for ids in [*shares, [n - 1]]:
            cmd_r, cmd_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(self.rep_r)
                    _participants(endpoint, run_id, n, conf, ids, cmd_r, rep_w)
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(1)
            os.close(cmd_r)
            self.groups.append(Group(pid, cmd_w))
        os.close(rep_w)
        self.rounds: dict[int, dict[int, float]] = {}
        self.ready = 0

    @property
    def victim(self) -> Group:
        return self.groups[-1]

    def send(self, cmd: bytes, groups: list[Group] | None = None) -> None:
        for g in self.groups if groups is None else groups:
            os.write(g.cmd_w, cmd)

    def wait(self, until: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        buf = b""
        while not until():
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.rep_r], [], [], left)[0]:
                raise TimeoutError(f"no progress after {timeout:g}s: {self.progress()}")
            chunk = os.read(self.rep_r, REPORT.size * 256)
            if not chunk:
                raise EOFError("every participant process is gone")
            buf += chunk
            while len(buf) >= REPORT.size:
                i, number, at = REPORT.unpack(buf[: REPORT.size])
                buf = buf[REPORT.size :]
                if i < 0:
                    self.ready += 1
                elif number < 0:
                    raise RuntimeError(f"participant {i} failed (see its error above)")
                else:
                    self.rounds.setdefault(number, {})[i] = at

    def progress(self) -> str:
        held = {k: len(v) for k, v in sorted(self.rounds.items())}
        return f"{self.ready} of {len(self.groups)} processes ready, rounds held {held}"

    def held(self, number: int, count: int) -> bool:
        return len(self.rounds.get(number, {})) >= count

    def last(self, number: int) -> float:
        return max(self.rounds[number].values())

    def cpu(self) -> float:
        """CPU seconds the participant processes have used so far."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for g in self.groups:
            with contextlib.suppress(OSError), open(f"/proc/{g.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def close(self) -> None:
        live = [g.pid for g in self.groups if g.pid]
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in live:
            os.waitpid(pid, 0)
        for g in self.groups:
            os.close(g.cmd_w)
        os.close(self.rep_r)


# etcd's metrics, by the name each is summed under here
COUNTERS = {
    "etcd_network_client_grpc_sent_bytes_total": "sent",
    "etcd_network_client_grpc_received_bytes_total": "received",
    "grpc_server_msg_received_total": "requests",
    "etcd_debugging_mvcc_events_total": "events",
    "etcd_debugging_mvcc_watcher_total": "watchers",
    "etcd_debugging_lease_renewed_total": "renewed",
    "process_cpu_seconds_total": "cpu",
}


def etcd_counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in COUNTERS:
                out[COUNTERS[s.name]] += s.value
    return out


@dataclass
class Measured:
    form: float
    after: float  # kill or leave -> last survivor in round 2
    cost: dict[str, float]  # etcd's counters over round 1
    idle: dict[str, float]  # per second while the round runs: lease renewals, etcd's CPU


def elastic(
    etcd: EtcdServer, n: int, run_id: str, how: str, timeout: float, conf: dict[str, str]
) -> Measured:
    job = Job(etcd.endpoint, run_id, n, conf)
    try:
        job.wait(lambda: job.ready == len(job.groups), timeout)
        before = etcd_counters(etcd.client_url)
        before["participants"] = job.cpu()
        start = time.time()
        job.send(b"g")
        job.wait(lambda: job.held(1, n), timeout)
        form = job.last(1) - start
        time.sleep(0.5)  # the stragglers' last writes of round 1 land in its cost
        after_round = etcd_counters(etcd.client_url)
        after_round["participants"] = job.cpu()
        cost = {k: after_round[k] - before[k] for k in before if k != "watchers"}
        cost["watchers"] = after_round["watchers"]
        time.sleep(IDLE)  # nothing happens but keep-alives
        later = etcd_counters(etcd.client_url)
        later["participants"] = job.cpu()
        idle = {
            k: (later[k] - after_round[k]) / IDLE
            for k in ("renewed", "cpu", "requests", "participants")
        }
        t0 = time.time()
        if how == "kill":
            os.kill(job.victim.pid, signal.SIGKILL)
            os.waitpid(job.victim.pid, 0)  # its sockets are closed: what its peers notice
            job.victim.pid = 0
            job.send(b"p", job.groups[:-1])
        else:
            job.send(b"l", [job.victim])
        job.wait(lambda: job.held(2, n - 1), timeout)
        return Measured(form, job.last(2) - t0, cost, idle)
    finally:
        job.close()


# -- torch's c10d -----------------------------------------------------------------------------
_STORE_SERVER = """
import datetime, signal, sys
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=600))
print("up", flush=True)
signal.pause()
"""


def _read_exact(fd: int, size: int, deadline: float) -> bytes:
    data = b""
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("c10d participants did not finish in time")
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("a participant died")
        data += chunk
    return data


def c10d(n: int, run_id: str, timeout: float) -> float:
    """Seconds for n forked c10d participants to hold one round."""
    import datetime

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _STORE_SERVER, str(port)], stdout=subprocess.PIPE, text=True
    )
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pids = []
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                try:
                    store = TCPStore(
                        "127.0.0.1",
                        port,
                        is_master=False,
                        timeout=datetime.timedelta(seconds=timeout),
                    )
                    params = RendezvousParameters(
                        backend="c10d",
                        endpoint=f"127.0.0.1:{port}",
                        run_id=run_id,
                        min_nodes=n,
                        max_nodes=n,
                        local_addr="127.0.0.1",
                        join_timeout=str(int(timeout)),
                    )
                    handler = create_handler(store, C10dRendezvousBackend(store, run_id), params)
                    os.write(ready_w, b"r")
                    os.read(go_r, 1)
                    handler.next_rendezvous()
                    os.write(done_w, struct.pack("d", time.time()))
                    signal.pause()
                finally:
                    os._exit(1)
            pids.append(pid)
        deadline = time.monotonic() + timeout
        _read_exact(ready_r, n, deadline)
        start = time.time()
        os.write(go_w, b"g" * n)
        deadline = time.monotonic() + timeout
        ends = [struct.unpack("d", _read_exact(done_r, 8, deadline))[0] for _ in range(n)]
        return float(max(ends) - start)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, go_r, go_w, done_r, done_w):
            os.close(fd)
        server.kill()
        server.wait()


# -- the run ----------------------------------------------------------------------------------
def attempt(run: Callable[..., Measured | float], *args: object) -> Measured | float | None:
    started = time.perf_counter()
    try:
        return run(*args)
    except Exception as e:
        took = time.perf_counter() - started
        print(f"  failed after {took:.1f}s: {type(e).__name__}: {e}", flush=True)
        return None


def show(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def pin(etcd: EtcdServer, k: int) -> None:
    """etcd on the first ``k`` CPUs this process may use, this process (and so every
    participant it forks) on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= k:
        print(f"--etcd-cpus {k}: not pinned, only {len(cpus)} CPUs here", flush=True)
        return
    assert etcd.proc is not None
    os.sched_setaffinity(etcd.proc.pid, cpus[:k])
    os.sched_setaffinity(0, cpus[k:])
    print(f"etcd pinned to CPUs {cpus[:k]}, the participants to {cpus[k:]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,32,128,512,1024")
    ap.add_argument("--repeat", type=int, default=1, help="jobs of each kind per N")
    ap.add_argument("--c10d-max", type=int, default=128, help="largest N c10d is tried at")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--rdzv-conf", default="", help="as elastic-run's, e.g. lease_ttl=15 (default: none)"
    )
    ap.add_argument(
        "--etcd-cpus",
        type=int,
        default=0,
        help="pin etcd to this many CPUs of its own, the participants to the rest (0: no pinning)",
    )
    a = ap.parse_args()
    conf = dict(kv.split("=", 1) for kv in a.rdzv_conf.split(",") if kv)
    rows = []
    with EtcdServer(name="bench") as etcd:
        if a.etcd_cpus:
            pin(etcd, a.etcd_cpus)
        for n in (int(s) for s in a.sizes.split(",")):
            kills: list[Measured | float | None] = []
            leaves: list[Measured | float | None] = []
            for r in range(a.repeat):
                for how, out in (("kill", kills), ("leave", leaves)):
                    job = f"scale-{n}-{how}-{r}"
                    out.append(attempt(elastic, etcd, n, job, how, a.timeout, conf))
            ok_k = [m for m in kills if isinstance(m, Measured)]
            ok_l = [m for m in leaves if isinstance(m, Measured)]
            forms = [m.form for m in ok_k + ok_l]
            theirs = None
            if n <= a.c10d_max:
                got = [attempt(c10d, n, f"c10d-{n}-{r}", a.timeout) for r in range(a.repeat)]
                ok = [x for x in got if isinstance(x, float)]
                theirs = statistics.median(ok) if len(ok) == len(got) else None
            row = (
                n,
                statistics.median(forms) if forms else None,
                statistics.median(m.after for m in ok_k) if ok_k else None,
                statistics.median(m.after for m in ok_l) if ok_l else None,
                ok_k[0] if ok_k else None,
                theirs,
            )
            rows.append(row)
            print(
                f"N={n}: form {show(row[1])}, kill {show(row[2])}, leave {show(row[3])}; "
                f"c10d form {show(theirs)}",
                flush=True,
            )
    print("\nelastic-run: seconds until the last participant holds the round (median)")
    print(f"{'N':>6}{'form':>9}{'kill':>9}{'leave':>9}{'c10d form':>11}{'c10d/ours':>11}")
    for n, form, kill, leave, _, theirs in rows:
        ratio = f"{theirs / form:.1f}x" if theirs and form else "-"
        print(f"{n:>6}{show(form):>9}{show(kill):>9}{show(leave):>9}{show(theirs):>11}{ratio:>11}")
    print("\netcd's counters over round 1 (from its /metrics; requests without keep-alives)")
    print(
        f"{'N':>6}{'sent MB':>10}{'sent/N KB':>11}{'requests':>10}{'req/N':>8}"
        f"{'events':>9}{'events/N':>10}{'watchers':>10}{'etcd CPU':>10}{'their CPU':>12}"
    )
    for n, _, _, _, m, _ in rows:
        if m is None:
            continue
        cost = m.cost
        requests = cost["requests"] - cost["renewed"]  # keep-alives are counted apart
        print(
            f"{n:>6}{cost['sent'] / 1e6:>10.2f}{cost['sent'] / n / 1e3:>11.1f}"
            f"{requests:>10.0f}{requests / n:>8.1f}"
            f"{cost['events']:>9.0f}{cost['events'] / n:>10.1f}{cost['watchers']:>10.0f}"
            f"{cost['cpu']:>9.2f}s{cost['participants']:>11.2f}s"
        )
    print(f"\nwhile the round runs (over {IDLE:g} s, default lease TTL): keep-alive load on etcd")
    print(
        f"{'N':>6}{'renewals/s':>12}{'requests/s':>12}{'etcd CPU':>10}{'CPU/renewal':>13}"
        f"{'their CPU':>11}"
    )
    for n, _, _, _, m, _ in rows:
        if m is None:
            continue
        idle = m.idle
        per = idle["cpu"] / idle["renewed"] * 1e6 if idle["renewed"] else 0.0
        print(
            f"{n:>6}{idle['renewed']:>12.0f}{idle['requests']:>12.0f}"
            f"{idle['cpu'] * 100:>9.1f}%{per:>10.0f} us{idle['participants'] * 100:>10.0f}%"
        )
    print(
        "targets: 1,024 participants form a round in < 3 s and re-form after a loss in < 1 s; "
        "bytes per round grow linearly; faster than c10d at every N"
    )


if __name__ == "__main__":
    main()
