"""What the steady state costs: the step time of a tiny DDP job, side by side.

Two "nodes" (launcher plus one worker each) on this machine train ``ddp_steps.py`` with
no pause between steps (a step of a few milliseconds, so any per-step cost of the
launcher or of ``elastic.State`` shows), under stock torchrun, under elastic-run, and
under elastic-run with the loop in ``State.run`` and ``commit()`` every step (snapshots
at the default ``--snapshot-every auto``). Each run trains for ``--seconds``; the first
``--warmup`` seconds are left out. Printed: the median step time of each run (from every
rank's logged step times) and its ratio to torchrun's and to elastic-run's plain step;
and, from one more run that trains ``AB`` steps under ``State`` (its comm hook and
``commit()``) and ``AB`` of a twin model in a DDP ``State`` does not know, in turn, the
step with it over the step without (this VM's plain step moves 1.4-4 ms
between runs, more than the differences it is to show: a paired figure, measured in the
same processes at the same moments, is not moved by that), as the ratio of the phases'
mean steps (which count the rare agreements and snapshots, but also the 2-4 ms stalls
of a quarter of the steps that two ranks on 2 busy cores see, alike in both phases,
which dilute it) and of their medians (what every step pays); and the agents' own CPU.
The kinds take turns, ``--repeat`` times, so a slow spell of the machine hits all alike.

What ``State`` adds is a cost per step (its comm hook, ``commit()``), not a share of it:
``--width N`` trains four Linear(N, N) layers instead of the tiny Linear(32, 1), for the
same figures at a longer step (``--width 512``: about 10 ms here).

    python benchmarks/steady.py [--repeat 3] [--seconds 8] [--warmup 3] [--width N]
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
from typing import Any, NamedTuple

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._nodes import Node, first_step, steps
from elastic.agent.etcd_server import EtcdServer
from rendezvous.net import free_port

SCRIPT = str(Path(__file__).resolve().parent / "ddp_steps.py")
COMMON = ["--nnodes", "2", "--nproc-per-node", "1", "--local-addr", "127.0.0.1"]


WIDTH: list[str] = []  # the script's model: --width's, where one was given


def torchrun_cmd(etcd: str, run_id: str) -> list[str]:
    endpoint = f"127.0.0.1:{free_port()}"  # c10d: the first node hosts the store
    return [sys.executable, "-m", "torch.distributed.run", *COMMON, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, SCRIPT, "0", *WIDTH]  # fmt: skip


def elastic_cmd(etcd: str, run_id: str) -> list[str]:
    return [sys.executable, "-m", "elastic", *COMMON, "--rdzv-endpoint", etcd,
            "--rdzv-id", run_id, SCRIPT, "0", *WIDTH]  # fmt: skip


def state_cmd(etcd: str, run_id: str) -> list[str]:
    return [*elastic_cmd(etcd, run_id), "--live"]


AB = 100  # steps per phase of the paired run: 0.2-0.4 s here, shorter than a slow spell


def ab_cmd(etcd: str, run_id: str) -> list[str]:
    return [*state_cmd(etcd, run_id), "--ab", str(AB)]


class Measured(NamedTuple):
    """One run: the median seconds between a rank's consecutive steps; for the paired
    run, the mean step with ``commit()`` over the mean step without it, from the phases
    of one run (a slow spell of the machine slows both alike); the agents' CPU, in
    cores, over the same time."""

    step: float
    paired: float
    paired_median: float  # ... the same of the phases' median steps
    added: float  # seconds: the paired run's mean step with State less the one without
    agents: float


def _cpu(p: psutil.Process) -> float:
    """Seconds of CPU ``p`` itself used (its children aside)."""
    try:
        t = p.cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def step_time(make: Callable[[str, str], list[str]], etcd: str, work: Path, a: Any) -> Measured:
    """One run of ``make``'s launcher, measured after the warm-up (see ``Measured``)."""
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
        time.sleep(max(0.0, started + a.warmup - time.time()))
        agents = [psutil.Process(n.proc.pid) for n in nodes]
        cpu0, t0 = sum(_cpu(p) for p in agents), time.monotonic()
        time.sleep(a.seconds)
        agent_cores = (sum(_cpu(p) for p in agents) - cpu0) / (time.monotonic() - t0)
    finally:
        for n in nodes:
            n.stop()
    gaps: list[float] = []
    phases: dict[bool, list[float]] = {True: [], False: []}  # plain: the gaps of a phase
    for rank in (0, 1):
        mine = [s for s in steps(results) if s["rank"] == rank and s["t"] > started + a.warmup]
        gaps += [b["t"] - x["t"] for x, b in itertools.pairwise(mine)]
        for x, b in itertools.pairwise(mine):  # a gap ends with the commit() of its start
            if x.get("plain") == b.get("plain"):
                phases[bool(x.get("plain"))].append(b["t"] - x["t"])
    if len(gaps) < 10:
        raise RuntimeError(f"only {len(gaps)} steps measured; see {work}")
    paired = paired_median = added = 0.0
    if phases[True] and phases[False]:
        with_state, without = statistics.mean(phases[False]), statistics.mean(phases[True])
        paired, added = with_state / without, with_state - without
        paired_median = statistics.median(phases[False]) / statistics.median(phases[True])
    return Measured(statistics.median(gaps), paired, paired_median, added, agent_cores)


PAIRED = "State / plain DDP, by turns"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured, per run")
    ap.add_argument("--warmup", type=float, default=3.0, help="left out, per run")
    ap.add_argument("--width", type=int, default=0, help="four Linear(N, N) layers (0: tiny)")
    a = ap.parse_args()
    if a.width < 0:
        ap.error("--width must be 0 or more")
    WIDTH[:] = ["--width", str(a.width)] if a.width else []
    model = f"four Linear({a.width}, {a.width}) layers" if a.width else "a tiny Linear(32, 1)"
    kinds: dict[str, Callable[[str, str], list[str]]] = {
        "torchrun": torchrun_cmd,
        "elastic-run": elastic_cmd,
        "elastic-run, State + commit()": state_cmd,
        PAIRED: ab_cmd,
    }
    base = Path(tempfile.mkdtemp(prefix="elastic-run-steady-"))
    runs: dict[str, list[Measured]] = {k: [] for k in kinds}
    with EtcdServer(name="bench") as etcd:
        for i in range(a.repeat):
            for k, make in kinds.items():
                runs[k].append(step_time(make, etcd.endpoint, base / f"{make.__name__}{i}", a))
            print(
                f"run {i + 1}: "
                + ", ".join(f"{k} {v[-1].step * 1e3:.2f} ms" for k, v in runs.items())
            )
    med = {k: statistics.median(m.step for m in v) for k, v in runs.items()}
    print(f"\nmedian step time of a DDP step of {model} on 2 nodes (1 worker each), no pause")
    print(f"{'':<32}{'step':>10}{'/ torchrun':>12}{'/ elastic-run':>15}   runs (ms)")
    for k, v in runs.items():
        each = " ".join(f"{m.step * 1e3:.2f}" for m in v)
        print(
            f"{k:<32}{med[k] * 1e3:>8.2f}ms{med[k] / med['torchrun']:>11.2f}x"
            f"{med[k] / med['elastic-run']:>14.2f}x   {each}"
        )
    ratios = [m.paired for m in runs[PAIRED]]
    medians = [m.paired_median for m in runs[PAIRED]]
    print(
        f"\nin one run, {AB} steps under State (comm hook and commit()) and {AB} of a twin "
        f"model in a plain DDP in turn: the step with State is "
        f"{statistics.median(ratios):.3f}x the plain step (mean over the phases; runs: "
        f"{' '.join(f'{x:.3f}' for x in ratios)}): "
        f"{statistics.median(m.added for m in runs[PAIRED]) * 1e6:.0f} us more a step; "
        f"{statistics.median(medians):.3f}x by the phases' median steps (runs: "
        f"{' '.join(f'{x:.3f}' for x in medians)})"
    )
    print("\nthe two agents' CPU meanwhile, in cores (median of the runs)")
    for k, v in runs.items():
        print(f"{k:<32}{statistics.median(m.agents for m in v):>10.3f}")
    print(f"(logs under {base})")


if __name__ == "__main__":
    main()
