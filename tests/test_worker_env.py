"""Workers see exactly torchrun's environment for the same ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT

from elastic.agent.placement import Placement, restart_count, worker_env
from rendezvous.records import RoundCause

DUMP = str(ROOT / "tests" / "scripts" / "dump_env.py")
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "RESULT_DIR"}


def ours_only(name: str) -> bool:
    """The variables elastic-run adds on top of torchrun's, as docs/reference.md documents."""
    return name.startswith("ELASTIC_RUN_") or name == "PROMETHEUS_MULTIPROC_DIR"


def launch(launcher: list[str], out: Path) -> dict[int, dict[str, str]]:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["RESULT_DIR"] = str(out)
    done = subprocess.run(
        [*launcher, "--nproc-per-node", "3", DUMP],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    return {r: json.loads((out / f"env-rank{r}.json").read_text()) for r in range(3)}


@pytest.mark.slow
def test_same_environment_as_torchrun_standalone(tmp_path: Path) -> None:
    theirs = launch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"], tmp_path / "torchrun"
    )
    ours = launch([sys.executable, "-m", "elastic", "--standalone"], tmp_path / "elastic")
    parent = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for rank in range(3):
        t = {k: v for k, v in theirs[rank].items() if parent.get(k) != v}
        o = {k: v for k, v in ours[rank].items() if parent.get(k) != v}
        extra = {k for k in o if ours_only(k)}
        assert {"ELASTIC_RUN_CONTROL", "ELASTIC_RUN_NODE_ID", "PROMETHEUS_MULTIPROC_DIR"} <= extra
        o = {k: v for k, v in o.items() if k not in extra}
        assert set(t) == set(o), set(t) ^ set(o)
        assert {k: v for k, v in t.items() if k not in PER_RUN} == {
            k: v for k, v in o.items() if k not in PER_RUN
        }
        for env in (t, o):
            assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")
        assert o["OMP_NUM_THREADS"] == "1" and o["LOCAL_RANK"] == str(rank)


def test_virtual_local_rank_maps_through_visible_devices() -> None:
    p = Placement(
        local_rank=1,
        rank=5,
        group_rank=2,
        local_world_size=2,
        world_size=8,
        group_world_size=4,
        master_addr="h",
        master_port=1,
        restart_count=0,
    )
    env = worker_env(
        p,
        role="r",
        run_id="j",
        max_restarts=0,
        error_file="e",
        virtual_local_rank=True,
        base={"CUDA_VISIBLE_DEVICES": "4,6"},
    )
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"], env["RANK"]) == ("0", "6", "5")
    env = worker_env(
        p, role="r", run_id="j", max_restarts=0, error_file="e", virtual_local_rank=True, base={}
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ValueError, match="exceeds CUDA_VISIBLE_DEVICES=4"):
        worker_env(
            p,
            role="r",
            run_id="j",
            max_restarts=0,
            error_file="e",
            virtual_local_rank=True,
            base={"CUDA_VISIBLE_DEVICES": "4"},
        )
    plain = worker_env(
        p,
        role="r",
        run_id="j",
        max_restarts=3,
        error_file="e",
        base={"CUDA_VISIBLE_DEVICES": "4,6", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
    )
    assert plain["CUDA_VISIBLE_DEVICES"] == "4,6" and plain["LOCAL_RANK"] == "1"
    assert plain["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert plain["TORCHELASTIC_MAX_RESTARTS"] == "3"


@pytest.mark.parametrize(
    ("cause", "first", "after"),
    [
        (RoundCause.START, True, 0),
        (RoundCause.LOST, True, 0),  # a node's first round: torchrun's new agent starts at 0
        (RoundCause.LOST, False, 3),  # the survivors' workers fail under torchrun: counted
        (RoundCause.FAILURE, False, 3),
        (RoundCause.LEFT, False, 3),
        (RoundCause.RESIZE, False, 2),  # num_nodes_waiting: restarted, not counted
    ],
)
def test_torchruns_restart_count(cause: RoundCause, first: bool, after: int) -> None:
    assert restart_count(2 if not first else 0, cause, first=first) == after
