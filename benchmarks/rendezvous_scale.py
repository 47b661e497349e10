"""Time for N participants to form one round: elastic-run's etcd v3 rendezvous vs torch's c10d.

Each participant is its own process (forked from this one after the imports, so 128 of
them fit in memory) with its own connection, as each agent is on a real cluster: for
elastic-run a ``Rendezvous`` with its own etcd client, lease and watch on one local etcd;
for torch a ``DynamicRendezvousHandler`` with its own TCPStore client on one TCPStore
server (torch's c10d backend, as ``torchrun --rdzv-backend c10d`` builds it). All connect
first; the clock starts when they are released together and stops when the last one
holds the round.

    python benchmarks/rendezvous_scale.py [--sizes 8,32,128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elastic.agent.etcd_server import EtcdServer
from rendezvous.client import EtcdClient
from rendezvous.config import build_options
from rendezvous.net import free_port
from rendezvous.protocol import NodeSpec, Rendezvous

Go = Callable[[], None]


def _read_exact(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("a participant died")
        data += chunk
    return data


def forked(n: int, prepare: Callable[[int], Go], timeout: float) -> float:
    """Fork n participants; each prepares (connects), then all run ``go`` at once."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:  # the participant
            code = 0
            try:
                go = prepare(i)
                os.write(ready_w, b"r")
                os.read(go_r, 1)
                go()
                os.write(done_w, struct.pack("d", time.time()))
                signal.pause()  # keep the lease until the parent is done measuring
            except BaseException as e:  # report; never return into the parent's code
                print(f"participant {i}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                with contextlib.suppress(OSError):
                    os.write(done_w, struct.pack("d", -1.0))
                code = 1
            os._exit(code)
        pids.append(pid)
    try:
        _read_exact(ready_r, n)
        start = time.time()
        os.write(go_w, b"g" * n)
        deadline = time.monotonic() + timeout
        ends = []
        while len(ends) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ends)} of {n} participants done after {timeout}s")
            ends.append(struct.unpack("d", _read_exact(done_r, 8))[0])
        if min(ends) < 0:
            raise RuntimeError("a participant failed")
        return max(ends) - start
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, go_r, go_w, done_r, done_w):
            os.close(fd)


def elastic(endpoint: str, n: int, run_id: str, timeout: float) -> float:
    def prepare(i: int) -> Go:
        etcd, opts = build_options(endpoint, run_id, n, n, {})
        client = EtcdClient(etcd)
        client.get_prefix(opts.job_prefix)  # connected before the clock starts
        rdzv = Rendezvous(
            client, opts, NodeSpec(id=f"p{i}", addr="127.0.0.1", nproc=1, pid=os.getpid())
        )

        def go() -> None:
            rdzv.start()
            rdzv.next_round()

        return go

    return forked(n, prepare, timeout)


_STORE_SERVER = """
import datetime, signal, sys
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=600))
print("up", flush=True)
signal.pause()
"""


def c10d(n: int, run_id: str, timeout: float) -> float:
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
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"

        def prepare(i: int) -> Go:
            store = TCPStore(
                "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
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
            return handler.next_rendezvous

        return forked(n, prepare, timeout)
    finally:
        server.kill()
        server.wait()


def attempt(run: Callable[..., float], *args: object) -> float:
    """Seconds, or infinity when the rendezvous failed (the error is printed)."""
    started = time.perf_counter()
    try:
        return run(*args)
    except Exception as e:
        print(
            f"  failed after {time.perf_counter() - started:.1f}s: {type(e).__name__}: {e}",
            flush=True,
        )
        return float("inf")


def show(x: float) -> str:
    return "failed" if x == float("inf") else f"{x:.2f}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,32,128")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    rows = []
    with EtcdServer(name="bench") as etcd:
        for n in (int(s) for s in a.sizes.split(",")):
            ours = [
                attempt(elastic, etcd.endpoint, n, f"scale-{n}-{r}", a.timeout)
                for r in range(a.repeat)
            ]
            print(f"N={n}: elastic-run {' '.join(map(show, ours))}", flush=True)
            theirs = [attempt(c10d, n, f"scale-{n}-{r}", a.timeout) for r in range(a.repeat)]
            print(f"N={n}: torch c10d  {' '.join(map(show, theirs))}", flush=True)
            rows.append((n, statistics.median(ours), statistics.median(theirs)))
    print(
        f"\nseconds until all N participants hold one round (median of {a.repeat}; "
        "a failed run counts as infinite)"
    )
    print(f"{'N':>5}{'elastic-run':>14}{'torch c10d':>14}{'c10d / ours':>14}")
    for n, e, c in rows:
        print(f"{n:>5}{show(e):>14}{show(c):>14}{c / e:>13.1f}x")
    print("target: 128 participants in under 2 s, faster than c10d at every N")


if __name__ == "__main__":
    main()
