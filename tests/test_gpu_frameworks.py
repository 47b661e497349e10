"""The framework adapters on a real GPU: the CUDA half of test_frameworks.

Skipped where torch sees no CUDA device (this project's CI machine has none); run by
``benchmarks/gpu_all.sh``. One GPU holds one NCCL rank, so the same-world resume runs
one NCCL worker a node, and the node-loss test puts two nodes' gloo workers, models and
optimizers on the one device (the survivor's CUDA context and model are what it keeps).
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from agents import samples_once, start_agent, steps, wait_world, worker_pids
from harness import ROOT, Proc
from test_frameworks import FORK, JOBS, SCRIPTS, at_once, same_as_plain, start_pair

from elastic.agent.etcd_server import EtcdServer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]
CUDA = ("--device", "cuda")


@pytest.fixture(autouse=True)
def _frameworks() -> None:
    for name in JOBS:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")


def test_a_killed_cuda_worker_resumes_bitwise(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Lightning and the Trainer on NCCL, the model, Adam's state and dropout's RNG on
    the GPU: killed at step 7 and resumed from the snapshot of step 6, the adapter's run
    trains the same samples to the same losses, and ends with exactly the weights and
    optimizer state of the script without the adapter and without a fault."""
    args = ("--samples", "96", "--accumulate", "2", *CUDA)  # 12 optimizer steps an epoch
    kill = ("--adapter", "--kill-rank", "0", "--kill-step", "7")
    agents = {}
    for name in ("lightning", "transformers"):
        job = (SCRIPTS / JOBS[name][0], *args)
        result = tmp_path / name
        agents[name] = start_pair(procs, etcd.endpoint, f"{run_id}-{name}", result, job, kill, 1)
    for name, (plain, killed) in agents.items():
        for agent in (plain, killed):
            assert agent.wait(300) == 0, f"{name}: {agent.transcript()}"
        assert any("signal SIGKILL" in line for line in killed.err), name
        assert "restored step 6 (from rank 0)" in killed.transcript(), killed.transcript()
        same_as_plain(tmp_path / name, name, last_step=24)


def test_a_node_lost_keeps_the_survivors_cuda_worker(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Per framework, two nodes of one gloo worker each, both on the GPU; b is SIGKILLed
    mid-epoch and a's worker, its CUDA context and model kept, trains the rest alone:
    every sample of both epochs once in the kept steps, the step in flight redone."""
    common = ("--adapter", "--live", "--samples", "192", "--epochs", "2", "--step-time", "0.05")
    agents: dict[str, tuple[Proc, Proc]] = {}
    for name, (script, args) in JOBS.items():
        out = tmp_path / name
        out.mkdir()
        job = (SCRIPTS / script, *common, *args, *CUDA, "--backend", "gloo")
        env = {"RESULT_DIR": str(out)}
        kw = {"nnodes": "1:2", "nproc": 1, "extra": ("--snapshot-every", "1000")}
        a = start_agent(procs, etcd.endpoint, f"{run_id}-{name}", "a", *job, env=env, **kw)  # type: ignore[arg-type]
        a.wait_output("registered as a", timeout=60)
        b = start_agent(procs, etcd.endpoint, f"{run_id}-{name}", "b", *job, env=env, **kw)  # type: ignore[arg-type]
        agents[name] = (a, b)
    kept: dict[str, list[int]] = {}
    took: dict[str, float] = {}

    def lose_b(name: str) -> None:
        wait_world(tmp_path / name, 2, timeout=240)
        kept[name] = worker_pids(agents[name][0])
        time.sleep(0.6)
        killed = time.time()
        agents[name][1].signal(signal.SIGKILL)
        took[name] = wait_world(tmp_path / name, 1, after=killed, timeout=90) - killed

    at_once(lose_b, agents)
    for name, (a, _) in agents.items():
        assert a.wait(240) == 0, f"{name}: {a.transcript()}"
        history = steps(tmp_path / name)
        assert {r["pid"] for r in history if r["world"] == 1} == set(kept[name]), name
        assert "workers re-form live" in a.transcript()
        samples_once(history, 192, 2)
        before = max(r["step"] for r in history if r["world"] == 2)
        after = min(r["step"] for r in history if r["world"] == 1)
        assert 0 <= before + 1 - after <= 1, (name, before, after)
    print("kill of b -> a's first step alone, live on the GPU:", took)


def test_the_examples_gpu_forms_run(tmp_path: Path) -> None:
    """Each framework's example as the README's table runs it on GPUs (NCCL, one GPU a
    worker: here one worker), to the end; the NCCL group the Trainer's and accelerate's
    scripts leave is destroyed at exit (torch warned it "can leak resources" before)."""
    runs = {
        "lightning": ("examples/lightning_ddp.py", "--epochs", "1", "--dir", str(tmp_path / "l")),
        "transformers": ("examples/hf_trainer.py", "--epochs", "1", "--dir", str(tmp_path / "h")),
        "accelerate": ("examples/accelerate_ddp.py", "--epochs", "1"),
        "fsdp": ("--checkpoint-dir", str(tmp_path / "f"), "examples/train_fsdp.py"),
        "lightning-fsdp2": ("--checkpoint-dir", str(tmp_path / "s"), "examples/lightning_ddp.py",
                            "--fsdp2", "--live", "--epochs", "1", "--dir", str(tmp_path / "ls")),
    }  # fmt: skip

    def run(name: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "elastic", "--nproc-per-node", "1", "--metrics-port", "0",
             *runs[name]],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=str(ROOT),
        )  # fmt: skip

    done = at_once(run, runs)
    for name, d in done.items():
        said = [
            line
            for line in d.stderr.splitlines()
            if "destroy" in line.lower() or "terminate called" in line
        ]
        print(f"{name}: exit {d.returncode}; at exit: {said or 'nothing'}")
    for name, d in done.items():
        assert d.returncode == 0, f"{name}: {d.stderr[-3000:]}"
        assert "destroy_process_group() was not called" not in d.stderr, name


def fsdp_killed_at_step_7(
    etcd: EtcdServer, run_id: str, procs: list[Proc], out: Path, *extra: str
) -> Proc:
    """Lightning's FSDPStrategy on the GPU with the adapter and its own checkpoints every
    5 steps, on one node of one worker, SIGKILLed at step 7 once (``extra``: more agent
    flags); the agent, started."""
    job = (
        SCRIPTS / "lightning_train.py", "--samples", "96", *CUDA, "--strategy", "fsdp",
        "--adapter", "--checkpoint-every", "5", "--kill-rank", "0", "--kill-step", "7",
    )  # fmt: skip
    env = {"RESULT_DIR": str(out)}
    extra = ("--max-restarts", "1", *extra, *FORK)
    return start_agent(procs, etcd.endpoint, run_id, "a", *job, env=env, extra=extra)


def test_lightning_fsdp_stands_aside_and_resumes_from_its_own_checkpoint(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Lightning's FSDPStrategy (GPUs only: Lightning refuses it on CPU) with the adapter:
    its checkpoint is rank 0's alone, so the adapter stands aside and says so; a worker
    killed at step 7 resumes from Lightning's own checkpoint of step 5, and the adapter's
    loader still goes on at the checkpoint's sample: every sample once in the kept steps."""
    agent = fsdp_killed_at_step_7(etcd, run_id, procs, tmp_path)
    assert agent.wait(300) == 0, agent.transcript()
    said = agent.transcript()
    assert "FSDPStrategy keeps sharded checkpoints of its own" in said, said
    assert "signal SIGKILL" in said
    history = steps(tmp_path)
    again = [r for r in history if r["restart_count"] == 1]
    assert min(r["step"] for r in again) == 6, sorted({r["step"] for r in again})
    assert max(r["step"] for r in history) == 48
    samples_once(history, 96, 2)


def test_lightning_fsdp_with_a_checkpoint_dir_resumes_from_the_snapshot_of_its_shards(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """The same job with ``--checkpoint-dir``: Lightning wraps the whole module in FSDP1
    on the GPU (the CPU test, ``CPUFSDP``, wraps its layers), and the adapter snapshots
    the shards with DCP every 3 steps; killed at step 7, the worker resumes from the
    snapshot of step 6, newer than Lightning's own checkpoint of step 5."""
    snap = tmp_path / "snap"
    every = ("--checkpoint-dir", str(snap), "--snapshot-every", "3")
    agent = fsdp_killed_at_step_7(etcd, run_id, procs, tmp_path, *every)
    assert agent.wait(300) == 0, agent.transcript()
    said = agent.transcript()
    assert "stand aside" not in said and "signal SIGKILL" in said, said
    history = steps(tmp_path)
    again = [r for r in history if r["restart_count"] == 1]
    assert min(r["step"] for r in again) == 7, sorted({r["step"] for r in again})
    assert max(r["step"] for r in history) == 48
    samples_once(history, 96, 2)
    assert any(p.name.startswith("dcp-step-") for p in snap.iterdir())
