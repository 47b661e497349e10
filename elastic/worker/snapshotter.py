"""Taking snapshots: the state copied into the node's shared memory, off the training path
where it can be, and every so often written to a checkpoint file in the background.

Parameters and optimizer state change only inside ``optimizer.step()``, so their copy
runs in a background thread (GPU tensors: by DMA on a side stream, straight into the
page-locked slot where CUDA allows it) while the next forward/backward computes, and
the next ``optimizer.step()`` waits for whatever is left (a pre-step hook; for a GPU
copy the device's stream waits, not the training thread). The rest (buffers,
schedulers, samplers, plain values) is small and copied before ``commit()`` returns.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from elastic.contract import SnapshotPolicy
from elastic.stored import CheckpointDir, SnapshotSlots, WriteResult
from elastic.worker import progress, snapshot
from elastic.worker.pinning import PinnedSlots

log = logging.getLogger("elastic.state")


@dataclass
class Stats:
    """What ``State`` did so far (``state.stats``)."""

    snapshots: int = 0
    snapshot_seconds: float = 0.0  # the last snapshot's time on the training thread
    snapshot_bytes: int = 0
    unchanged_bytes: int = 0  # the last snapshot's bytes its slot held already: not copied
    blocked_seconds: float = 0.0  # all the time the training thread waited for snapshots
    checkpoints: int = 0
    checkpoint_failures: int = 0
    checkpoint_seconds: float = 0.0
    restore_seconds: float = 0.0
    restore_bytes: int = 0
    restored_step: int = -1


def _idle_priority() -> None:
    """Run this (the copy) thread only on otherwise idle CPU: training threads keep their
    cores, and optimizer.step() waits for whatever copy is left."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


class SlotTensors:
    """The frozen tensors whose bytes a slot holds, with their version counters then: one
    not written since is not copied again. Every in-place torch op bumps
    ``Tensor._version`` (shared with ``detach()``ed views); holding the tensors keeps
    their memory from going to another tensor at the same address. Only parameters that
    take no gradient qualify: fused optimizer kernels (``Adam(fused=True)``) and some
    library kernels (batch-norm statistics) write without bumping the counter, and never
    touch those. Writes through ``.data`` bypass it too (as they bypass autograd):
    docs/reference.md asks scripts to write frozen tensors under ``torch.no_grad()``."""

    def __init__(self, buf: object) -> None:
        self.buf = buf  # the slot's mapping: a new one (grown, remapped) holds nothing
        self.tensors: dict[int, tuple[torch.Tensor, int]] = {}  # by place in the slot

    @staticmethod
    def versions(packed: snapshot.Packed, which: list[int]) -> dict[int, tuple[torch.Tensor, int]]:
        start = packed.data_start
        return {
            start + packed.offsets[i]: (packed.tensors[i], packed.tensors[i]._version)
            for i in which
        }

    def keep_only(self, packed: snapshot.Packed, eligible: list[int]) -> None:
        """Forget every tensor that is not frozen now: it may have been written by a
        kernel that does not count, and frozen again later."""
        frozen_ptrs = {packed.tensors[i].data_ptr() for i in eligible}
        self.tensors = {k: v for k, v in self.tensors.items() if v[0].data_ptr() in frozen_ptrs}

    def unchanged(self, buf: object, packed: snapshot.Packed) -> set[int]:
        """The tensors whose bytes are in the slot already, at their place."""
        if buf is not self.buf:
            return set()
        same = set()
        start = packed.data_start
        for i, t in enumerate(packed.tensors):
            was = self.tensors.get(start + packed.offsets[i])
            if was is None or t.nbytes == 0:
                continue
            old, version = was
            if (
                old.data_ptr() == t.data_ptr()
                and version == t._version
                and old.dtype == t.dtype
                and old.shape == t.shape
                and old.stride() == t.stride()
                and old.device == t.device
            ):
                same.add(i)
        return same


class BackgroundWriter:
    """Writes one checkpoint at a time in a thread; a request while busy is skipped."""

    def __init__(self, target: CheckpointDir, done: Callable[[WriteResult], None]) -> None:
        self.target = target
        self._done = done
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, data: memoryview, release: Callable[[], None]) -> bool:
        """Write in the background; ``release`` runs once ``data`` is no longer read."""
        if self.busy:
            return False

        def run() -> None:
            try:
                result = self.target.write(step, data)
            finally:
                release()
            self._done(result)

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


class Snapshotter:
    """The node's snapshot slots (local rank 0 writes them) and the checkpoint writer
    (global rank 0 writes files)."""

    def __init__(
        self,
        policy: SnapshotPolicy,
        node_dir: str | None,
        local_rank: int,
        stats: Stats,
    ) -> None:
        self.policy = policy
        self.stats = stats
        self._copy: threading.Thread | None = None
        self._host_done = threading.Event()  # the copy no longer reads host tensors
        self._host_done.set()
        self._device_done: list[tuple[torch.device, torch.cuda.Event]] = []  # copies in flight
        self._pinned: dict[torch.device, torch.Tensor] = {}  # staging, per device
        self._pins = PinnedSlots()  # slots CUDA copies into directly
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._count = 0
        self._kept: dict[int, SlotTensors] = {}  # per slot: the tensors its bytes hold
        self.slots: SnapshotSlots | None = None
        if local_rank == 0 and (node_dir or policy.checkpoint_dir):
            try:
                self.slots = SnapshotSlots(node_dir)
                self.slots.on_release = self._pins.release
            except OSError as e:
                log.warning("no shared-memory snapshots (%s): %s", node_dir, e)
        self._writer: BackgroundWriter | None = None
        if policy.checkpoint_dir:
            target = CheckpointDir(policy.checkpoint_dir, policy.keep)
            self._writer = BackgroundWriter(target, self._checkpoint_done)

    def take(
        self,
        state: dict[str, Any],
        step: int,
        stable: set[int],
        frozen: set[int],
        checkpoint: Callable[[], bool],
    ) -> None:
        """Snapshot ``state`` as of ``step``; tensors whose storage is in ``stable`` (they
        change only in optimizer.step()) are copied in the background, those in
        ``frozen`` (parameters that take no gradient) only if written since the slot
        took them. ``checkpoint()`` says, once the copy is complete, whether this rank
        writes it to disk too."""
        if self.slots is None:
            return
        self.wait_copy()
        started = time.perf_counter()
        packed = snapshot.pack(state)
        slots = self.slots
        slot = slots.target()
        try:
            buf = slots.buffer(slot, packed.size)
        except OSError as e:
            log.error("snapshot to shared memory failed (%s); training continues", e)
            self.stats.checkpoint_failures += 1
            progress.checkpoint(False, 0.0, 0)
            return
        snapshot.write_into(buf, packed, tensors=False)
        later = [i for i, t in enumerate(packed.tensors) if t.data_ptr() in stable]
        deferred = set(later)
        now = [i for i in range(len(packed.tensors)) if i not in deferred]
        eligible = [i for i, t in enumerate(packed.tensors) if t.data_ptr() in frozen]
        for other in self._kept.values():  # trainable now: it may change unseen
            other.keep_only(packed, eligible)
        kept = self._kept.pop(slot, None)  # void while the slot is rewritten
        same = kept.unchanged(buf, packed) if kept is not None else set()
        snapshot.copy_tensors(buf, packed, [i for i in now if i not in same])
        record = SlotTensors(buf)  # takes effect once the whole copy is done
        record.tensors = SlotTensors.versions(packed, eligible)  # now: optimizer.step() waits
        self.stats.unchanged_bytes = sum(packed.tensors[i].nbytes for i in same)
        later = [i for i in later if i not in same]
        on_gpu = [i for i in later if packed.tensors[i].is_cuda]
        direct = bool(on_gpu) and self._pins.ensure(slot, buf, packed.tensors[on_gpu[0]].device)
        staged = self._stage(packed, on_gpu, buf if direct else None)
        if direct:
            on_gpu = []  # their bytes land in the slot: nothing left to copy on the host
        on_host = [i for i in later if not packed.tensors[i].is_cuda]
        self._host_done.clear()
        threads = torch.get_num_threads()

        def finish() -> None:
            try:  # never leave optimizer.step() waiting, whatever happens to the copy
                _idle_priority()
                snapshot.copy_tensors_background(buf, packed, on_host, threads, _idle_priority)
            finally:
                self._host_done.set()
            for _, event in self._device_done:
                event.synchronize()
            snapshot.copy_tensors_background(
                buf, packed, on_gpu, threads, _idle_priority, sources=staged
            )
            staged.clear()  # views of the slot (direct copies) hold its map open
            self._kept[slot] = record
            slots.commit(slot, step, packed.size)
            self.stats.snapshots += 1
            self.stats.snapshot_bytes = packed.size
            self._count += 1
            if checkpoint():
                self._checkpoint(slot, step)

        if later:
            self._copy = threading.Thread(target=finish, name="snapshot-copy", daemon=True)
            self._copy.start()
        else:
            finish()
        took = time.perf_counter() - started
        self.stats.snapshot_seconds = took
        self.stats.blocked_seconds += took
        progress.snapshot(took, packed.size)

    def keep(self, step: int, blob: memoryview) -> None:
        """Put a state this rank loaded from elsewhere (another node's, sent over the
        process group, or a checkpoint file) in its node's slot, unless the slot holds it
        already: if its sender is lost next, the job still has it."""
        slots = self.slots
        newest = slots.newest() if slots is not None else None
        if slots is None or (newest is not None and newest[1] >= step):
            return
        self.wait_copy()
        slot = slots.target()
        try:
            buf = slots.buffer(slot, len(blob))
        except OSError as e:
            log.error("could not keep the restored state in shared memory (%s)", e)
            return
        self._kept.pop(slot, None)
        buf[: len(blob)] = blob
        slots.commit(slot, step, len(blob))

    def due_checkpoint(self, stopping: bool) -> bool:
        """The snapshot just counted goes to disk: every ``checkpoint_every``-th, and the
        last one before a stop."""
        return self._writer is not None and (
            stopping or self._count % max(self.policy.checkpoint_every, 1) == 0
        )

    def _checkpoint(self, slot: int, step: int) -> None:
        assert self._writer is not None and self.slots is not None
        slots = self.slots
        slots.pinned.add(slot)
        if not self._writer.submit(step, slots.read(slot), lambda: slots.pinned.discard(slot)):
            slots.pinned.discard(slot)

    def _checkpoint_done(self, result: WriteResult) -> None:
        progress.checkpoint(result.ok, result.seconds, result.nbytes)
        if result.ok:
            self.stats.checkpoints += 1
            self.stats.checkpoint_seconds = result.seconds
            log.info(
                "checkpoint of step %d written (%.2fs, %d bytes)",
                result.step,
                result.seconds,
                result.nbytes,
            )
        else:
            self.stats.checkpoint_failures += 1
            log.error(
                "checkpoint of step %d failed, training goes on from memory snapshots: %s",
                result.step,
                result.error,
            )

    def _stage(
        self, packed: snapshot.Packed, which: list[int], slot: mmap.mmap | None
    ) -> dict[int, torch.Tensor]:
        """Start copying GPU tensors to the host, on a side stream per device that first
        waits for the work queued so far (the step just taken), so the copy overlaps the
        next forward/backward: into ``slot`` at their places when it is page-locked, else
        into pinned staging. Returns the host views, by tensor index."""
        staged: dict[int, torch.Tensor] = {}
        self._device_done = []
        by_device: dict[torch.device, list[int]] = {}
        for i in which:
            by_device.setdefault(packed.tensors[i].device, []).append(i)
        for device, indices in by_device.items():
            sizes = [packed.tensors[i].numel() * packed.tensors[i].element_size() for i in indices]
            pinned = self._pinned.get(device)
            if slot is None and (pinned is None or pinned.numel() < sum(sizes)):
                pinned = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
                self._pinned[device] = pinned
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            offset = 0
            with torch.cuda.stream(stream):
                for i, n in zip(indices, sizes, strict=True):
                    t = packed.tensors[i]
                    src = t if t.is_contiguous() else t.contiguous()
                    if slot is not None:
                        at = packed.data_start + packed.offsets[i]
                        view = torch.frombuffer(slot, dtype=torch.uint8, count=n, offset=at)
                    else:
                        assert pinned is not None
                        view = pinned[offset : offset + n]
                    view.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
                    staged[i] = view
                    offset += n
            done = torch.cuda.Event()
            done.record(stream)
            self._device_done.append((device, done))
        return staged

    @property
    def copying(self) -> bool:
        """A snapshot's copy is still running (it competes with the step now starting)."""
        return self._copy is not None and self._copy.is_alive()

    def wait_for_step(self) -> None:
        """Before optimizer.step() changes the tensors in place: wait only for what still
        reads them, not for the rest. A GPU copy in flight is waited for by the device's
        stream (the optimizer's kernels queue behind it), not by this thread."""
        for device, event in self._device_done:
            if not event.query():
                torch.cuda.current_stream(device).wait_event(event)
        if self._host_done.is_set():
            return
        started = time.perf_counter()
        self._host_done.wait()
        waited = time.perf_counter() - started
        self.stats.blocked_seconds += waited
        progress.waited(waited)

    def wait_copy(self) -> None:
        """Block until the background copy in flight (if any) is complete."""
        copy = self._copy
        if copy is None:
            return
        started = time.perf_counter()
        copy.join()
        self._copy = None
        waited = time.perf_counter() - started
        self.stats.blocked_seconds += waited
        progress.waited(waited)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the copy and the checkpoint write in progress, if any."""
        self.wait_copy()
        if self._writer is not None:
            self._writer.wait(timeout)

    def close(self) -> None:
        """Finish, then let go of the slots (unregistered from CUDA first): another
        State in this process maps and registers them again."""
        self.flush()
        slots, self.slots = self.slots, None
        if slots is not None:
            slots.close()


def frozen_storage(modules: Iterable[torch.nn.Module]) -> set[int]:
    """Storage of the parameters that take no gradient (a frozen backbone)."""
    return {p.data_ptr() for m in modules for p in m.parameters() if not p.requires_grad}


def stable_storage(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storage of the tensors that change only inside optimizer.step(): parameters and
    their optimizer state."""
    ptrs = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                ptrs.add(p.data_ptr())
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        ptrs.add(v.data_ptr())
    return ptrs
