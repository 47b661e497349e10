"""Sharded state re-sharded in memory (``elastic.worker.reshard``): real processes over
gloo, FSDP2 and HSDP on CPU, through a join and losses (tests/scripts/reshard_*.py), and
the checks on what a script's ``reshard`` function returns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from harness import ROOT

from elastic.worker import reshard


def said(script: str, *args: str) -> subprocess.Popen[str]:
    path = ROOT / "tests" / "scripts" / script
    return subprocess.Popen(
        [sys.executable, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def lines(p: subprocess.Popen[str]) -> list[dict]:
    out, err = p.communicate(timeout=300)  # 120 s in CI, 186 s on a slow day
    assert p.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_shards_move_in_memory_through_joins_and_losses() -> None:
    """FSDP2 through a join and a loss (three processes), and HSDP losing a replica group
    (four), run side by side."""
    fsdp, hsdp = said("reshard_ranks.py", "forkserver"), said("reshard_hsdp.py")
    try:
        check(lines(fsdp), lines(hsdp))
    finally:
        for p in (fsdp, hsdp):
            if p.poll() is None:
                p.kill()
                p.communicate()


def check(rows: list[dict], hsdp: list[dict]) -> None:

    def phase(name: str) -> dict[int, dict]:
        return {r["process"]: r for r in rows if r["phase"] == name}

    a, b, b4, live, c, dcp = (phase(p) for p in ("a", "b", "b4", "c-live", "c", "dcp"))
    # the join: the newcomer (process 2) gets its shard; every full tensor and optimizer
    # state is the one the two ranks had, exactly
    assert sorted(b) == [0, 1, 2] and {r["source"] for r in b.values()} == {"memory"}
    assert all(r["step"] == 3 and r["full"] == a[0]["full"] for r in b.values())
    assert all(r["sent"] > 0 for r in b.values())
    # the loss of rank 0: its rows of step 5 are gone, and the survivors say which
    assert sorted(live) == [1, 2] and {r["source"] for r in live.values()} == {"nothing"}
    assert all("are held by no rank" in r["reason"] for r in live.values())
    # with the snapshot of step 4 (theirs, and the copy of rank 0's rows its buddy kept)
    assert sorted(c) == [1, 2]
    assert all(r["source"] == "memory" and r["step"] == 4 for r in c.values())
    assert all(r["full"] == b4[0]["full"] for r in c.values())
    assert all("newer steps are not" in r["reason"] for r in c.values())
    # a rank that moved (1 -> 0) shards over the new group, not the old one it matches
    assert all(r["step"] == 4 and r["full"] == b4[0]["full"] for r in dcp.values())
    # HSDP: the surviving replica group holds every row; nothing is sent
    assert sorted(r["process"] for r in hsdp) == [0, 1]
    for r in hsdp:
        assert r == {**r, "source": "memory", "step": 3, "sent": 0, "same": True}, r


def objects() -> dict:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
    }


def test_reshard_must_return_a_dict_of_objects_state_holds() -> None:
    held = objects()
    with pytest.raises(TypeError, match="returns a dict of the objects it made"):
        reshard.replace(held, (held["model"], held["optimizer"]))
    with pytest.raises(ValueError, match=r"returned 'net', which State does not hold"):
        reshard.replace(held, {"net": torch.nn.Linear(2, 2)})
    with pytest.raises(TypeError, match="returned a Linear as 'optimizer', which is a SGD"):
        reshard.replace(held, {"optimizer": torch.nn.Linear(2, 2)})


def test_an_object_left_holding_a_replaced_optimizer_is_refused() -> None:
    held = objects()
    fresh = objects()
    with pytest.raises(ValueError, match="'scheduler' holds the optimizer 'optimizer'"):
        reshard.replace(held, {"model": fresh["model"], "optimizer": fresh["optimizer"]})
    reshard.replace(held, fresh)
    assert held["scheduler"] is fresh["scheduler"]


def test_fsdp1_is_sharded_state_that_takes_the_respawn_path(one_rank: None) -> None:
    """FSDP1's flat parameters are plain tensors: it is sharded state all the same (DCP
    snapshots through get_state_dict), but memory cannot re-shard it, and the reason
    names the module."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from elastic.worker import sharded

    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    inner[0] = FullyShardedDataParallel(inner[0], device_id=torch.device("cpu"))
    root = FullyShardedDataParallel(torch.nn.Linear(4, 1), device_id=torch.device("cpu"))
    plain = torch.nn.Linear(4, 1)
    assert sharded.is_sharded({"model": inner}) and sharded.is_sharded({"model": root})
    assert not sharded.is_sharded({"model": plain, "value": 3})
    why = reshard.unsupported({"model": inner})
    assert why is not None and why.startswith("model.0 is FSDP1"), why
    assert (reshard.unsupported({"model": root}) or "").startswith("model is FSDP1")
    assert reshard.unsupported({"model": plain}) is None
