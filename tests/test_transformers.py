"""The HF Trainer adapter under real agents: a script written for torchrun, plus
``ElasticCallback.attach(trainer)``, resumes from the in-memory snapshots, bitwise as if
nothing happened, and across a resize without losing or repeating a sample."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from agents import samples_once, start_agent, steps, wait_world
from conftest import need
from harness import ROOT, Proc

from elastic.agent.etcd_server import EtcdServer

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "tests" / "scripts" / "hf_train.py"


@pytest.fixture(autouse=True)
def _transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        need(False, "transformers is not installed (pip install -e '.[test]')")


def run(
    procs: list[Proc],
    etcd: EtcdServer,
    run_id: str,
    out: Path,
    node: str,
    *args: str,
    nnodes: str = "1",
    nproc: int = 2,
    extra: tuple[str, ...] = (),
) -> Proc:
    out.mkdir(exist_ok=True)
    return start_agent(
        procs,
        etcd.endpoint,
        run_id,
        node,
        SCRIPT,
        *args,
        nnodes=nnodes,
        nproc=nproc,
        extra=extra,
        env={"RESULT_DIR": str(out)},
    )


def test_a_killed_worker_resumes_bitwise_as_the_script_without_the_adapter(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Mid-epoch, at the same world size, with gradient accumulation: the adapter's run,
    killed at step 7 and resumed from the snapshot of step 6, trains exactly the samples
    and ends with exactly the weights of the same script without the adapter and without
    a fault."""
    args = ("--samples", "192", "--accumulate", "2")  # 12 optimizer steps an epoch
    plain = run(procs, etcd, run_id + "-plain", tmp_path / "plain", "a", *args)
    killed = run(
        procs,
        etcd,
        run_id + "-kill",
        tmp_path / "kill",
        "b",
        *args,
        "--adapter",
        "--kill-rank",
        "1",
        "--kill-step",
        "7",
        extra=("--snapshot-every", "3", "--max-restarts", "1"),
    )
    for agent in (plain, killed):
        assert agent.wait(240) == 0, agent.transcript()
    assert any("signal SIGKILL" in line for line in killed.err)
    assert any("resumes from step 6" in line for line in killed.err), killed.transcript()
    ref = {(r["epoch"], r["step"], r["rank"]): r for r in steps(tmp_path / "plain")}
    for r in steps(tmp_path / "kill"):  # the redone step 7 included
        same = ref[r["epoch"], r["step"], r["rank"]]
        assert (r["step"], r["indices"], r["loss"]) == (same["step"], same["indices"], same["loss"])
    want, got = (torch.load(tmp_path / d / "final.pt") for d in ("plain", "kill"))
    assert want["step"] == got["step"] == 24
    for k, v in want["model"].items():
        assert torch.equal(v, got["model"][k]), k
    for p, s in want["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, got["optimizer"]["state"][p][k]), (p, k)


def test_a_node_lost_mid_epoch_resizes_without_losing_or_repeating_a_sample(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Two nodes, one worker each; b is SIGKILLed mid-epoch and a trains on alone: the
    rest of the epoch is split over the new world, every sample of every epoch once in
    the kept steps, and at most the snapshot interval (2) of steps redone."""
    out = tmp_path / "steps"
    args = ("--adapter", "--samples", "96", "--epochs", "2", "--step-time", "0.05")
    extra = ("--snapshot-every", "2")
    a = run(procs, etcd, run_id, out, "a", *args, nnodes="1:2", nproc=1, extra=extra)
    a.wait_output("registered as a", timeout=30)
    b = run(procs, etcd, run_id, out, "b", *args, nnodes="1:2", nproc=1, extra=extra)
    wait_world(out, 2, timeout=120)
    time.sleep(0.6)  # a few steps into the epoch
    killed = time.time()
    b.signal(signal.SIGKILL)
    wait_world(out, 1, after=killed, timeout=60)
    assert a.wait(180) == 0, a.transcript()
    history = steps(out)
    assert sorted({r["world"] for r in history}) == [1, 2]
    samples_once(history, 96, 2)
    before = max(r["step"] for r in history if r["world"] == 2)
    after = min(r["step"] for r in history if r["world"] == 1)
    assert 0 <= before + 1 - after <= 2, (before, after)


def test_the_example_runs(tmp_path: Path) -> None:
    args = ["examples/hf_trainer.py", "--epochs", "1", "--dir", str(tmp_path / "out")]
    done = subprocess.run(
        [sys.executable, "-m", "elastic", "--nproc-per-node", "2", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'epoch': '1'" in done.stdout and "summary:" in done.stderr, done.stdout
    assert "step 16," in done.stderr.split("summary:")[1]  # 512 samples, 16 per rank, 2 ranks
    assert (tmp_path / "out" / "checkpoint-16").is_dir()  # the Trainer's own checkpoints go on
