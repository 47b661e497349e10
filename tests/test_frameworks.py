"""The three framework adapters side by side under real agents, scripts written for
torchrun plus the adapter, each job on its own run id of one etcd and all at once (most
of each run is start-up, which overlaps): a worker killed mid-epoch resumes bitwise as
the script without the adapter and without a fault; a node lost mid-epoch leaves the rest
of the epoch to the survivor with no sample lost or repeated; every framework example
runs to the end on CPU. The rules have fast tests of their own (test_lightning_sampler,
test_loader_position, test_accelerate).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from agents import full_speed, samples_once, start_agent, steps, wait_world, worker_pids
from conftest import need
from harness import ROOT, Proc, wait_until
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from elastic.agent.etcd_server import EtcdServer
from elastic.worker.sharded import complete_steps

pytestmark = pytest.mark.slow
T = TypeVar("T")
# workers forked from a process that imported torch already: each start (six a framework
# in the bitwise test) skips that import
FORK = ("--start-method", "forkserver")
SCRIPTS = ROOT / "tests" / "scripts"
# framework: (its test script, the script's arguments)
LIVE = {"lightning", "transformers", "accelerate"}  # run with --live: workers kept
JOBS = {
    "lightning": ("lightning_train.py", ()),
    "transformers": ("hf_train.py", ("--accumulate", "2")),
    "accelerate": ("accelerate_train.py", ("--accumulate", "2")),
}


@pytest.fixture(autouse=True)
def _frameworks() -> None:
    for name in JOBS:
        if importlib.util.find_spec(name) is None:
            need(False, f"{name} is not installed (pip install -e '.[test]')")


def at_once(fn: Callable[[str], T], names: Iterable[str]) -> dict[str, T]:
    names = list(names)
    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(fn, names), strict=True))


def start_pair(
    procs: list[Proc],
    endpoint: str,
    run_id: str,
    result: Path,
    job: tuple[str | Path, ...],
    kill: tuple[str, ...],
    nproc: int,
) -> tuple[Proc, Proc]:
    """The same job twice, each on a run id of its own: as written ("plain") and with
    ``kill`` (the adapter, and a rank that kills itself once), which may restart once."""
    for kind in ("plain", "kill"):
        (result / kind).mkdir(parents=True)
    plain = start_agent(
        procs, endpoint, f"{run_id}-plain", "a", *job, nproc=nproc,
        env={"RESULT_DIR": str(result / "plain")}, extra=FORK,
    )  # fmt: skip
    killed = start_agent(
        procs, endpoint, f"{run_id}-kill", "b", *job, *kill, nproc=nproc,
        env={"RESULT_DIR": str(result / "kill")},
        extra=("--snapshot-every", "3", "--max-restarts", "1", *FORK),
    )  # fmt: skip
    return plain, killed


def same_as_plain(result: Path, name: str, last_step: int) -> None:
    """The killed run trained the plain run's samples to its losses (the redone step
    included) and ended, at ``last_step``, with exactly its weights and optimizer state."""

    def key(r: dict) -> tuple[int, int, int]:  # Lightning logs each batch, the others a step
        return r["epoch"], r.get("batch", r["step"]), r["rank"]

    ref = {key(r): r for r in steps(result / "plain")}
    for r in steps(result / "kill"):
        same = ref[key(r)]
        assert (r["step"], r["indices"], r["loss"]) == (
            same["step"], same["indices"], same["loss"]
        ), (name, r, same)  # fmt: skip
    want, got = (torch.load(result / d / "final.pt", map_location="cpu") for d in ("plain", "kill"))
    assert want["step"] == got["step"] == last_step, name
    for k, v in want["model"].items():
        assert torch.equal(v, got["model"][k]), (name, k)
    for p, s in want["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, got["optimizer"]["state"][p][k]), (name, p, k)


@pytest.mark.slow
def test_a_killed_worker_resumes_bitwise_as_the_script_without_the_adapter(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Lightning and the Trainer, mid-epoch, at the same world size, with gradient
    accumulation and dropout: the adapter's run, killed at step 7 and resumed from the
    snapshot of step 6, trains exactly the samples and ends with exactly the weights and
    optimizer state of the same script without the adapter and without a fault."""
    args = ("--samples", "192", "--accumulate", "2")  # 12 optimizer steps an epoch
    kill = ("--adapter", "--kill-rank", "1", "--kill-step", "7")
    # accelerate's same-world resume is its order replayed (test_accelerate) and State's
    # own (test_state_e2e): CI's time goes to the two whose adapters resume their loops
    agents = {}
    for name in ("lightning", "transformers"):
        job = (SCRIPTS / JOBS[name][0], *args)
        result = tmp_path / name
        agents[name] = start_pair(procs, etcd.endpoint, f"{run_id}-{name}", result, job, kill, 2)
    for name, (plain, killed) in agents.items():
        for agent in (plain, killed):
            assert agent.wait(300) == 0, f"{name}: {agent.transcript()}"
        assert any("signal SIGKILL" in line for line in killed.err), name
        assert any("resumes from step 6" in line for line in killed.err), killed.transcript()
        same_as_plain(tmp_path / name, name, last_step=24)


@pytest.mark.slow
def test_a_node_lost_mid_epoch_resizes_without_losing_or_repeating_a_sample(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Per framework, two nodes of one worker; b is SIGKILLed mid-epoch and a trains on
    alone: every sample of both epochs once in the kept steps, each kept live
    (``ElasticLightning.run``, ``ElasticCallback.run``, ``State.run`` with
    ``round_accelerator``): a's worker keeps its process, a new Trainer or Accelerator in
    it. Steps redone: only the step in flight, since the survivor's own state is taken
    from memory (no snapshot is due in the whole run). (The bitwise test above takes the
    respawn path.)"""
    # long enough that a trains a while with b, however late b's workers start
    common = ("--adapter", "--samples", "192", "--epochs", "2", "--step-time", "0.05")
    agents: dict[str, tuple[Proc, Proc]] = {}
    for name, (script, args) in JOBS.items():
        out = tmp_path / name
        out.mkdir()
        live = ("--live",) if name in LIVE else ()
        job = (SCRIPTS / script, *common, *args, *live)
        env = {"RESULT_DIR": str(out)}
        kw = {"nnodes": "1:2", "nproc": 1, "extra": ("--snapshot-every", "1000")}
        a = start_agent(procs, etcd.endpoint, f"{run_id}-{name}", "a", *job, env=env, **kw)  # type: ignore[arg-type]
        a.wait_output("registered as a", timeout=60)
        b = start_agent(procs, etcd.endpoint, f"{run_id}-{name}", "b", *job, env=env, **kw)  # type: ignore[arg-type]
        agents[name] = (a, b)

    kept: dict[str, list[int]] = {}

    def lose_b(name: str) -> None:  # per job, as soon as it trains: they run at once
        wait_world(tmp_path / name, 2, timeout=180)
        kept[name] = worker_pids(agents[name][0])
        time.sleep(0.6)  # a few steps into the epoch
        killed = time.time()
        agents[name][1].signal(signal.SIGKILL)
        wait_world(tmp_path / name, 1, after=killed, timeout=90)

    at_once(lose_b, agents)
    for name, (a, _) in agents.items():
        assert a.wait(240) == 0, f"{name}: {a.transcript()}"
        history = steps(tmp_path / name)
        if name in LIVE:
            assert {r["pid"] for r in history if r["world"] == 1} == set(kept[name])
            assert "workers re-form live" in a.transcript()
        assert sorted({r["world"] for r in history}) == [1, 2], name
        samples_once(history, 192, 2)
        before = max(r["step"] for r in history if r["world"] == 2)
        after = min(r["step"] for r in history if r["world"] == 1)
        assert 0 <= before + 1 - after <= 1, (name, before, after)


def sharded_job(
    etcd: EtcdServer,
    run_id: str,
    procs: list[Proc],
    out: Path,
    *args: str,
    nodes: str = "ab",
    extra: tuple[str, ...] = (),
    strategy: str = "model_parallel",
) -> tuple[Callable[[str], Proc], dict[str, Proc], set[int]]:
    """Lightning's ModelParallelStrategy (FSDP2; ``strategy="fsdp"``: FSDPStrategy, FSDP1)
    job of the test script (``args`` added) on ``nodes`` of one worker each, snapshots
    every 4 steps to ``out``'s sibling ``snap`` (``extra`` flags too), until all train
    and a few snapshots are taken. Returns what starts another node of the job, the
    nodes, and a's worker pids."""
    out.mkdir(parents=True)
    job = (
        SCRIPTS / "lightning_train.py", "--strategy", strategy, "--samples", "192",
        "--step-time", "0.05", *args,
    )  # fmt: skip
    snap = ("--checkpoint-dir", str(out.parent / "snap"), "--snapshot-every", "4")
    env = {"RESULT_DIR": str(out)}
    nnodes = f"1:{len(nodes)}"

    def node(name: str) -> Proc:
        return start_agent(
            procs, etcd.endpoint, run_id, name, *job, nnodes=nnodes, env=env, extra=(*snap, *extra)
        )

    started = {"a": node("a")}
    started["a"].wait_output("registered as a", timeout=60)
    started.update((n, node(n)) for n in nodes[1:])
    wait_world(out, len(nodes), timeout=180)
    first = min(r["step"] for r in steps(out) if r["world"] == len(nodes))
    wait_until(  # a whole snapshot at full size (a fixed sleep missed it under CI's load)
        lambda: any(s >= first for s in complete_steps(out.parent / "snap")),
        60,
        f"a complete DCP snapshot at world size {len(nodes)}",
    )
    return node, started, set(worker_pids(started["a"]))


def said_if_redone(said: str, last_logged: int, resumed: int) -> None:
    """Where committed steps are trained again, the agent says so, truly: the script logs
    a step as it begins, so the last one logged before the fault (``last_logged``) may
    have been in flight, and its redo is no commit's (then the agent rightly says
    nothing)."""
    if last_logged > resumed + 1:
        assert f"resumes from step {resumed}, " in said, said


def start_of(out: Path, step: int) -> dict:
    """The whole state a resumed Trainer started from at ``step`` (``--dump-start``)."""
    return torch.load(out / f"start-{step}.pt", weights_only=False)


def snapshot_of(snap: Path, step: int, scratch: Path) -> dict:
    """The DCP snapshot of ``step`` in ``snap``, read whole."""
    saved = scratch / f"saved-{step}.pt"
    dcp_to_torch_save(snap / f"dcp-step-{step:012d}", saved)
    return torch.load(saved, weights_only=False)


def same_state(started: dict, snap: dict, step: int) -> None:
    """A resumed Trainer's model and Adam's moments are the snapshot's, exactly."""
    assert started["model"].keys() == snap["model/model"].keys()
    for k, v in started["model"].items():
        assert torch.equal(v, snap["model/model"][k]), (step, k)
    for p, moments in started["optim"]["state"].items():
        for k, v in moments.items():
            theirs = snap["optim/model"]["state"][p][k]
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(theirs)), (step, p, k)


@pytest.mark.slow
def test_lightning_sharded_resumes_its_shards_from_a_snapshot_over_the_new_world(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Lightning's two sharded strategies, each on two nodes of one worker, with
    ``--checkpoint-dir`` and Lightning's own checkpoints too rare to matter, side by
    side: ModelParallelStrategy (FSDP2) and FSDPStrategy (FSDP1, on the CPU as
    ``CPUFSDP``); b is SIGKILLed mid-epoch. a's new worker resumes from the newest DCP
    snapshot of the shards (every 4 steps), re-sharded from world 2 to 1, at the exact
    sample: every sample of both epochs once in the kept steps, at most the interval and
    the step in flight trained again (was: the adapter stood aside, and a began again
    from step 0). Both through ``run(fit)``, where neither keeps the workers, and the log
    says why: FSDP2's module is made once, before it (a sharded module cannot be cut
    again over a new group), and FSDP1's shards cannot be re-sharded in memory."""
    why = {
        "model_parallel": "the LightningModule was made before run(), or fit() keeps it",
        "fsdp": "FSDP1's flat shards cannot be re-sharded in memory",
    }
    more = {"model_parallel": ("--module-once",), "fsdp": ()}

    def lose_b(strategy: str) -> tuple[Proc, set[int]]:
        out = tmp_path / strategy / "out"
        args = ("--live", "--epochs", "2", *more[strategy])
        _, nodes, first = sharded_job(
            etcd, f"{run_id}-{strategy}", procs, out, *args, strategy=strategy
        )
        killed = time.time()
        nodes["b"].signal(signal.SIGKILL)
        wait_world(out, 1, after=killed, timeout=90)
        return nodes["a"], first

    for strategy, (a, first) in at_once(lose_b, why).items():
        out = tmp_path / strategy / "out"
        assert a.wait(240) == 0, a.transcript()
        said = a.transcript()
        assert why[strategy] in said, said
        history = steps(out)
        assert not first & {r["pid"] for r in history if r["world"] == 1}, strategy  # new
        samples_once(history, 192, 2)
        before = max(r["step"] for r in history if r["world"] == 2)
        after = min(r["step"] for r in history if r["world"] == 1)
        assert after - 1 > 0 and (after - 1) % 4 == 0, (strategy, before, after)  # a snapshot
        assert 0 <= before + 1 - after <= 4 + 1, (strategy, before, after)
        said_if_redone(said, before, after - 1)
        snaps = sorted(p.name for p in (tmp_path / strategy / "snap").iterdir())
        assert snaps[-1].startswith("dcp-step-"), snaps


@pytest.mark.slow
def test_lightning_fsdp2_under_run_keeps_its_workers_through_a_kill_and_a_join(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """The same job through ``ElasticLightning.run(fit)`` (fit makes the module and the
    Trainer): b is SIGKILLed mid-epoch, then c joins. a keeps its worker throughout: its
    next Trainer re-shards the newest step memory holds whole (its own rows and the copy
    of b's it kept at the last snapshot, every 4 steps) over world 1, at the exact
    sample; c gets its shard from a, live, with no disk read. Every sample of the epochs
    once, at most the interval and the step in flight trained again, the agent names the
    right step (was: a change gave new workers, which read the DCP checkpoint)."""
    out = tmp_path / "out"
    # alone, a trains slowly: c's start-up (over 24 s on a loaded VM) lands inside the job
    args = ("--live", "--epochs", "4", "--dump-start", "--slow-below-world", "2")
    keep = ("--checkpoint-keep", "100")  # the one resumed from, to compare
    node, nodes, kept = sharded_job(etcd, run_id, procs, out, *args, extra=keep)
    a, killed = nodes["a"], time.time()
    nodes["b"].signal(signal.SIGKILL)
    wait_world(out, 1, after=killed, timeout=90)
    c = node("c")
    joined = time.time()
    wait_world(out, 2, after=joined, timeout=120)
    full_speed(out)
    assert a.wait(240) == 0, a.transcript()
    assert c.wait(60) == 0, c.transcript()
    said = a.transcript()
    history = steps(out)
    assert {r["pid"] for r in history if r["t"] > killed and r["world"] == 1} == kept, said
    assert kept <= {r["pid"] for r in history if r["t"] > joined and r["world"] == 2}
    samples_once(history, 192, 4)
    before = max(r["step"] for r in history if r["world"] == 2 and r["t"] < killed)
    after = min(r["step"] for r in history if r["world"] == 1)
    assert (after - 1) % 4 == 0 and 0 <= before + 1 - after <= 4 + 1, (before, after)
    said_if_redone(said, before, after - 1)
    assert "new workers follow" not in said and "re-sharded step" in said, said
    assert "reduce_op" not in said, said  # run() looks for modules without a warning
    rejoined = min(r["step"] for r in history if r["world"] == 2 and r["t"] > joined)
    last = max(r["step"] for r in history if r["world"] == 1)
    assert 0 <= last + 1 - rejoined <= 1, (last, rejoined)  # a pause: at most one again
    # what each next Trainer started from (a's after the kill, a's and c's after the join)
    # is the snapshot of that step, model and Adam's moments alike (DCP kept it too, but
    # for a kill in the middle of its write): the re-shards in memory moved the right rows
    compared = [
        step
        for step in (after - 1, rejoined - 1)
        if (tmp_path / "snap" / f"dcp-step-{step:012d}" / ".metadata").exists()
    ]
    assert rejoined - 1 in compared, compared
    for step in compared:
        same_state(start_of(out, step), snapshot_of(tmp_path / "snap", step, tmp_path), step)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.2], ids=["re-forming", "just-after"])
def test_lightning_fsdp2_under_run_survives_a_second_kill_during_its_recovery(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path, delay: float
) -> None:
    """Three nodes; b is SIGKILLed, and c as soon as a's agent saw b lost (while a and c
    re-form and re-shard), or 0.2 s after (as they train again). b's rows lived, beside
    its own memory, only as the copy c kept, so no step is held whole in memory after
    the second kill: a keeps its worker, reads the newest complete DCP snapshot, starts
    from exactly its model and Adam moments, says how many steps it trains again, and
    finishes the job alone."""
    out = tmp_path / "out"
    args = ("--live", "--epochs", "3", "--dump-start")
    keep = ("--checkpoint-keep", "100")  # the one resumed from, to compare
    _, nodes, kept = sharded_job(etcd, run_id, procs, out, *args, nodes="abc", extra=keep)
    a, killed = nodes["a"], time.time()
    nodes["b"].signal(signal.SIGKILL)
    a.wait_output("lost b", timeout=30)
    time.sleep(delay)
    nodes["c"].signal(signal.SIGKILL)
    assert a.wait(240) == 0, a.transcript()
    said = a.transcript()
    history = steps(out)
    assert {r["pid"] for r in history if r["t"] > killed and r["world"] == 1} == kept, said
    resumed = min(r["step"] for r in history if r["world"] == 1) - 1
    last = max(r["step"] for r in history if r["world"] > 1)
    assert resumed % 4 == 0 and resumed <= last, (resumed, last)  # a snapshot's step
    said_if_redone(said, last, resumed)
    same_state(start_of(out, resumed), snapshot_of(tmp_path / "snap", resumed, tmp_path), resumed)


@pytest.mark.slow
def test_the_examples_run(tmp_path: Path) -> None:
    """Each framework's example, as the README's examples table runs it, to the end (and
    Lightning's with FSDP2 through run(), its shards snapshotted to --checkpoint-dir)."""
    fsdp2 = ("--checkpoint-dir", str(tmp_path / "snap"), "examples/lightning_ddp.py", "--fsdp2",
             "--live", "--step-time", "0.02")  # fmt: skip
    runs = {
        "lightning": ("examples/lightning_ddp.py", "--epochs", "1", "--dir", str(tmp_path / "l")),
        # steps of 20 ms: the ranks agree every few steps, so the first (probe) snapshot
        # lands well inside the epoch's 16 steps
        "lightning-fsdp2": (*fsdp2, "--epochs", "1", "--dir", str(tmp_path / "f")),
        "transformers": ("examples/hf_trainer.py", "--epochs", "1", "--dir", str(tmp_path / "h")),
        "accelerate": ("examples/accelerate_ddp.py", "--epochs", "1"),
    }

    def run(name: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "elastic", "--nproc-per-node", "2", "--metrics-port", "0",
             *runs[name]],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=str(ROOT),
            env={**os.environ, "RESULT_DIR": str(tmp_path)},
        )  # fmt: skip

    done = at_once(run, runs)
    for name, d in done.items():
        assert d.returncode == 0, f"{name}: {d.stderr[-3000:]}"
    assert "step 16 epoch 0" in done["lightning"].stdout, done["lightning"].stdout
    assert "step 16 epoch 0" in done["lightning-fsdp2"].stdout, done["lightning-fsdp2"].stdout
    assert any(p.name.startswith("dcp-step-") for p in (tmp_path / "snap").iterdir())
    assert (tmp_path / "l" / "last.ckpt").exists()  # Lightning's own checkpoints go on
    hf = done["transformers"]
    assert "'epoch': '1'" in hf.stdout and "step 16," in hf.stderr.split("summary:")[1]
    assert (tmp_path / "h" / "checkpoint-16").is_dir()  # the Trainer's own checkpoints go on
    assert "(step 8, 2 processes)" in done["accelerate"].stdout, done["accelerate"].stdout
