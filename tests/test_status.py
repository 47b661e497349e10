"""`elastic-run status`: a running job's round, members and standbys, read from etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from agents import TRAIN_LOOP, start_agent, wait_world
from harness import ROOT, Proc

from elastic.agent.etcd_server import EtcdServer

pytestmark = pytest.mark.slow


def status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic", "status", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=str(ROOT),
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PET_")}, **(env or {})},
    )


def test_status_shows_round_members_and_standbys(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    env = {"RESULT_DIR": str(tmp_path)}
    for name in ("a", "b"):
        start_agent(
            procs,
            etcd.endpoint,
            run_id,
            name,
            TRAIN_LOOP,
            "--steps",
            "100000",
            nnodes="1:2",
            env=env,
            extra=("--metrics-port", "0"),
        )
    wait_world(tmp_path, 2)
    spare = start_agent(procs, etcd.endpoint, run_id, "spare", TRAIN_LOOP, nnodes="1:2", env=env)
    spare.wait_output("registered as spare", timeout=30)  # every read below sees the standby
    done = status("--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert d["state"] == "running" and d["round"]["world_size"] == 2
    assert [(m["rank"], m["node"], m["state"]) for m in d["members"]] in (
        [(0, "a", "running"), (1, "b", "running")],
        [(0, "b", "running"), (1, "a", "running")],
    )
    assert all(m["metrics"].startswith("127.0.0.1:") for m in d["members"])
    table = status("--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id)
    assert "RANK  NODE" in table.stdout and f"job {run_id}: running" in table.stdout
    # inside a job's pod: `kubectl exec job/trainer -- elastic-run status`, no flags
    pet = {"PET_RDZV_ENDPOINT": etcd.endpoint, "PET_RDZV_ID": run_id, "PET_RDZV_CONF": ""}
    same = status(env=pet).stdout
    assert same.splitlines()[2:] == table.stdout.splitlines()[2:]  # the "formed ... ago" aside
    assert same.splitlines()[0] == table.stdout.splitlines()[0]
    assert "standbys: spare (" in table.stdout
    assert [s["node"] for s in d["standbys"]] == ["spare"]


def test_status_without_a_job_says_which_flags_or_variables_name_one() -> None:
    done = status()
    assert done.returncode == 2
    assert "give --rdzv-endpoint, or set PET_RDZV_ENDPOINT" in done.stderr


def test_status_of_an_unknown_job_is_one_line(etcd: EtcdServer) -> None:
    done = status("--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "no-such-job")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "no job 'no-such-job'" in done.stderr


def test_status_of_a_lone_node_below_min_and_of_a_finished_job(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    env = {"RESULT_DIR": str(tmp_path)}
    args = ("--steps", "20")
    a = start_agent(procs, etcd.endpoint, run_id, "a", TRAIN_LOOP, *args, nnodes="2", env=env)
    a.wait_output("registered as a", timeout=30)
    d = json.loads(status("--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--json").stdout)
    assert d["state"] == "forming" and d["needs"] == 1 and not d["standbys"]
    assert [w["node"] for w in d["waiting"]] == ["a"]  # waiting for a peer: not a standby
    table = status("--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id).stdout
    assert "needs 1 more node(s) to train" in table
    b = start_agent(procs, etcd.endpoint, run_id, "b", TRAIN_LOOP, *args, nnodes="2", env=env)
    assert a.wait(120) == 0 and b.wait(120) == 0
    d = json.loads(status("--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--json").stdout)
    assert d["state"] == "succeeded" and d["needs"] == 0
    assert {(m["node"], m["state"]) for m in d["members"]} == {("a", "finished"), ("b", "finished")}
    assert all(m["host"] for m in d["members"]), d["members"]  # from the tombstones
