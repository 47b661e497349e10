"""A framework's live job through two kills in quick succession: the second lands while
the survivors re-form for the first, or build their next Trainer (or Accelerator).

Three "nodes" (launcher and one worker each) train a framework's script with its adapter
live (``ElasticLightning.run``, ``ElasticCallback.run``, ``State.run`` with
``round_accelerator``): c is SIGKILLed; ``--delay`` seconds after b's agent acts on that
loss, a (the leader, rank 0) is SIGKILLed too, and b trains on alone. Printed per
framework and delay: the seconds from the first kill to b's first step alone, whether b's
worker kept its process, and whether b's agent stopped workers or charged a restart (it
must do neither: a loss is no failure of b's).

    python benchmarks/frameworks_two_kills.py [--framework all] [--delays 0,0.3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._nodes import Node, first_step, steps
from elastic.agent.etcd_server import EtcdServer

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {  # name: (the script, its arguments beyond the common ones)
    "lightning": ("lightning_train.py", ()),
    "transformers": ("hf_train.py", ("--accumulate", "2")),
    "accelerate": ("accelerate_train.py", ("--accumulate", "2")),
}
ARGS = ("--adapter", "--live", "--samples", "480", "--epochs", "2", "--step-time", "0.1")
TIMEOUT = 180.0


def run(framework: str, delay: float, etcd: EtcdServer, work: Path) -> str:
    script, extra = SCRIPTS[framework]
    results = work / "steps"
    results.mkdir(parents=True)
    nodes: dict[str, Node] = {}

    def log(name: str) -> str:
        return (work / f"{name}.log").read_text(errors="replace")

    def wait(what: str, done: Callable[[], bool], timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not within {timeout:.0f}s; see {work}")
            time.sleep(0.02)

    try:
        for name in "abc":  # a registers first: it leads, and is rank 0
            cmd = [sys.executable, "-m", "elastic", "--nnodes", "1:3", "--nproc-per-node", "1",
                   "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", work.name, "--rdzv-conf",
                   "lease_ttl=3,last_call_timeout=1", "--node-id", name, "--local-addr",
                   "127.0.0.1", "--max-restarts", "3", "--snapshot-every", "1000",
                   str(ROOT / "tests" / "scripts" / script), *ARGS, *extra]  # fmt: skip
            env = {"RESULT_DIR": str(results), "PYTHONPATH": str(ROOT / "tests" / "scripts")}
            nodes[name] = Node(cmd, env, work / f"{name}.log")
            wait(f"{name} registered", lambda n=name: f"registered as {n}" in log(n))
        if first_step(results, 3, 0, TIMEOUT) is None:
            raise RuntimeError(f"the job never trained at world size 3; see {work}")
        time.sleep(1.0)
        kept = {s["pid"] for s in steps(results) if s["world"] == 3}
        at = time.time()
        nodes["c"].kill()
        wait("b acting on c's loss", lambda: "lost c: " in log("b"))
        time.sleep(delay)
        nodes["a"].kill()
        alone = first_step(results, 1, at, TIMEOUT)
        if alone is None:
            return f"b never trained alone; see {work}"
        pids = {s["pid"] for s in steps(results) if s["world"] == 1}
        said = log("b")
        stopped = "stopping workers" in said or "after a worker failure" in said
        return (
            f"b alone {alone - at:.2f}s after the first kill; its worker kept: {pids <= kept}; "
            f"workers stopped or a restart charged: {stopped}"
        )
    finally:
        for n in nodes.values():
            n.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=[*SCRIPTS, "all"], default="all")
    ap.add_argument("--delays", default="0,0.3", help="seconds between the kills, comma-separated")
    a = ap.parse_args()
    frameworks = list(SCRIPTS) if a.framework == "all" else [a.framework]
    tmp = Path(tempfile.mkdtemp(prefix="elastic-run-two-kills-"))
    with EtcdServer(name="two-kills") as etcd:
        for framework in frameworks:
            for delay in (float(d) for d in a.delays.split(",")):
                work = tmp / f"{framework}-{delay:g}"
                print(f"{framework}, second kill {delay:g}s after b acts on the first: "
                      f"{run(framework, delay, etcd, work)}", flush=True)  # fmt: skip
    print(f"(logs under {tmp})")


if __name__ == "__main__":
    main()
