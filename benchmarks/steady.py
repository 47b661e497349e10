"""What the steady state costs: the step time of a tiny DDP job, side by side.

Two "nodes" (launcher plus one worker each) on this machine train ``ddp_steps.py`` with
no pause between steps (a step of a few milliseconds, so any per-step cost of the
launcher or of ``elastic.State`` shows), under stock torchrun, under elastic-run, and
under elastic-run with the loop in ``State.run`` and ``commit()`` every step (snapshots
at the default ``--snapshot-every auto``). Each run trains for ``--seconds``; the first
``--warmup`` seconds are left out. Printed: the median step time of each run (from every
rank's logged step times) and its ratio to torchrun's and to elastic-run's plain step.
The kinds take turns, ``--repeat`` times, so a slow spell of the machine hits all alike.

    python benchmarks/steady.py [--repeat 3] [--seconds 8] [--warmup 3]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._nodes import Node, first_step, steps
from elastic.agent.etcd_server import EtcdServer
from rendezvous.net import free_port

SCRIPT = str(Path(__file__).resolve().parent / "ddp_steps.py")
COMMON = ["--nnodes", "2", "--nproc-per-node", "1", "--local-addr", "127.0.0.1"]


def torchrun_cmd(etcd: str, run_id: str) -> list[str]:
    endpoint = f"127.0.0.1:{free_port()}"  # c10d: the first node hosts the store
    return [sys.executable, "-m", "torch.distributed.run", *COMMON, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, SCRIPT, "0"]  # fmt: skip


def elastic_cmd(etcd: str, run_id: str) -> list[str]:
    return [sys.executable, "-m", "elastic", *COMMON, "--rdzv-endpoint", etcd,
            "--rdzv-id", run_id, SCRIPT, "0"]  # fmt: skip


def state_cmd(etcd: str, run_id: str) -> list[str]:
    return [*elastic_cmd(etcd, run_id), "--live"]


def step_time(make: Callable[[str, str], list[str]], etcd: str, work: Path, a: Any) -> float:
    """The median seconds between one rank's consecutive steps, after the warm-up."""
    results = work / "steps"
    results.mkdir(parents=True)
    cmd = make(etcd, work.name)
    nodes: list[Node] = []
    try:
        for i in range(2):
            nodes.append(Node(cmd, {"RESULT_DIR": str(results)}, work / f"node{i}.log"))
            if make is torchrun_cmd and i == 0:
                time.sleep(1.0)  # node 0 hosts torchrun's store
        started = first_step(results, 2, 0, 120)
        if started is None:
            raise RuntimeError(f"the job never trained at world size 2; see {work}")
        time.sleep(max(0.0, started + a.warmup + a.seconds - time.time()))
    finally:
        for n in nodes:
            n.stop()
    gaps: list[float] = []
    for rank in (0, 1):
        ts = [s["t"] for s in steps(results) if s["rank"] == rank and s["t"] > started + a.warmup]
        gaps += [b - x for x, b in itertools.pairwise(ts)]
    if len(gaps) < 10:
        raise RuntimeError(f"only {len(gaps)} steps measured; see {work}")
    return statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured, per run")
    ap.add_argument("--warmup", type=float, default=3.0, help="left out, per run")
    a = ap.parse_args()
    kinds: dict[str, Callable[[str, str], list[str]]] = {
        "torchrun": torchrun_cmd,
        "elastic-run": elastic_cmd,
        "elastic-run, State + commit()": state_cmd,
    }
    base = Path(tempfile.mkdtemp(prefix="elastic-run-steady-"))
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with EtcdServer(name="bench") as etcd:
        for i in range(a.repeat):
            for k, make in kinds.items():
                times[k].append(step_time(make, etcd.endpoint, base / f"{make.__name__}{i}", a))
            print(
                f"run {i + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.2f} ms" for k, v in times.items())
            )
    med = {k: statistics.median(v) for k, v in times.items()}
    print("\nmedian step time of a tiny DDP step on 2 nodes (1 worker each), no pause")
    print(f"{'':<32}{'step':>10}{'/ torchrun':>12}{'/ elastic-run':>15}   runs (ms)")
    for k, v in times.items():
        runs = " ".join(f"{x * 1e3:.2f}" for x in v)
        print(
            f"{k:<32}{med[k] * 1e3:>8.2f}ms{med[k] / med['torchrun']:>11.2f}x"
            f"{med[k] / med['elastic-run']:>14.2f}x   {runs}"
        )
    print(f"(logs under {base})")


if __name__ == "__main__":
    main()
