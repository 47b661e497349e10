"""A framework's script through a node SIGKILL: to the first resumed step, and steps redone.

Two "nodes" (launcher and one worker each, process trees on this machine) train the same
script written for torchrun: Lightning DDP (``tests/scripts/lightning_train.py``), the
Hugging Face Trainer (``tests/scripts/hf_train.py``) and an accelerate loop
(``tests/scripts/accelerate_train.py``), each a tiny model on gloo with the framework's
own checkpoints every 20 steps (``save_state`` for accelerate), which the script resumes
from. Each runs under stock torchrun (c10d, --max-restarts 3), under elastic-run without
the adapter, and under elastic-run with it (``ElasticLightning()``,
``ElasticCallback.attach(trainer)``, ``ElasticLoader``), and with it live, keeping the
workers (``ElasticLightning.run(fit)``, ``ElasticCallback.run(make)``: a new Trainer in
them; ``State.run`` with ``round_accelerator``: a new Accelerator). Lightning's
ModelParallelStrategy (FSDP2, ``--framework lightning-fsdp2``) runs the same script
sharded: its own checkpoints are DCP directories, the adapter's snapshots DCP checkpoints
of the shards in ``--checkpoint-dir`` (live, copies in memory too: the survivor's next
Trainer re-shards the newest step memory holds whole); its FSDPStrategy (FSDP1,
``--framework lightning-fsdp1``; on the CPU the test script's ``CPUFSDP``) gets the same
DCP snapshots, and no live row: memory cannot re-shard FSDP1. Once
both nodes train, node b (not torchrun's store host) is SIGKILLed,
launcher and worker together, and a trains on alone. Printed per launcher: the seconds
from the kill to the first step at world size 1 (and the ratio to torchrun's), and the
optimizer steps trained again (the last step at world size 2 + 1 - the first at 1).
Target: with the adapter, steps redone <= 1 beyond the snapshot interval it chose; the
first resumed step at least 5x sooner than under torchrun.

    python benchmarks/frameworks.py [--framework all] [--repeat 1] [--timeout 180]
"""

from __future__ import annotations

import argparse
import functools
import re
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
FRAMEWORKS = {  # name: (what the table calls it, the script, the adapter, its arguments)
    "lightning": ("Lightning DDP", "lightning_train.py", "ElasticLightning", ()),
    "transformers": ("HF Trainer", "hf_train.py", "ElasticCallback", ()),
    "accelerate": ("accelerate", "accelerate_train.py", "ElasticLoader", ()),
    "lightning-fsdp2": (
        "Lightning FSDP2", "lightning_train.py", "ElasticLightning",
        ("--strategy", "model_parallel"),
    ),
    "lightning-fsdp1": (
        "Lightning FSDP1", "lightning_train.py", "ElasticLightning", ("--strategy", "fsdp"),
    ),
}  # fmt: skip
SHARDED = {"lightning-fsdp2", "lightning-fsdp1"}  # snapshots to --checkpoint-dir
NOT_LIVE = {"lightning-fsdp1"}  # memory cannot re-shard FSDP1: a change gives new workers
ARGS = ["--samples", "8000", "--epochs", "1", "--step-time", "0.03", "--checkpoint-every", "20"]
COMMON = ["--nnodes", "1:2", "--nproc-per-node", "1", "--local-addr", "127.0.0.1"]


def torchrun_cmd(script: list[str], endpoint: str, run_id: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *COMMON, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "3",
            *script, *ARGS]  # fmt: skip


def elastic_cmd(
    script: list[str], endpoint: str, run_id: str, *script_args: str, flags: tuple[str, ...] = ()
) -> list[str]:
    return [sys.executable, "-m", "elastic", *COMMON, "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--max-restarts", "3", *flags, *script, *ARGS,
            *script_args]  # fmt: skip


def adapter_cmd(script: list[str], endpoint: str, run_id: str) -> list[str]:
    return elastic_cmd(script, endpoint, run_id, "--adapter")


def live_cmd(script: list[str], endpoint: str, run_id: str) -> list[str]:
    return elastic_cmd(script, endpoint, run_id, "--adapter", "--live")


def sharded_cmd(
    script: list[str], endpoint: str, run_id: str, snapshots: Path, live: bool = False
) -> list[str]:
    """The adapter's shard snapshots go to a directory both nodes read."""
    flags = ("--checkpoint-dir", str(snapshots / run_id))
    more = ("--live",) if live else ()
    return elastic_cmd(script, endpoint, run_id, "--adapter", *more, flags=flags)


# the scripts log elastic.state's choices with their time
SNAPSHOT_EVERY = re.compile(
    r"^(\d+\.\d+) elastic.state: snapshot every (\d+) step\(s\), at most (\d+) step", re.M
)


def chosen(work: Path, before: float) -> str:
    """The snapshot interval and the steps at risk in force at ``before``, or '-'."""
    found = sorted((float(t), n, risk) for f in work.glob("node*.log")
                   for t, n, risk in SNAPSHOT_EVERY.findall(f.read_text(errors="replace"))
                   if float(t) < before)  # fmt: skip
    return f"every {found[-1][1]}, <= {found[-1][2]} at risk" if found else "-"


def measure(
    make: Callable[[str, str], list[str]], endpoint: str, work: Path, timeout: float
) -> tuple[float | None, int | None, str]:
    """(seconds from the kill to the first step at world size 1, steps trained again, the
    snapshot interval in force at the kill)."""
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
        time.sleep(3.0)  # past the framework's first checkpoint (step 20)
        at = time.time()
        nodes[1].kill()
        resumed = first_step(results, 1, at, timeout)
        if resumed is None:
            return None, None, chosen(work, at)
        history = steps(results)
        last = max(s["step"] for s in history if s["world"] == 2)
        first = min(s["step"] for s in history if s["world"] == 1)
        return resumed - at, last + 1 - first, chosen(work, at)
    finally:
        for n in nodes:
            n.stop()


def bench(framework: str, repeat: int, timeout: float, etcd: EtcdServer, tmp: Path) -> None:
    title, script_name, adapter, args = FRAMEWORKS[framework]
    script = [str(ROOT / "tests" / "scripts" / script_name), *args]
    kinds: dict[str, Callable[[list[str], str, str], list[str]]] = {
        "torchrun, own ckpt": torchrun_cmd,
        "elastic-run, own ckpt": elastic_cmd,
        f"elastic-run + {adapter}": adapter_cmd,
        f"elastic-run + {adapter}, live": live_cmd,
    }
    if framework in SHARDED:
        kinds[f"elastic-run + {adapter}"] = functools.partial(sharded_cmd, snapshots=tmp)
        kinds[f"elastic-run + {adapter}, live"] = functools.partial(
            sharded_cmd, snapshots=tmp, live=True
        )
    if framework in NOT_LIVE:
        del kinds[f"elastic-run + {adapter}, live"]
    seconds: dict[str, list[float | None]] = {k: [] for k in kinds}
    redone: dict[str, list[int | None]] = {k: [] for k in kinds}
    for r in range(repeat):
        for i, (name, kind) in enumerate(kinds.items()):
            endpoint = f"127.0.0.1:{free_port()}" if kind is torchrun_cmd else etcd.endpoint
            make = functools.partial(kind, script)
            work = tmp / f"{framework}-r{r}-{i}"
            s, n, interval = measure(make, endpoint, work, timeout)
            seconds[name].append(s)
            redone[name].append(n)
            print(f"  {title}, {name}: {s if s is None else round(s, 2)} s, {n} step(s) redone;"
                  f" snapshots: {interval}", flush=True)  # fmt: skip

    def median(v: list[float | None]) -> float:
        return statistics.median(x if x is not None else timeout for x in v)

    base = median(seconds["torchrun, own ckpt"])
    print(f"\n{title}, node SIGKILL of 1 of 2 (1 worker each)")
    print(f"{'':<34}{'to resume':>10}{'vs torchrun':>13}{'redone':>9}   runs (s / steps)")
    for name in kinds:
        runs = " ".join(
            f"{s:.2f}/{n}" if s is not None else f">{timeout:.0f}"
            for s, n in zip(seconds[name], redone[name], strict=True)
        )
        done = [n for n in redone[name] if n is not None]
        steps_redone = f"{statistics.median(done):g}" if done else "-"
        print(f"{name:<34}{median(seconds[name]):>9.2f}s{base / median(seconds[name]):>12.1f}x"
              f"{steps_redone:>9}   {runs}")  # fmt: skip
    print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=[*FRAMEWORKS, "all"], default="all")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=180.0)
    a = ap.parse_args()
    frameworks = list(FRAMEWORKS) if a.framework == "all" else [a.framework]
    with tempfile.TemporaryDirectory(prefix="frameworks-") as tmp, EtcdServer() as etcd:
        for framework in frameworks:
            bench(framework, a.repeat, a.timeout, etcd, Path(tmp))


if __name__ == "__main__":
    main()
