"""Checkpoint files and State restores: corrupt, truncated, mismatched, disk full, read-only."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import torch
from faults import small_tmpfs

from elastic import CheckpointMismatchError, SnapshotPolicy, State
from elastic.contract import NODE_DIR_ENV
from elastic.stored import CheckpointDir, path_for
from elastic.worker import snapshot


def blob(step: int) -> memoryview:
    packed = snapshot.pack(
        {
            "version": 1,
            "step": step,
            "values": {"step": step},
            "objects": {"w": {"t": torch.full((64,), float(step))}},
        }
    )
    buf = bytearray(packed.size)
    snapshot.write_into(buf, packed)
    return memoryview(buf)


def test_corrupt_and_truncated_checkpoints_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = CheckpointDir(tmp_path, keep=5)
    for step in (1, 2, 3):
        assert d.write(step, blob(step)).ok
    newest = path_for(tmp_path, 3)
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF
    newest.write_bytes(data)
    middle = path_for(tmp_path, 2)
    middle.write_bytes(middle.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING):
        step, raw = d.newest_valid()
    assert step == 1
    assert snapshot.parse(raw)["objects"]["w"]["t"][0] == 1.0
    assert "checksum mismatch" in caplog.text and "truncated" in caplog.text
    assert not list(tmp_path.glob("*.tmp"))


def test_only_the_newest_k_are_kept(tmp_path: Path) -> None:
    d = CheckpointDir(tmp_path, keep=3)
    for step in range(1, 6):
        d.write(step, blob(step))
    assert d.steps() == [5, 4, 3]


def trained(shape: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, shape)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def test_restore_from_a_checkpoint_dir_and_mismatches_named(tmp_path: Path) -> None:
    policy = SnapshotPolicy(every=1, checkpoint_every=1, keep=2, checkpoint_dir=str(tmp_path))
    m, opt = trained()
    s = State(model=m, optimizer=opt, snapshot_policy=policy, epoch=4)
    s.commit()
    s.close()
    assert CheckpointDir(tmp_path).steps() == [1]
    m2, opt2 = trained()
    with torch.no_grad():
        m2.weight.zero_()
    s2 = State(model=m2, optimizer=opt2, snapshot_policy=policy, epoch=0)
    assert s2.restore() and (s2.step, s2.epoch) == (1, 4)
    assert torch.equal(m2.weight, m.weight)
    wrong_shape, opt3 = trained(shape=3)
    with pytest.raises(CheckpointMismatchError, match=r"weight: saved \(2, 4\), model \(3, 4\)"):
        State(model=wrong_shape, optimizer=opt3, snapshot_policy=policy).restore()
    other = torch.nn.Sequential(torch.nn.Linear(4, 2))
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \['0.bias', '0.weight'\]"):
        State(model=other, snapshot_policy=policy).restore()
    with pytest.raises(CheckpointMismatchError, match="saved state has no"):
        State(
            model=m2, optimizer=opt2, extra=torch.nn.Linear(1, 1), snapshot_policy=policy
        ).restore()


def test_snapshot_is_the_committed_state_although_copied_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NODE_DIR_ENV, str(tmp_path))
    m = torch.nn.Linear(2048, 2048)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    s = State(model=m, optimizer=opt, snapshot_policy=SnapshotPolicy(every=1))
    m(torch.randn(8, 2048)).sum().backward()
    opt.step()
    s.commit()
    committed = m.weight.detach().clone()
    opt.step()  # changes the weights: must wait for the copy of the committed ones
    s.close()
    m2 = torch.nn.Linear(2048, 2048)
    s2 = State(
        model=m2,
        optimizer=torch.optim.SGD(m2.parameters(), lr=1.0),
        snapshot_policy=SnapshotPolicy(every=1),
    )
    assert s2.restore()
    assert torch.equal(m2.weight, committed)
    assert not torch.equal(committed, m.weight)


def test_full_disk_keeps_the_last_good_checkpoint_and_training_going(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "600k") as disk:
        policy = SnapshotPolicy(every=1, checkpoint_every=1, keep=5, checkpoint_dir=str(disk))
        m = torch.nn.Linear(256, 256)  # ~257 kB of state per checkpoint: two fit, not three
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        s = State(model=m, optimizer=opt, snapshot_policy=policy)
        for _ in range(4):
            s.commit()
            s.flush()
        assert s.stats.checkpoints == 2 and s.stats.checkpoint_failures == 2
        assert CheckpointDir(disk).steps() == [2, 1]
        assert CheckpointDir(disk).newest_valid()[0] == 2
        assert not list(disk.glob("*.tmp"))
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        s.commit()  # read-only now: this one fails too, and nothing is lost
        s.flush()
        assert s.stats.checkpoint_failures == 3
        assert CheckpointDir(disk).newest_valid()[0] == 2
        s.close()
