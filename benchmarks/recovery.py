"""Seconds from a node's SIGKILL to the first training step at world size 2.

Three "nodes" (launcher plus workers, each a process tree) on this machine train the same
small gloo DDP script, under stock torchrun (c10d rendezvous, its defaults, --max-restarts
3 so it can recover at all), under elastic-run (its defaults, on a local etcd), under
elastic-run with ``--start-method forkserver`` (workers forked from a process that
imported torch once) and under elastic-run with the script's loop in ``State.run`` (live:
the survivors keep their processes). Once all three train, one node that does not host
torchrun's c10d store is SIGKILLed, agent and workers together. Printed: per run, the
recovery time, and the ratio.

Then, live only: a node that leaves (SIGTERM) to the first step at world size 2; a node
frozen (SIGSTOP, agent and workers) to the first step at world size 2 (the lease TTL, 5 s
by default, is the detection time); and the survivors' pause when a third node joins
(their last step at world size 2 to the first at 3), with the newcomer's workers spawned
and forked from its fork server.

    python benchmarks/recovery.py [--repeat 3] [--timeout 180] [--skip-torchrun]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._nodes import Node, first_step, steps
from elastic.agent.etcd_server import EtcdServer
from rendezvous.net import free_port

SCRIPT = str(Path(__file__).resolve().parent / "ddp_steps.py")
COMMON = ["--nnodes", "2:3", "--nproc-per-node", "1", "--local-addr", "127.0.0.1"]


def torchrun_cmd(endpoint: str, run_id: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *COMMON,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "3",
        SCRIPT,
    ]


def elastic_cmd(endpoint: str, run_id: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "elastic",
        *COMMON,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        *extra,
        SCRIPT,
    ]


def forkserver_cmd(endpoint: str, run_id: str) -> list[str]:
    return elastic_cmd(endpoint, run_id, "--start-method", "forkserver")


def live_cmd(endpoint: str, run_id: str) -> list[str]:
    return [*elastic_cmd(endpoint, run_id), "--live"]


def live_fork_cmd(endpoint: str, run_id: str) -> list[str]:
    return [*forkserver_cmd(endpoint, run_id), "--live"]


TORCHFT_SCRIPT = str(Path(__file__).resolve().parent / "torchft_steps.py")


def torchft_node(python: str, lighthouse: str) -> Callable[[int], tuple[list[str], dict]]:
    """A TorchFT replica group per node: torchrun with one worker, its own store port."""

    def node(i: int) -> tuple[list[str], dict]:
        cmd = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1"]
        cmd += ["--master-port", str(free_port()), TORCHFT_SCRIPT]
        return cmd, {"REPLICA_GROUP_ID": str(i), "TORCHFT_LIGHTHOUSE": lighthouse}

    return node


def measure_torchft(python: str, work: Path, timeout: float) -> float | None:
    """The SIGKILL measurement under TorchFT, with its Lighthouse as its README starts it
    (--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000)."""
    work.mkdir(parents=True)
    port = free_port()
    binary = str(Path(python).parent / "torchft_lighthouse")
    flags = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
    lighthouse = Node([binary, *flags, "--bind", f"[::]:{port}"], {}, work / "lighthouse.log")
    try:
        node = torchft_node(python, f"http://localhost:{port}")
        return measure(lambda e, r: [], "", work, timeout, per_node=node)
    finally:
        lighthouse.stop()


def measure(
    make_cmd: Callable[[str, str], list[str]],
    endpoint: str,
    work: Path,
    timeout: float,
    fault: str = "kill",
    per_node: Callable[[int], tuple[list[str], dict]] | None = None,
) -> float | None:
    """Seconds from ``fault`` (kill, term, stop: of the third node; join: of a third
    node) to the first step at the new world size; for join, the survivors' pause.
    ``per_node``: each node's own command and environment, instead of ``make_cmd``'s."""
    results = work / "steps"
    results.mkdir(parents=True)
    run_id = work.name
    nodes: list[Node] = []

    def start(i: int) -> None:
        env = {"RESULT_DIR": str(results)}
        cmd = make_cmd(endpoint, run_id)
        if per_node is not None:
            cmd, extra = per_node(i)
            env.update(extra)
        nodes.append(Node(cmd, env, work / f"node{i}.log"))

    try:
        for i in range(2 if fault == "join" else 3):
            start(i)
            time.sleep(1.0 if i == 0 else 0.2)  # node 0 first: it hosts torchrun's store
        world = len(nodes)
        if first_step(results, world, 0, 120) is None:
            raise RuntimeError(f"the job never trained at world size {world}; see {work}")
        time.sleep(2.0)
        at = time.time()
        if fault == "join":
            start(2)
            resumed = first_step(results, 3, at, timeout)
            if resumed is None:
                return None
            before = [s["t"] for s in steps(results) if s["world"] == 2 and s["t"] < resumed]
            return float(resumed - max(before))
        {"kill": nodes[2].kill, "term": nodes[2].term, "stop": nodes[2].freeze}[fault]()
        resumed = first_step(results, 2, at, timeout)
        return None if resumed is None else resumed - at
    finally:
        for n in nodes:
            n.stop()


def report(
    title: str, times: dict[str, list[float | None]], timeout: float, ratios: bool = True
) -> None:
    """Medians (a run that never recovered counts as ``timeout``), and with ``ratios``
    each one against the first row's (torchrun's)."""

    def median(v: list[float | None]) -> float:
        return statistics.median(x if x is not None else timeout for x in v)

    base = next(iter(times.values()))
    print(f"\n{title}")
    print(f"{'':<26}{'median':>10}{'vs first' if ratios else '':>10}   runs")
    for k, v in times.items():
        runs = " ".join(f"{x:.2f}" if x is not None else f">{timeout:.0f}" for x in v)
        ratio = f"{median(base) / median(v):>9.1f}x" if ratios else " " * 10
        print(f"{k:<26}{median(v):>9.2f}s{ratio}   {runs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--skip-torchrun", action="store_true", help="it takes ~50 s a run")
    ap.add_argument(
        "--torchft-python",
        default=None,
        help="a python with torchft 0.2.0 installed (default: this one, if it has it)",
    )
    a = ap.parse_args()
    tft = a.torchft_python
    if tft is None and importlib.util.find_spec("torchft") is not None:
        tft = sys.executable
    base = Path(tempfile.mkdtemp(prefix="elastic-run-recovery-"))
    kinds: dict[str, Callable[[str, str], list[str]]] = {
        "torchrun (c10d)": torchrun_cmd,
        "elastic-run": elastic_cmd,
        "elastic-run forkserver": forkserver_cmd,
        "elastic-run live": live_cmd,
    }
    if a.skip_torchrun:
        del kinds["torchrun (c10d)"]
    kill: dict[str, list[float | None]] = {k: [] for k in kinds}
    if tft:
        kill["TorchFT 0.2"] = []
    faults = {
        "SIGTERM leave": ("term", live_cmd),
        "SIGSTOP (frozen)": ("stop", live_cmd),
        "join: pause": ("join", live_cmd),
        "join: pause, forkserver": ("join", live_fork_cmd),
    }
    live: dict[str, list[float | None]] = {name: [] for name in faults}
    with EtcdServer(name="bench") as etcd:
        for i in range(a.repeat):
            for k, make in kinds.items():
                endpoint = etcd.endpoint
                if make is torchrun_cmd:
                    endpoint = f"127.0.0.1:{free_port()}"
                work = base / f"{make.__name__}{i}"
                kill[k].append(measure(make, endpoint, work, a.timeout))
            if tft:
                work = base / f"torchft{i}"
                kill["TorchFT 0.2"].append(measure_torchft(tft, work, a.timeout))
            for name, (fault, make) in faults.items():
                work = base / f"{make.__name__}-{fault}{i}"
                live[name].append(measure(make, etcd.endpoint, work, a.timeout, fault))
            done = {**kill, **live}
            print(
                f"run {i + 1}: "
                + ", ".join(
                    f"{k} {v[-1]:.2f}s" if v[-1] is not None else f"{k} >{a.timeout:.0f}s"
                    for k, v in done.items()
                ),
                flush=True,
            )
    title = "seconds from SIGKILL of one of 3 nodes to the first step at world size 2"
    report(title, kill, a.timeout)
    title = "elastic-run live: seconds to the first step at the new world size"
    report(title, live, a.timeout, ratios=False)
    print("\ntargets (live): SIGKILL <= 1.0 s, SIGTERM leave <= 0.5 s, SIGSTOP <= lease TTL + 1 s")
    print("(5 + 1 s), survivors' pause for a join <= 1 s")
    if not tft:
        print("TorchFT: not measured (pip install torchft==0.2.0, or --torchft-python)")
    print(f"logs: {base}")


if __name__ == "__main__":
    main()
