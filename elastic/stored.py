"""Snapshot bytes at rest: their header and checksum, the node's two shared-memory slots,
and checkpoint files. No torch here: workers write these (``elastic.worker``), and the
agent reads the newest snapshot back when it must save it to disk on its own.

A snapshot (``elastic.worker.snapshot`` makes and parses them)::

    header (64 bytes): b"ELRSNAP1", meta length, data length, sha256 of meta+data (or 0)
    meta:  the state's skeleton, tensors replaced by markers (torch.save, weights only)
    data:  the tensors' bytes, each at a 64-byte aligned offset

Checkpoint files are snapshots with the checksum stamped, written as ``.tmp``, fsynced
and renamed into place, so a reader sees a complete file or none; the newest ``keep``
stay. A corrupt or truncated file is skipped, with a warning, for the previous good one.
A full disk or a read-only directory costs one failed checkpoint, never an older one.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("elastic.checkpoint")

MAGIC = b"ELRSNAP1"
HEADER = struct.Struct("<8sQQ32s")
HEADER_SIZE = 64
ALIGN = 64


class SnapshotError(ValueError):
    """Bytes that are not a complete, intact snapshot."""


@dataclass(frozen=True)
class Layout:
    """Where the parts of a snapshot are, read from its header."""

    meta_len: int
    data_len: int
    checksum: bytes

    @property
    def meta_end(self) -> int:
        return HEADER_SIZE + self.meta_len

    @property
    def data_start(self) -> int:
        return self.meta_end + (-self.meta_end % ALIGN)

    @property
    def size(self) -> int:
        return self.data_start + self.data_len

    @classmethod
    def of(cls, buf: bytes | memoryview | mmap.mmap) -> Layout:
        view = memoryview(buf)
        if len(view) < HEADER_SIZE:
            raise SnapshotError("truncated: no header")
        magic, meta_len, data_len, checksum = HEADER.unpack_from(view, 0)
        if magic != MAGIC:
            raise SnapshotError("not an elastic-run snapshot (bad magic)")
        layout = cls(meta_len, data_len, checksum)
        if len(view) < layout.size:
            raise SnapshotError(f"truncated: {len(view)} of {layout.size} bytes")
        return layout


def digest(buf: bytes | memoryview | mmap.mmap) -> bytes:
    """sha256 of a snapshot's meta and data (the header's checksum field excluded)."""
    view = memoryview(buf)
    layout = Layout.of(view)
    h = hashlib.sha256()
    h.update(view[HEADER_SIZE : layout.meta_end])
    h.update(view[layout.data_start : layout.size])
    return h.digest()


def verify(buf: bytes | memoryview | mmap.mmap) -> None:
    """Raise SnapshotError unless ``buf`` is complete and its checksum matches."""
    if digest(buf) != Layout.of(buf).checksum:
        raise SnapshotError("checksum mismatch")


# -- the node's shared-memory slots -----------------------------------------------------------
class SnapshotSlots:
    """Two slots of shared memory on this node, so one complete snapshot always survives
    a write cut short by a crash. A worker crash loses nothing that was committed here.

    ``slots.hdr`` holds, per slot, (valid, step, size, sequence); a slot is marked
    invalid before it is rewritten and valid only after its bytes are complete.
    """

    SLOT = struct.Struct("<qqqq")

    def __init__(self, directory: str | Path | None, create: bool = True) -> None:
        """``directory`` None: private memory of this process (no agent to keep it: under
        torchrun or plain python), still the source of checkpoints to disk. ``create``
        False: only open what a worker made (FileNotFoundError if there is nothing)."""
        self.dir = Path(directory) if directory is not None else None
        self._maps: dict[int, mmap.mmap] = {}
        self.pinned: set[int] = set()
        # told a slot's index before its map is closed (the worker unregisters it from CUDA)
        self.on_release: Callable[[int], None] = lambda i: None
        size = 2 * self.SLOT.size
        if self.dir is None:
            self._hdr = mmap.mmap(-1, size)
            return
        if create:
            self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / "slots.hdr", os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if os.fstat(fd).st_size < size:
                if not create:
                    raise FileNotFoundError(f"{self.dir / 'slots.hdr'} is incomplete")
                os.ftruncate(fd, size)
            self._hdr = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @staticmethod
    def present(directory: str | Path | None) -> bool:
        return directory is not None and (Path(directory) / "slots.hdr").exists()

    def _slot(self, i: int) -> tuple[int, int, int, int]:
        valid, step, size, seq = self.SLOT.unpack_from(self._hdr, i * self.SLOT.size)
        return valid, step, size, seq

    def _set(self, i: int, valid: int, step: int, size: int, seq: int) -> None:
        self.SLOT.pack_into(self._hdr, i * self.SLOT.size, valid, step, size, seq)

    def newest(self) -> tuple[int, int] | None:
        """(slot, step) of the newest complete snapshot here, if any."""
        best: tuple[int, int, int] | None = None
        for i in (0, 1):
            valid, step, _, seq = self._slot(i)
            if valid == 1 and (best is None or seq > best[2]):
                best = (i, step, seq)
        return (best[0], best[1]) if best else None

    def _path(self, i: int) -> Path:
        assert self.dir is not None
        return self.dir / f"slot{i}.bin"

    def buffer(self, i: int, size: int) -> mmap.mmap:
        """Slot ``i``'s memory, at least ``size`` bytes, marked invalid until ``commit``.
        OSError when the memory is not there (a full /dev/shm)."""
        _, _, _, seq = self._slot(i)
        self._set(i, 0, -1, 0, seq)
        m = self._maps.get(i)
        if m is not None and len(m) >= size:
            return m
        if m is not None:
            self.on_release(i)
            with contextlib.suppress(BufferError):
                m.close()
        if self.dir is None:
            m = mmap.mmap(-1, size)
        else:
            fd = os.open(self._path(i), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, size)  # fail now (ENOSPC), not on a page fault
                m = mmap.mmap(fd, max(size, os.fstat(fd).st_size))
            finally:
                os.close(fd)
        self._maps[i] = m
        return m

    def commit(self, i: int, step: int, size: int) -> None:
        seq = max(self._slot(0)[3], self._slot(1)[3]) + 1
        self._set(i, 1, step, size, seq)

    def target(self) -> int:
        """The slot to write next: not pinned by a checkpoint write, not the newest if
        that can be avoided (so the newest stays complete while the other is written)."""
        newest = self.newest()
        order = [1 - newest[0], newest[0]] if newest else [0, 1]
        for i in order:
            if i not in self.pinned:
                return i
        raise RuntimeError("both snapshot slots are pinned")

    def read(self, i: int) -> memoryview:
        """A view of slot ``i``'s bytes (map it first if another process wrote it)."""
        _, _, size, _ = self._slot(i)
        m = self._maps.get(i)
        if m is None:
            fd = os.open(self._path(i), os.O_RDWR)
            try:
                m = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self._maps[i] = m
        return memoryview(m)[:size]

    def close(self) -> None:
        for i, m in self._maps.items():
            self.on_release(i)
            with contextlib.suppress(BufferError):  # a view is alive: unmapped at exit
                m.close()
        self._hdr.close()


# -- checkpoint files ---------------------------------------------------------------------------
_NAME = re.compile(r"^step-(\d{12})\.elr$")


def path_for(directory: Path, step: int) -> Path:
    return directory / f"step-{step:012d}.elr"


@dataclass
class WriteResult:
    step: int
    ok: bool
    seconds: float
    nbytes: int
    error: str = ""


class CheckpointDir:
    """The checkpoint files of one job in one directory."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least one checkpoint must be kept")
        self.dir = Path(directory)
        self.keep = keep

    def steps(self) -> list[int]:
        """Steps with a checkpoint file here, newest first (not yet verified)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        found = [int(m.group(1)) for n in names if (m := _NAME.match(n))]
        return sorted(found, reverse=True)

    def newest_valid(self, below: int | None = None) -> tuple[int, bytes] | None:
        """(step, bytes) of the newest intact checkpoint (optionally below a step)."""
        for step in self.steps():
            if below is not None and step >= below:
                continue
            path = path_for(self.dir, step)
            try:
                data = path.read_bytes()
                verify(data)
            except (OSError, SnapshotError) as e:
                log.warning("skipping checkpoint %s: %s", path, e)
                continue
            return step, data
        return None

    def write(self, step: int, data: memoryview) -> WriteResult:
        """Write ``data`` (snapshot bytes, checksum not yet stamped) as the step's file."""
        started = time.monotonic()
        final = path_for(self.dir, step)
        tmp = final.with_name(final.name + ".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            layout = Layout.of(data)
            header = bytearray(HEADER_SIZE)
            HEADER.pack_into(header, 0, MAGIC, layout.meta_len, layout.data_len, digest(data))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, header)
                _write_all(fd, data[HEADER_SIZE : layout.size])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
        except (OSError, SnapshotError) as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return WriteResult(
                step, False, time.monotonic() - started, 0, f"{type(e).__name__}: {e}"
            )
        self.prune()
        return WriteResult(step, True, time.monotonic() - started, layout.size)

    def prune(self) -> None:
        for step in self.steps()[self.keep :]:
            with contextlib.suppress(OSError):
                path_for(self.dir, step).unlink()


def _write_all(fd: int, data: memoryview | bytearray) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view[: 1 << 26])
        view = view[n:]


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
