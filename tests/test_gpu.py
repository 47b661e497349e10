"""On a real GPU: NCCL jobs, device counting, NVML metrics against nvidia-smi.

Skipped where torch sees no CUDA device (this project's CI machine has none). On a GPU
machine: ``python -m pytest -q -m gpu tests/test_gpu.py``, or ``benchmarks/gpu_all.sh``
for these and every GPU benchmark at once (last run: an H200, docs/measured.md).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from harness import ROOT, Proc, wait_until

from elastic.agent.etcd_server import EtcdServer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]
TRAIN = str(ROOT / "examples" / "train_ddp.py")
DUMP = str(ROOT / "tests" / "scripts" / "dump_env.py")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
        env={**os.environ, **(env or {})},
    )


def test_nproc_per_node_gpu_counts_the_devices(tmp_path: Path) -> None:
    done = run("--nproc-per-node", "gpu", DUMP, env={"RESULT_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert len(list(tmp_path.glob("env-rank*.json"))) == torch.cuda.device_count()


def test_devices_refuses_one_that_does_not_exist() -> None:
    done = run("--devices", str(torch.cuda.device_count()), TRAIN)
    assert done.returncode == 1 and "--devices" in done.stderr


def test_an_nccl_ddp_job_runs_as_under_torchrun() -> None:
    n = min(torch.cuda.device_count(), 2)
    for launcher in (
        [sys.executable, "-m", "torch.distributed.run"],
        [sys.executable, "-m", "elastic"],
    ):
        done = subprocess.run(
            [*launcher, "--nproc-per-node", str(n), TRAIN, "--epochs", "1"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(ROOT),
        )
        assert done.returncode == 0, done.stderr
        assert f"world size {n}" in done.stdout


def smi(query: str, kind: str = "gpu") -> list[dict[str, str]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.skip("no nvidia-smi")
    out = subprocess.run(
        [exe, f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    keys = query.split(",")
    rows = csv.reader(io.StringIO(out))
    return [dict(zip(keys, (v.strip() for v in row), strict=True)) for row in rows]


def test_nvml_metrics_match_nvidia_smi(procs: list[Proc]) -> None:
    p = Proc(
        [sys.executable, "-m", "elastic", "--metrics-addr", "127.0.0.1", "--metrics-port", "0",
         "--nproc-per-node", "1", TRAIN, "--epochs", "1000", "--step-time", "0.01"],
        name="gpu-agent",
    )  # fmt: skip
    procs.append(p)
    line = p.wait_output("metrics on http://", timeout=60)
    port = int(re.search(r":(\d+)/metrics", line).group(1))

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            return str(r.read().decode())

    wait_until(
        lambda: "elastic_run_gpu_process_memory_bytes{" in scrape(), 120, "a worker on a GPU"
    )
    used = r"elastic_run_gpu_memory_used_bytes{[^}]*} (\S+)"

    def steady() -> bool:  # CUDA set-up allocates for a while: compare once it stopped
        before = re.findall(used, scrape())
        time.sleep(1.0)
        return before == re.findall(used, scrape())

    wait_until(steady, 120, "GPU memory to settle")
    gpus = smi("index,memory.total,memory.used,temperature.gpu")
    apps = smi("pid,used_memory", kind="compute-apps")
    text = scrape()

    def value(name: str, gpu: str) -> float:
        m = re.search(rf'{name}{{[^}}]*gpu="{gpu}"[^}}]*}} (\S+)', text)
        assert m, (name, text)
        return float(m.group(1))

    mib = 2**20
    for g in gpus:
        i = g["index"]
        assert value("elastic_run_gpu_memory_total_bytes", i) == float(g["memory.total"]) * mib
        assert (
            abs(value("elastic_run_gpu_memory_used_bytes", i) / mib - float(g["memory.used"])) < 64
        )
        assert (
            abs(value("elastic_run_gpu_temperature_celsius", i) - float(g["temperature.gpu"])) <= 3
        )
    ours = [
        float(v) / mib
        for v in re.findall(r"elastic_run_gpu_process_memory_bytes{[^}]*} (\S+)", text)
    ]
    theirs = [float(a["used_memory"]) for a in apps]
    assert len(ours) == 1 and any(abs(ours[0] - t) < 64 for t in theirs), (ours, theirs)
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read())
    assert health["state"] == "running"


def test_state_snapshots_cuda_tensors_and_restores_them_to_the_gpu() -> None:
    """SIGKILL right after commit 5: the restart resumes from the newest complete
    snapshot (step 5, or 4 if its copy was still in flight) on the GPU, and a step run
    twice gives bitwise the same parameters (model, Adam state and CUDA RNG restored)."""
    script = str(ROOT / "tests" / "scripts" / "gpu_state.py")
    done = run("--max-restarts", "1", "--snapshot-every", "1", script)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("step ")]
    first = {int(r[1]): r[7] for r in rows if r[3] == "0"}
    again = {int(r[1]): r[7] for r in rows if r[3] == "1"}
    assert sorted(first) == [1, 2, 3, 4, 5]
    assert min(again) in (5, 6) and max(again) == 10, sorted(again)
    for step in set(first) & set(again):
        assert first[step] == again[step], (step, first[step], again[step])
    assert all(r[5].startswith("cuda") for r in rows)


def test_live_re_formation_on_nccl(procs: list[Proc], tmp_path: Path) -> None:
    """Ten re-formations (pause and abandon in turn) of NCCL workers, one per GPU: the
    communicators are aborted or destroyed and formed again in the same processes."""
    from test_live import Node

    node = Node(procs, tmp_path, n=min(torch.cuda.device_count(), 2), env={"LEAK_BACKEND": "nccl"})
    node.run(10)
    for pid, entries in node.entries().items():
        assert [e["entry"] for e in entries] == list(range(1, 12)), f"{pid} re-entered each time"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_fsdp_kept_live_on_nccl(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """The CUDA variant of test_state_e2e's FSDP test: a on GPU 0, b joins on GPU 1 (a's
    worker keeps its process, the shards move over NCCL), b is SIGKILLed and a rebuilds
    the snapshot's step from its own copy and the copy of b's rows it kept."""
    from agents import start_agent, steps, worker_pids

    out, shared = tmp_path / "steps", tmp_path / "ckpt"
    out.mkdir()
    script = ROOT / "tests" / "scripts" / "fsdp_train.py"

    def node(name: str, gpu: int) -> Proc:
        return start_agent(
            procs,
            etcd.endpoint,
            run_id,
            name,
            script,
            "--steps",
            "40",
            "--live",
            "--cuda",
            nnodes="1:2",
            extra=("--checkpoint-dir", str(shared), "--snapshot-every", "5"),
            env={"RESULT_DIR": str(out), "CUDA_VISIBLE_DEVICES": str(gpu)},
        )

    def trained(world: int, after: float = 0.0) -> list[dict]:
        return [r for r in steps(out) if r["world"] == world and r["t"] > after]

    a = node("a", 0)
    wait_until(lambda: trained(1), 120, "a training alone")
    kept = set(worker_pids(a))
    b = node("b", 1)
    wait_until(lambda: len([r for r in trained(2) if r["event"] == "step"]) >= 6, 120, "world 2")
    killed = time.time()
    b.kill_tree()
    wait_until(lambda: trained(1, killed), 120, "a alone again")
    assert a.wait(120) == 0, a.transcript()
    history = steps(out)
    restored = [r for r in history if r["event"] == "restored"]
    assert {r["pid"] for r in restored if r["world"] == 2} >= kept
    back = [r for r in restored if r["t"] > killed]
    assert back and {r["pid"] for r in back} == kept, back
    was = [r for r in history if r["step"] == back[0]["step"] and r["t"] < killed]
    assert was and back[0]["checksum"] == pytest.approx(was[-1]["checksum"], rel=1e-6)
    assert all(r["device"].startswith("cuda") for r in history)
    assert "held whole in memory" not in a.transcript()


def test_a_cuda_snapshot_goes_straight_into_the_page_locked_slot() -> None:
    """The slot is registered with CUDA and the tensors' bytes land in it by DMA; the
    optimizer's next in-place write queues behind the copy on the device (the training
    thread does not wait), so the snapshot holds the values of its step; a grown state
    replaces the slot's map and registers the new one."""
    from elastic.contract import SnapshotPolicy
    from elastic.worker import snapshot
    from elastic.worker.snapshotter import Snapshotter, Stats

    w = torch.randn(8192, 8192, device="cuda")  # 256 MiB: a copy that takes a while
    shm = tempfile.mkdtemp(dir="/dev/shm")  # where the agent keeps a node's slots
    snap = Snapshotter(SnapshotPolicy(every=1), shm, 0, Stats())
    assert snap.slots is not None
    snap.take({"w": w}, 1, {w.data_ptr()}, set(), lambda: False)
    expected = w.cpu()
    snap.wait_for_step()
    w.add_(1.0)  # as optimizer.step() would, right after the pre-step hook
    snap.wait_copy()
    newest = snap.slots.newest()
    assert newest is not None and newest[1] == 1
    slot = newest[0]
    assert slot in snap._pins._pinned
    assert torch.equal(snapshot.parse(snap.slots.read(slot))["w"], expected)
    big = torch.randn(2, 8192, 8192, device="cuda")
    for step in (2, 3):  # both slots, grown
        snap.take({"w": w, "big": big}, step, {w.data_ptr(), big.data_ptr()}, set(), lambda: False)
        snap.wait_copy()
    newest = snap.slots.newest()
    assert newest is not None and newest[1] == 3
    back = snapshot.parse(snap.slots.read(newest[0]))
    assert torch.equal(back["big"], big.cpu()) and torch.equal(back["w"], w.cpu())
    assert set(snap._pins._pinned) == {0, 1}
    assert all(buf is snap.slots._maps[i] for i, (buf, _) in snap._pins._pinned.items())
    snap.close()
    assert not snap._pins._pinned
    shutil.rmtree(shm)
