"""Start elastic-run agents as separate processes ("nodes") and read what their workers did."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import psutil
from harness import ROOT, Proc

TRAIN_LOOP = ROOT / "tests" / "scripts" / "train_loop.py"
TTL = 3
FAST_CONF = f"lease_ttl={TTL},last_call_timeout=1"


def start_agent(
    procs: list[Proc],
    endpoint: str,
    run_id: str,
    node: str,
    script: Path,
    *script_args: str,
    nnodes: str = "1:3",
    nproc: int = 1,
    conf: str = FAST_CONF,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    local_addr: str = "127.0.0.1",
    prefix: tuple[str, ...] = (),
) -> Proc:
    """An agent as its own process; ``prefix`` runs it elsewhere (a network namespace)."""
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "elastic",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        conf,
        "--node-id",
        node,
        "--local-addr",
        local_addr,
        "--monitor-interval",
        "0.05",
        *extra,
        str(script),
        *script_args,
    ]
    p = Proc(cmd, env=env, name=node)
    procs.append(p)
    return p


def steps(result_dir: Path, tried: bool = False) -> list[dict]:
    """Every step every worker logged (train_loop.py's JSON lines), in time order; with
    ``tried``, instead, the steps elastic_train.py began to reduce (its "tried" rows)."""
    out = []
    for f in result_dir.glob("w*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):  # a line being written now
                    row = json.loads(line)
                    if row.get("tried", False) == tried:
                        out.append(row)
    return sorted(out, key=lambda s: s["t"])


def wait_world(
    result_dir: Path,
    world: int,
    after: float = 0.0,
    timeout: float = 60.0,
    ranks: int | None = None,
) -> float:
    """Time of the first step at ``world`` (after ``after``) once ``ranks`` ranks trained."""
    need = world if ranks is None else ranks
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = [s for s in steps(result_dir) if s["world"] == world and s["t"] > after]
        if len({s["rank"] for s in at}) >= need:
            return at[0]["t"]
        time.sleep(0.1)
    seen = sorted({(s["world"], s["rank"]) for s in steps(result_dir)})
    raise AssertionError(f"no training at world size {world} within {timeout}s; seen {seen}")


def worker_pids(agent: Proc) -> list[int]:
    """The agent's workers: its children, or with --start-method forkserver the fork
    server's children; never the embedded etcd, the store helper or the fork server."""
    pids = []
    try:
        for c in psutil.Process(agent.pid).children():
            line = " ".join(c.cmdline())
            if "elastic.agent.zygote" in line:
                pids.extend(w.pid for w in c.children())
            elif "etcd" not in line and "elastic.agent.store_server" not in line:
                pids.append(c.pid)
    except psutil.NoSuchProcess:
        pass
    return pids


def wait_workers(agent: Proc, n: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = worker_pids(agent)
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    raise AssertionError(
        f"{agent.name}: {n} workers not started within {timeout}s\n{agent.transcript()}"
    )


def gone(pids: list[int]) -> bool:
    """True once none of ``pids`` runs (zombies awaiting their reaper count as gone)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def kept_steps(history: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """Per (epoch, step), the rows of the last round that ran it: earlier runs of the step
    were rolled back by a restore. Rounds are told apart by their fresh master port."""
    order = sorted(
        {r["port"] for r in history}, key=lambda p: min(r["t"] for r in history if r["port"] == p)
    )
    by_step: dict[tuple[int, int], dict[int, list[dict]]] = {}
    for r in history:
        by_step.setdefault((r["epoch"], r["step"]), {}).setdefault(
            order.index(r["port"]), []
        ).append(r)
    return {k: v[max(v)] for k, v in by_step.items()}


def samples_once(
    history: list[dict], samples: int, epochs: int, tried: list[dict] | None = None
) -> None:
    """Every sample of every epoch was trained on exactly once in the kept steps. A rank
    whose row of a kept step is missing (a peer was lost as the step's reduction ended:
    the others' reduction had its samples, its own failed) is read from ``tried``."""
    kept = kept_steps(history)
    for (epoch, step), rows in kept.items():
        port, ranks = rows[0]["port"], {r["rank"] for r in rows}
        rows.extend(
            r
            for r in tried or []
            if (r["epoch"], r["step"], r["port"]) == (epoch, step, port)
            and r["rank"] not in ranks
            and r["rank"] < rows[0]["world"]
        )
    for epoch in range(epochs):
        used = sorted(
            i for (e, _), rows in kept.items() if e == epoch for r in rows for i in r["indices"]
        )
        assert used == list(range(samples)), f"epoch {epoch}: {len(used)} of {samples}"


def full_speed(result_dir: Path) -> None:
    """What the test waited for came while its job trained slowly (the scripts'
    ``--slow-below-world``, there so that a join or a start lands inside the job however
    slow the machine): the rest of the job trains at full speed."""
    (result_dir / "full-speed").touch()
