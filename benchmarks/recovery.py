"""Seconds from a node's SIGKILL to the first training step at world size 2.

Three "nodes" (launcher plus workers, each a process tree) on this machine train the same
small gloo DDP script, under stock torchrun (c10d rendezvous, its defaults, --max-restarts
3 so it can recover at all), under elastic-run (its defaults, on a local etcd) and under
elastic-run with ``--start-method forkserver`` (workers forked from a process that
imported torch once). Once all three train, one node that does not host torchrun's c10d
store is SIGKILLed, agent and workers together. Printed: per run, the recovery time, and
the ratio.

    python benchmarks/recovery.py [--repeat 3] [--timeout 180]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._nodes import Node, first_step
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


def measure(
    make_cmd: Callable[[str, str], list[str]], endpoint: str, work: Path, timeout: float
) -> float | None:
    results = work / "steps"
    results.mkdir(parents=True)
    run_id = work.name
    nodes = []
    try:
        for i in range(3):
            nodes.append(
                Node(
                    make_cmd(endpoint, run_id), {"RESULT_DIR": str(results)}, work / f"node{i}.log"
                )
            )
            time.sleep(1.0 if i == 0 else 0.2)  # node 0 first: it hosts torchrun's store
        if first_step(results, 3, 0, 120) is None:
            raise RuntimeError(f"the job never trained at world size 3; see {work}")
        time.sleep(2.0)
        killed = time.time()
        nodes[2].kill()
        resumed = first_step(results, 2, killed, timeout)
        return None if resumed is None else resumed - killed
    finally:
        for n in nodes:
            n.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=180.0)
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="elastic-run-recovery-"))
    times: dict[str, list[float | None]] = {
        "torchrun (c10d)": [],
        "elastic-run": [],
        "elastic-run forkserver": [],
    }
    with EtcdServer(name="bench") as etcd:
        for i in range(a.repeat):
            port = free_port()
            times["torchrun (c10d)"].append(
                measure(torchrun_cmd, f"127.0.0.1:{port}", base / f"torchrun{i}", a.timeout)
            )
            times["elastic-run"].append(
                measure(elastic_cmd, etcd.endpoint, base / f"elastic{i}", a.timeout)
            )
            times["elastic-run forkserver"].append(
                measure(forkserver_cmd, etcd.endpoint, base / f"fork{i}", a.timeout)
            )
            print(
                f"run {i + 1}: "
                + ", ".join(
                    f"{k} {v[-1]:.1f}s" if v[-1] is not None else f"{k} >{a.timeout:.0f}s"
                    for k, v in times.items()
                ),
                flush=True,
            )

    def median(v: list[float | None]) -> float:
        return statistics.median(x if x is not None else a.timeout for x in v)

    t = median(times["torchrun (c10d)"])
    print("\nseconds from SIGKILL of one of 3 nodes to the first step at world size 2")
    print(f"{'launcher':<24}{'median':>10}{'vs torchrun':>13}   runs")
    for k, v in times.items():
        runs = " ".join(f"{x:.1f}" if x is not None else f">{a.timeout:.0f}" for x in v)
        print(f"{k:<24}{median(v):>9.1f}s{t / median(v):>12.1f}x   {runs}")
    print("\ntarget: elastic-run at least 10x faster than torchrun")
    print(f"logs: {base}")


if __name__ == "__main__":
    main()
