"""Page-locking the snapshot slots for CUDA: the rules that hold without a GPU (the DMA
path itself runs in tests/test_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic.contract import SnapshotPolicy
from elastic.stored import SnapshotSlots
from elastic.worker.pinning import PIN_ENV, PinnedSlots
from elastic.worker.snapshotter import Snapshotter, Stats


def test_a_slot_says_so_before_its_map_is_replaced_or_closed(tmp_path: Path) -> None:
    slots = SnapshotSlots(tmp_path)
    told: list[int] = []
    slots.on_release = told.append
    first = slots.buffer(0, 4096)
    assert slots.buffer(0, 1024) is first and told == []  # big enough: kept
    slots.buffer(0, 1 << 20)  # grown: the old map goes
    assert told == [0]
    slots.buffer(1, 4096)
    slots.close()
    assert told == [0, 0, 1]


def test_only_a_cuda_tensor_asks_for_registration(tmp_path: Path) -> None:
    pins = PinnedSlots()
    assert not pins.ensure(0, SnapshotSlots(tmp_path).buffer(0, 4096), torch.device("cpu"))
    assert pins.enabled and pins._driver is None  # never loaded the driver for it


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule for a machine without CUDA")
def test_without_a_cuda_driver_snapshots_stage_and_say_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    slots = SnapshotSlots(tmp_path)
    pins = PinnedSlots()
    with caplog.at_level("WARNING", logger="elastic.state"):
        assert not pins.ensure(0, slots.buffer(0, 4096), torch.device("cuda", 0))
        assert not pins.ensure(1, slots.buffer(1, 4096), torch.device("cuda", 0))
    assert not pins.enabled
    assert [r.getMessage() for r in caplog.records if "stage GPU tensors" in r.getMessage()]
    assert len(caplog.records) == 1
    pins.release(0)  # nothing to release: no call into CUDA


def test_the_switch_turns_registration_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PIN_ENV, "0")
    assert not PinnedSlots().enabled
    monkeypatch.delenv(PIN_ENV)
    assert PinnedSlots().enabled


def test_the_snapshotter_unregisters_its_slots_before_they_are_unmapped(tmp_path: Path) -> None:
    snap = Snapshotter(SnapshotPolicy(every=1), str(tmp_path), 0, Stats())
    assert snap.slots is not None
    assert snap.slots.on_release == snap._pins.release
    told: list[int] = []
    snap._pins.release = told.append  # type: ignore[method-assign]
    snap.slots.on_release = snap._pins.release
    w = torch.ones(1024)
    snap.take({"w": w}, 1, {w.data_ptr()}, set(), lambda: False)
    snap.close()  # State.close(): another State in this process maps them again
    assert told == [0] and snap.slots is None
