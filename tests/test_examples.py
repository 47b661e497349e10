"""Every example runs, under elastic-run where it is distributed, in a short mode; the DDP
examples survive a node being SIGKILLed mid-run; the DataLoader tuner and --devices."""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from agents import gone, start_agent, wait_workers
from harness import ROOT, Proc, wait_until

from elastic.agent.devices import DeviceError, choose_devices, count_devices, nvml_device_count
from elastic.agent.etcd_server import EtcdServer
from elastic.tools import tune_workers
from elastic.tools.tune_workers import Trial, candidates, recommend

EXAMPLES = ROOT / "examples"


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT)
    )


def elastic_run(*args: str) -> subprocess.CompletedProcess:
    return run("-m", "elastic", *args)


@pytest.mark.slow
def test_readme_first_command_runs_train_ddp() -> None:
    done = elastic_run("--nproc-per-node", "2", "examples/train_ddp.py", "--epochs", "2")
    assert done.returncode == 0, done.stderr
    assert "epoch 1: loss" in done.stdout and "world size 2" in done.stdout
    # a clean first run: no warning of torch's (numpy, which .ci/install brings) or ours
    assert "Warning" not in done.stderr and " W " not in done.stderr.split("\n", 1)[1], done.stderr


SHORT_RUNS = [
    ([], ["examples/single_device.py", "--epochs", "1", "--samples", "512"], "epoch 0 on cpu"),
    (
        [],
        ["examples/model_parallel.py", "--epochs", "1", "--samples", "512"],
        "stages on cpu and cpu",
    ),
    (
        [],
        ["examples/dp_vs_ddp.py", "--mode", "dp", "--epochs", "1", "--samples", "1024"],
        "dp epoch 0",
    ),
    (
        ["-m", "elastic", "--nproc-per-node", "2"],
        ["examples/dp_vs_ddp.py", "--mode", "ddp", "--epochs", "1", "--samples", "1024"],
        "ddp epoch 0: loss",
    ),
    (
        ["-m", "elastic", "--nproc-per-node", "2"],
        ["examples/model_parallel_ddp.py", "--epochs", "1", "--samples", "512"],
        "epoch 0: loss",
    ),
    (
        ["-m", "elastic", "--nproc-per-node", "2"],
        ["examples/dataloader_workers.py", "--samples", "256", "--num-workers", "1"],
        "with num_workers=1",
    ),
    (
        ["-m", "elastic", "--nproc-per-node", "2"],
        ["examples/device_subsets.py", "--samples", "256"],
        "rank 1 (local 1): cpu",
    ),
    (
        ["-m", "elastic"],
        ["examples/single_device.py", "--epochs", "1", "--samples", "256"],
        "epoch 0 on cpu",
    ),
    (
        ["-m", "elastic", "--nproc-per-node", "2", "--checkpoint-dir", "{tmp}"],
        ["examples/train_fsdp.py", "--epochs", "1"],
        "epoch 0: loss",
    ),
]


@pytest.mark.slow
def test_the_examples_run(tmp_path: Path) -> None:
    """Every example in the README's table that the other tests do not run, two at a time
    (most of each run is start-up and waiting, which overlaps)."""

    def short(case: tuple[list[str], list[str], str]) -> subprocess.CompletedProcess:
        return run(*(a.format(tmp=tmp_path) for a in case[0]), *case[1])

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(short, SHORT_RUNS))
    for (launch, args, expect), d in zip(SHORT_RUNS, done, strict=True):
        assert d.returncode == 0, (launch, args, d.stderr[-3000:])
        assert expect in d.stdout, (launch, args, d.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_ddp.py", "train_live.py"])
def test_ddp_examples_survive_a_node_sigkill(
    etcd: EtcdServer, run_id: str, procs: list[Proc], script: str
) -> None:
    """The rank-0 node (the round's store host, the harder case of a node loss) is
    killed: its workers die with it; the respawn example resumes in new workers, the
    State.run one in the same ones; either way the survivor, now rank 0, goes on printing
    (a rank kept from before State.run would leave it silent). The agent reports the loss
    first and as the cause, never as the survivor's own failure (its workers print their
    broken collective's traceback, as under torchrun), and charges no restart."""
    args = ("--epochs", "3", "--step-time", "0.02")
    a = start_agent(procs, etcd.endpoint, run_id, "a", EXAMPLES / script, *args, nnodes="1:2")
    a.wait_output("registered as a", timeout=30)  # a joins first, so rank 0 is on a
    b = start_agent(procs, etcd.endpoint, run_id, "b", EXAMPLES / script, *args, nnodes="1:2")
    first = a.wait_output("epoch 0: loss", timeout=90)
    assert "world size 2" in first
    workers = wait_workers(a, 1)
    a.signal(signal.SIGKILL)
    wait_until(lambda: gone(workers), 1.0, "the killed agent's workers to die")
    assert b.wait(180) == 0, b.transcript()
    out = "\n".join(b.out)
    log = [line for line in b.err if "elastic-run[b]" in line]  # the agent's, not its workers
    if script == "train_live.py":
        assert "workers re-form live" in b.transcript() and "training from step" in out
        assert "new workers follow" not in b.transcript()
    else:
        assert "resumed at epoch" in out
    assert "epoch 2: loss" in out and "world size 1" in out
    lost_at = next(i for i, line in enumerate(log) if "lost a" in line)
    assert not any("Traceback" in line for line in log[:lost_at]), log[:lost_at]
    assert not any("workers failed" in line or "restart 1 after" in line for line in log), log
    told = [i for i, line in enumerate(log) if "its collective failed when" in line]
    assert all(i > lost_at for i in told), log


def test_tuner_candidates_and_recommendation() -> None:
    assert candidates(1) == [0, 1]
    assert candidates(6) == [0, 1, 2, 4, 6]
    assert candidates(8) == [0, 1, 2, 4, 8]
    trials = [Trial(0, 0.0, 10.0), Trial(1, 0.1, 30.0), Trial(2, 0.1, 39.0), Trial(4, 0.2, 40.0)]
    assert recommend(trials).num_workers == 2  # within 5% of the fastest, fewer workers


def test_tuner_shares_the_cores_among_the_training_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tune_workers, "cpu_count", lambda: 16)
    assert tune_workers.core_share(1) == 16
    assert tune_workers.core_share(4) == 4  # four processes per node, four cores each
    assert tune_workers.core_share(32) == 1


@pytest.mark.slow
def test_tune_workers_times_the_users_dataset() -> None:
    done = elastic_run(
        "tune-workers",
        "examples/dataloader_workers.py:make_dataset",
        "--batch-size",
        "16",
        "--batches",
        "5",
        "--workers",
        "0,1,2",
    )
    assert done.returncode == 0, done.stderr
    rows = [
        line.split()
        for line in done.stdout.splitlines()
        if len(line.split()) == 4 and line.split()[0].isdigit()
    ]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert "recommended: num_workers=" in done.stdout
    assert "1 training process(es) per node assumed" in done.stdout
    bad = elastic_run("tune-workers", "examples/dataloader_workers.py:nothing")
    assert bad.returncode == 2 and "nothing is not a function" in bad.stderr
    bad = elastic_run("tune-workers", "no-colon")
    assert bad.returncode == 2 and "expected FILE.py:FUNCTION" in bad.stderr


def test_devices_are_checked_and_map_local_ranks() -> None:
    assert choose_devices("0,2", total=4) == ["0", "2"]
    assert choose_devices("GPU-1234, 1", total=2) == ["GPU-1234", "1"]
    with pytest.raises(DeviceError, match="device 4 does not exist: this machine has GPUs 0-3"):
        choose_devices("1,4", total=4)
    with pytest.raises(DeviceError, match="listed twice"):
        choose_devices("1,1", total=4)
    with pytest.raises(DeviceError, match="no GPU is visible"):
        choose_devices("0", total=0)
    assert count_devices("gpu", visible=2) == 2


@pytest.mark.skipif(nvml_device_count() > 0, reason="this machine has GPUs")
def test_devices_on_a_machine_without_them_is_one_line() -> None:
    done = elastic_run("--devices", "0,2", "examples/device_subsets.py")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == ["elastic-run: error: --devices 0,2: no GPU is visible here (NVML finds none)"]


def test_tune_workers_python_api() -> None:
    import torch
    from torch.utils.data import TensorDataset

    import elastic

    data = TensorDataset(torch.randn(64, 4))
    trials = elastic.tune_workers(data, batch_size=8, batches=3, workers=[0])
    assert [t.num_workers for t in trials] == [0] and trials[0].rate > 0
