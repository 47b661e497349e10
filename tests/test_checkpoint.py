"""Checkpoint files and State restores: corrupt, truncated, mismatched, disk full, read-only."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import torch
from faults import small_tmpfs

from elastic import CheckpointMismatchError, SnapshotPolicy, State
from elastic.agent.breakdown import save_at_breakdown
from elastic.contract import NODE_DIR_ENV
from elastic.stored import CheckpointDir, SnapshotSlots, path_for
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


def snapshot_in(node_dir: Path, step: int, floats: int = 64) -> None:
    """A worker's complete snapshot of ``step`` in the node's shared memory."""
    packed = snapshot.pack(
        {
            "version": 1,
            "step": step,
            "values": {"step": step},
            "objects": {"w": {"t": torch.full((floats,), float(step))}},
        }
    )
    slots = SnapshotSlots(node_dir)
    slot = slots.target()
    snapshot.write_into(slots.buffer(slot, packed.size), packed)
    slots.commit(slot, step, packed.size)
    slots.close()


def test_save_at_breakdown_writes_only_a_newer_state(tmp_path: Path) -> None:
    node, ckpt = tmp_path / "node", tmp_path / "ckpt"
    node.mkdir()
    assert save_at_breakdown(node, str(ckpt), 3) is None  # no snapshot: nothing to say
    snapshot_in(node, 7)
    said = save_at_breakdown(node, None, 3)
    assert said is not None and "step 7" in said and "lost" in said
    # leaving a job whose other nodes trained with it: nothing is lost, and it says why
    said = save_at_breakdown(node, None, 3, "the other nodes of round 4 hold what it trained")
    assert said is not None and "step 7" in said and "lost" not in said
    assert "round 4 hold" in said
    said = save_at_breakdown(node, str(ckpt), 3)
    assert said is not None and "saved the newest state (step 7" in said
    step, raw = CheckpointDir(ckpt).newest_valid()
    assert step == 7 and snapshot.parse(raw)["objects"]["w"]["t"][0] == 7.0
    said = save_at_breakdown(node, str(ckpt), 3)
    assert said is not None and "already in" in said
    assert CheckpointDir(ckpt).steps() == [7]


def test_save_at_breakdown_to_a_full_disk_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir()
    with small_tmpfs(tmp_path / "disk", "200k") as disk:
        assert CheckpointDir(disk).write(3, blob(3)).ok
        snapshot_in(node, 9, floats=100_000)  # 400 kB: does not fit
        said = save_at_breakdown(node, str(disk), 3)
        assert said is not None and "could not save the newest state (step 9)" in said, said
        assert "No space left" in said
        assert CheckpointDir(disk).newest_valid()[0] == 3
        assert not list(disk.glob("*.tmp"))


@pytest.mark.parametrize("in_optimizer", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_frozen_tensors_are_copied_once_per_slot_and_again_once_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_optimizer: bool, fused: bool
) -> None:
    """A frozen backbone (outside the optimizer, or in it with no gradient): each slot
    gets it once, and again after an in-place write; a restore sees every write, also
    those of a fused optimizer, which does not count them in Tensor._version."""
    monkeypatch.setenv(NODE_DIR_ENV, str(tmp_path))
    torch.manual_seed(0)
    backbone, head = torch.nn.Linear(512, 512), torch.nn.Linear(512, 4)
    backbone.requires_grad_(False)
    model = torch.nn.Sequential(backbone, head)
    params = (model if in_optimizer else head).parameters()
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(params, lr=0.1, fused=True)
        if fused
        else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    )
    s = State(model=model, optimizer=opt, snapshot_policy=SnapshotPolicy(every=1))
    frozen = backbone.weight.nbytes + backbone.bias.nbytes

    def step() -> int:
        model(torch.randn(2, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
        s.commit()
        s.flush()
        return s.stats.unchanged_bytes

    assert [step(), step(), step(), step()] == [0, 0, frozen, frozen]
    with torch.no_grad():
        backbone.weight.mul_(2)  # an in-place write: the next snapshot in each slot copies it
    assert [step(), step(), step()] == [backbone.bias.nbytes, backbone.bias.nbytes, frozen]
    s.close()
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    s2 = State(model=fresh, snapshot_policy=SnapshotPolicy(every=1))
    assert s2.restore() and s2.step == 7
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
