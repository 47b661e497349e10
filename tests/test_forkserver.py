"""--start-method forkserver: workers forked from a process that imported torch once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from agents import TRAIN_LOOP, start_agent, steps, wait_workers, wait_world
from harness import ROOT, Proc, wait_until

from elastic.agent.etcd_server import EtcdServer

pytestmark = pytest.mark.slow


def elastic_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic", "--start-method", "forkserver", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env={**os.environ, **(env or {})},
    )


def test_workers_get_the_same_environment_and_logs(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:  # the two jobs at once: most of each is start-up
        dumped = pool.submit(
            elastic_run,
            *("--nproc-per-node", "2", "tests/scripts/dump_env.py"),
            env={"RESULT_DIR": str(tmp_path)},
        )
        echoed = pool.submit(elastic_run, "--nproc-per-node", "2", "tests/scripts/echo.py")
        done, echo = dumped.result(), echoed.result()
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        env = json.loads((tmp_path / f"env-rank{rank}.json").read_text())
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert "hello from 1" in echo.stdout and "complaint from 0" in echo.stderr


def test_failures_carry_exit_code_and_message(tmp_path: Path) -> None:
    """A worker's exit code and a crash's message reach the agent's report (the two jobs
    at once: most of each is start-up)."""
    restarted = ("--nproc-per-node", "2", "--max-restarts", "1", "tests/scripts/echo.py")
    crashing = ("tests/scripts/train_loop.py", "--steps", "5", "--crash-rank", "0")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(elastic_run, *restarted, "--fail-first")
        second = pool.submit(
            elastic_run, *crashing, "--crash-step", "2", env={"RESULT_DIR": str(tmp_path)}
        )
        done, crash = first.result(), second.result()
    assert done.returncode == 0, done.stderr  # the restart succeeds
    assert "rank 1 (local_rank 1) on" in done.stderr and "exit code 3" in done.stderr
    assert crash.returncode == 1
    assert "RuntimeError: injected crash at step 2 on rank 0" in crash.stderr


def test_module_mode() -> None:
    done = elastic_run("-m", "json.tool", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")


def test_workers_die_with_the_agent(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    agent = start_agent(
        procs,
        etcd.endpoint,
        run_id,
        "a",
        TRAIN_LOOP,
        "--steps",
        "100000",
        nnodes="1",
        env={"RESULT_DIR": str(tmp_path)},
        extra=("--start-method", "forkserver"),
    )
    wait_world(tmp_path, 1)
    workers = [s["pid"] for s in steps(tmp_path)][:1]
    assert psutil.Process(workers[0]).ppid() != agent.pid  # a child of the fork server
    agent.signal(signal.SIGKILL)
    wait_until(
        lambda: (
            not psutil.pid_exists(workers[0])
            or psutil.Process(workers[0]).status() == psutil.STATUS_ZOMBIE
        ),
        1.0,
        "the worker to die with its agent",
    )


def test_a_lost_node_restarts_forked_workers(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    env = {"RESULT_DIR": str(tmp_path)}
    a, b = (
        start_agent(
            procs,
            etcd.endpoint,
            run_id,
            n,
            TRAIN_LOOP,
            "--steps",
            "100000",
            nnodes="1:2",
            env=env,
            extra=("--start-method", "forkserver"),
        )
        for n in "ab"
    )
    wait_world(tmp_path, 2)
    old = set(wait_workers(a, 1))
    killed = time.time()
    b.signal(signal.SIGKILL)
    wait_world(tmp_path, 1, after=killed, timeout=20)
    fresh = {s["pid"] for s in steps(tmp_path) if s["t"] > killed and s["world"] == 1}
    assert fresh and not fresh & old, "the survivor's workers were forked anew"
