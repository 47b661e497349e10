"""A framework's script through a node SIGKILL: to the first resumed step, and steps redone.

Two "nodes" (launcher and one worker each, process trees on this machine) train the same
Lightning DDP script (``tests/scripts/lightning_train.py``: a tiny model, gloo, Lightning's
own ModelCheckpoint every 20 steps, which the script resumes from), under stock torchrun
(c10d, --max-restarts 3), under elastic-run without the adapter, and under elastic-run with
``ElasticLightning()``. Once both train, node b (not torchrun's store host) is SIGKILLed,
launcher and worker together, and a trains on alone. Printed per launcher: the seconds
from the kill to the first step at world size 1 (and the ratio to torchrun's), and the
optimizer steps trained again (the last step at world size 2 + 1 - the first at 1).
Target: with the adapter, steps redone <= 1 beyond the snapshot interval it chose; the
first resumed step at least 5x sooner than under torchrun.

    python benchmarks/frameworks.py [--repeat 1] [--timeout 180]
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

from benchmarks._nodes import Node, first_step, steps
from elastic.agent.etcd_server import EtcdServer
from rendezvous.net import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "lightning_train.py")
ARGS = ["--samples", "8000", "--epochs", "1", "--step-time", "0.03", "--checkpoint-every", "20"]
COMMON = ["--nnodes", "1:2", "--nproc-per-node", "1", "--local-addr", "127.0.0.1"]


def torchrun_cmd(endpoint: str, run_id: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *COMMON, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "3",
            SCRIPT, *ARGS]  # fmt: skip


def elastic_cmd(endpoint: str, run_id: str, *script_args: str) -> list[str]:
    return [sys.executable, "-m", "elastic", *COMMON, "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--max-restarts", "3", SCRIPT, *ARGS, *script_args]  # fmt: skip


def adapter_cmd(endpoint: str, run_id: str) -> list[str]:
    return elastic_cmd(endpoint, run_id, "--adapter")


def measure(
    make: Callable[[str, str], list[str]], endpoint: str, work: Path, timeout: float
) -> tuple[float | None, int | None]:
    """(seconds from the kill to the first step at world size 1, steps trained again)."""
    results = work / "steps"
    results.mkdir(parents=True)
    nodes: list[Node] = []
    try:
        for i in range(2):
            cmd = make(endpoint, work.name)
            nodes.append(Node(cmd, {"RESULT_DIR": str(results)}, work / f"node{i}.log"))
            time.sleep(1.0 if i == 0 else 0.0)  # node 0 first: it hosts torchrun's store
        if first_step(results, 2, 0, 180) is None:
            raise RuntimeError(f"the job never trained at world size 2; see {work}")
        time.sleep(3.0)  # past Lightning's first checkpoint (step 20)
        at = time.time()
        nodes[1].kill()
        resumed = first_step(results, 1, at, timeout)
        if resumed is None:
            return None, None
        history = steps(results)
        last = max(s["step"] for s in history if s["world"] == 2)
        first = min(s["step"] for s in history if s["world"] == 1)
        return resumed - at, last + 1 - first
    finally:
        for n in nodes:
            n.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=180.0)
    a = ap.parse_args()
    kinds = {
        "torchrun, Lightning's ckpt": torchrun_cmd,
        "elastic-run, Lightning's ckpt": elastic_cmd,
        "elastic-run + ElasticLightning": adapter_cmd,
    }
    seconds: dict[str, list[float | None]] = {k: [] for k in kinds}
    redone: dict[str, list[int | None]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="frameworks-") as tmp, EtcdServer() as etcd:
        for r in range(a.repeat):
            for i, (name, make) in enumerate(kinds.items()):
                endpoint = f"127.0.0.1:{free_port()}" if make is torchrun_cmd else etcd.endpoint
                s, n = measure(make, endpoint, Path(tmp) / f"r{r}-{i}", a.timeout)
                seconds[name].append(s)
                redone[name].append(n)
                print(
                    f"  {name}: {s if s is None else round(s, 2)} s, {n} step(s) redone", flush=True
                )

    def median(v: list[float | None]) -> float:
        return statistics.median(x if x is not None else a.timeout for x in v)

    base = median(seconds["torchrun, Lightning's ckpt"])
    print("\nLightning DDP, node SIGKILL of 1 of 2 (1 worker each)")
    print(f"{'':<34}{'to resume':>10}{'vs torchrun':>13}{'redone':>9}   runs (s / steps)")
    for name in kinds:
        runs = " ".join(
            f"{s:.2f}/{n}" if s is not None else f">{a.timeout:.0f}"
            for s, n in zip(seconds[name], redone[name], strict=True)
        )
        done = [n for n in redone[name] if n is not None]
        steps_redone = f"{statistics.median(done):g}" if done else "-"
        print(f"{name:<34}{median(seconds[name]):>9.2f}s{base / median(seconds[name]):>12.1f}x"
              f"{steps_redone:>9}   {runs}")  # fmt: skip


if __name__ == "__main__":
    main()
