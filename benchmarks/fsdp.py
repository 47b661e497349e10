"""An FSDP2 job through a node SIGKILL: kept live (re-sharded in memory) or respawned
(new workers load the DCP checkpoint), side by side.

Two "nodes" (launcher and workers, process trees on this machine) train
``tests/scripts/fsdp_train.py`` (a tiny FSDP2 model on gloo, ``--snapshot-every 5``,
``--checkpoint-dir`` shared) under elastic-run, with ``--live`` (``State.run(train,
reshard=shard)``) and without it under ``--restart-mode respawn`` (what sharded state
always did before). Once both nodes train, node b is SIGKILLed, launcher and workers
together. Printed: the seconds from the kill to the first step at the smaller world size
(and the ratio to respawn's), the optimizer steps trained again, and whether a's
workers kept their processes. (Stock torchrun is not a column: the script's ``State``
needs elastic-run's checkpoint directory; ``benchmarks/frameworks.py`` has torchrun.)

    python benchmarks/fsdp.py [--nproc 1] [--repeat 3] [--timeout 120]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._nodes import Node, first_step, steps
from elastic.agent.etcd_server import EtcdServer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "fsdp_train.py")
KINDS = {  # name: (elastic-run flags, script flags)
    "respawn (DCP)": (["--restart-mode", "respawn"], []),
    "live (in memory)": ([], ["--live"]),
}


def first_trained(results: Path, world: int, after: float, timeout: float) -> float | None:
    """Wall time of the first optimizer step at ``world`` after ``after`` (the script's
    "restored" rows come before it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = [s for s in steps(results) if s["world"] == world and s["t"] > after]
        done = [s["t"] for s in at if s["event"] == "step"]
        if done:
            return min(done)
        time.sleep(0.05)
    return None


def measure(
    kind: str, nproc: int, etcd: EtcdServer, work: Path, timeout: float
) -> tuple[float | None, int | None, bool]:
    flags, script_flags = KINDS[kind]
    results = work / "steps"
    results.mkdir(parents=True)
    cmd = [sys.executable, "-m", "elastic", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
           "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", work.name, "--local-addr", "127.0.0.1",
           "--checkpoint-dir", str(work / "ckpt"), "--snapshot-every", "5", "--max-restarts", "3",
           *flags, SCRIPT, "--steps", "100000", "--step-time", "0.05", *script_flags]  # fmt: skip
    nodes: list[Node] = []
    try:
        for i in range(2):
            nodes.append(Node(cmd, {"RESULT_DIR": str(results)}, work / f"node{i}.log"))
            time.sleep(1.0 if i == 0 else 0.0)
        if first_step(results, 2 * nproc, 0, 120) is None:
            raise RuntimeError(f"the job never trained at world size {2 * nproc}; see {work}")
        time.sleep(3.0)
        before = {s["pid"] for s in steps(results) if s["world"] == 2 * nproc}
        at = time.time()
        nodes[1].kill()
        resumed = first_trained(results, nproc, at, timeout)
        if resumed is None:
            return None, None, False
        history = [s for s in steps(results) if s["event"] == "step"]
        last = max(s["step"] for s in history if s["t"] < at)
        first = min(s["step"] for s in history if s["t"] > at)
        after = {s["pid"] for s in history if s["t"] > at}
        return resumed - at, last + 1 - first, after <= before
    finally:
        for n in nodes:
            n.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=1, help="workers per node")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    redone: dict[str, list[int]] = {k: [] for k in KINDS}
    kept: dict[str, list[bool]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="fsdp-") as tmp, EtcdServer() as etcd:
        for r in range(a.repeat):
            for i, kind in enumerate(KINDS):  # interleaved: the machine's drift hits both
                s, n, same = measure(kind, a.nproc, etcd, Path(tmp) / f"r{r}-{i}", a.timeout)
                seconds[kind].append(s if s is not None else a.timeout)
                redone[kind].append(n if n is not None else -1)
                kept[kind].append(same)
                print(f"  {kind}: {s if s is None else round(s, 2)} s, {n} step(s) redone, "
                      f"processes kept: {same}", flush=True)  # fmt: skip
    base = statistics.median(seconds["respawn (DCP)"])
    print(f"\nFSDP2, node SIGKILL of 1 of 2 ({a.nproc} worker(s) each), medians of {a.repeat}")
    print(f"{'':<20}{'to resume':>10}{'vs respawn':>12}{'redone':>8}  kept   runs (s)")
    for kind in KINDS:
        med = statistics.median(seconds[kind])
        runs = " ".join(f"{s:.2f}" for s in seconds[kind])
        print(f"{kind:<20}{med:>9.2f}s{base / med:>11.1f}x{statistics.median(redone[kind]):>8g}"
              f"  {all(kept[kind])!s:<6} {runs}")  # fmt: skip


if __name__ == "__main__":
    main()
