"""Training state as bytes: one format for shared-memory snapshots, checkpoint files and
the broadcast to new nodes.

    header (64 bytes): b"ELRSNAP1", meta length, data length, sha256 of meta+data (or 0)
    meta:  the state with every tensor replaced by (marker, dtype, shape, offset, nbytes),
           saved with torch.save and loaded with weights_only=True: no code runs on load
    data:  the tensors' bytes, each at a 64-byte aligned offset

Writing is a plain copy of each tensor into a preallocated buffer (the shared memory of
the node), which is as fast as copying state gets; everything else happens off the
training path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"ELRSNAP1"
HEADER = struct.Struct("<8sQQ32s")
HEADER_SIZE = 64
ALIGN = 64
_MARK = "__elastic_run_tensor__"


class SnapshotError(ValueError):
    """Bytes that are not a complete, intact snapshot."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise SnapshotError(f"unknown tensor dtype {name!r}")
    return dtype


@dataclass
class Packed:
    """A state split into its small skeleton and its tensors, laid out for one buffer."""

    meta: bytes
    tensors: list[torch.Tensor]
    offsets: list[int]
    data_len: int

    @property
    def size(self) -> int:
        return HEADER_SIZE + len(self.meta) + self.pad + self.data_len

    @property
    def pad(self) -> int:
        return -(HEADER_SIZE + len(self.meta)) % ALIGN

    @property
    def data_start(self) -> int:
        return HEADER_SIZE + len(self.meta) + self.pad


def pack(state: Any) -> Packed:
    tensors: list[torch.Tensor] = []
    offsets: list[int] = []
    pos = 0

    def mark(obj: torch.Tensor) -> tuple:
        nonlocal pos
        t = obj.detach()
        nbytes = t.numel() * t.element_size()
        tensors.append(t)
        offsets.append(pos)
        marker = (_MARK, str(t.dtype), list(t.shape), pos, nbytes)
        pos += nbytes + (-nbytes % ALIGN)
        return marker

    skeleton = _remap(state, lambda o: isinstance(o, torch.Tensor), mark)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return Packed(buf.getvalue(), tensors, offsets, pos)


def write_into(
    buf: mmap.mmap | memoryview | bytearray, packed: Packed, tensors: bool = True
) -> None:
    """Write header, meta and (unless ``tensors`` is False) the tensor bytes into ``buf``."""
    HEADER.pack_into(buf, 0, MAGIC, len(packed.meta), packed.data_len, bytes(32))
    start = HEADER_SIZE
    buf[start : start + len(packed.meta)] = packed.meta
    if tensors:
        copy_tensors(buf, packed, range(len(packed.tensors)))


def copy_tensors(
    buf: mmap.mmap | memoryview | bytearray, packed: Packed, which: range | list[int]
) -> None:
    """The memory copy itself: tensor bytes into their places in ``buf`` (torch's copy,
    with all intra-op threads: the fastest way when the training thread waits for it)."""
    base = packed.data_start
    for i in which:
        t = packed.tensors[i]
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        dst = torch.frombuffer(
            buf, dtype=torch.uint8, count=nbytes, offset=base + packed.offsets[i]
        )
        src = t if t.is_contiguous() else t.contiguous()
        dst.copy_(src.reshape(-1).view(torch.uint8))
        del dst


_PIECE = 32 << 20


def copy_tensors_background(
    buf: mmap.mmap,
    packed: Packed,
    which: list[int],
    threads: int,
    setup: Callable[[], None] = lambda: None,
) -> None:
    """The same copy while the training thread computes. torch's copy would start an
    OpenMP team that fights the training's own for the cores; here CPU tensors go in
    32 MiB pieces of plain memmove (no GIL held) over ``threads`` threads, each calling
    ``setup`` first (the caller lowers their priority)."""
    anchor = ctypes.c_char.from_buffer(buf)
    start = ctypes.addressof(anchor)
    pieces: list[tuple[int, int, int]] = []
    rest = []
    for i in which:
        t = packed.tensors[i]
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or not t.is_contiguous():
            rest.append(i)
            continue
        dst, src = start + packed.data_start + packed.offsets[i], t.data_ptr()
        pieces += [(dst + o, src + o, min(_PIECE, nbytes - o)) for o in range(0, nbytes, _PIECE)]
    lock = threading.Lock()

    def work() -> None:
        setup()
        while True:
            with lock:
                if not pieces:
                    return
                dst, src, n = pieces.pop()
            ctypes.memmove(dst, src, n)

    helpers = [threading.Thread(target=work, daemon=True) for _ in range(max(threads, 1) - 1)]
    for h in helpers:
        h.start()
    try:
        work()
        for h in helpers:
            h.join()
        copy_tensors(buf, packed, rest)  # GPU or strided: torch's copy, rare
    finally:
        del anchor


def parse(buf: bytes | memoryview | mmap.mmap, verify: bool = False) -> Any:
    """The state held in ``buf``; tensors are copied out, so ``buf`` may be reused."""
    view = memoryview(buf)
    if len(view) < HEADER_SIZE:
        raise SnapshotError("truncated: no header")
    magic, meta_len, data_len, stored = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise SnapshotError("not an elastic-run snapshot (bad magic)")
    meta_end = HEADER_SIZE + meta_len
    data_start = meta_end + (-meta_end % ALIGN)
    if len(view) < data_start + data_len:
        raise SnapshotError(f"truncated: {len(view)} of {data_start + data_len} bytes")
    if verify and digest(view) != stored:
        raise SnapshotError("checksum mismatch")
    try:
        skeleton = torch.load(io.BytesIO(bytes(view[HEADER_SIZE:meta_end])), weights_only=True)
    except Exception as e:  # any unpickling failure means the bytes are not ours
        raise SnapshotError(f"unreadable metadata: {e}") from None

    def build(marker: tuple) -> torch.Tensor:
        _, dtype, shape, offset, nbytes = marker
        if offset + nbytes > data_len:
            raise SnapshotError("tensor outside the data region")
        if not nbytes:
            return torch.empty(shape, dtype=_dtype(dtype))
        with warnings.catch_warnings():  # read-only bytes are fine: we copy them out
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(
                view, dtype=torch.uint8, count=nbytes, offset=data_start + offset
            )
        return raw.clone().view(_dtype(dtype)).reshape(shape)

    return _remap(skeleton, _is_marker, build)


def _is_marker(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 5 and obj[0] == _MARK


def _remap(obj: Any, is_leaf: Callable[[Any], bool], convert: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt through its dicts, lists and tuples, with ``convert`` applied to each
    leaf: tensors become markers when packing, markers become tensors when parsing."""
    if is_leaf(obj):
        return convert(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _remap(v, is_leaf, convert)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_remap(v, is_leaf, convert) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_remap(v, is_leaf, convert) for v in obj)
    return obj


def digest(buf: bytes | memoryview | mmap.mmap) -> bytes:
    """sha256 of a snapshot's meta and data (the header's checksum field excluded)."""
    view = memoryview(buf)
    _, meta_len, data_len, _ = HEADER.unpack_from(view, 0)
    meta_end = HEADER_SIZE + meta_len
    data_start = meta_end + (-meta_end % ALIGN)
    h = hashlib.sha256()
    h.update(view[HEADER_SIZE:meta_end])
    h.update(view[data_start : data_start + data_len])
    return h.digest()


def snapshot_size(buf: bytes | memoryview | mmap.mmap) -> int:
    _, meta_len, data_len, _ = HEADER.unpack_from(memoryview(buf), 0)
    meta_end = HEADER_SIZE + meta_len
    return meta_end + (-meta_end % ALIGN) + data_len


class SnapshotStore:
    """Two slots of shared memory on this node, so one complete snapshot always survives
    a write cut short by a crash. A worker crash loses nothing that was committed here.

    ``slots.hdr`` holds, per slot, (valid, step, size, sequence); a slot is marked
    invalid before it is rewritten and valid only after its bytes are complete.
    """

    SLOT = struct.Struct("<qqqq")

    def __init__(self, directory: str | Path | None) -> None:
        """``directory`` None: private memory of this process (no agent to keep it: under
        torchrun or plain python), still the source of checkpoints to disk."""
        self.dir = Path(directory) if directory is not None else None
        self._maps: dict[int, mmap.mmap] = {}
        self.pinned: set[int] = set()
        if self.dir is None:
            self._hdr = mmap.mmap(-1, 2 * self.SLOT.size)
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / "slots.hdr", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 2 * self.SLOT.size:
                os.ftruncate(fd, 2 * self.SLOT.size)
            self._hdr = mmap.mmap(fd, 2 * self.SLOT.size)
        finally:
            os.close(fd)

    def _slot(self, i: int) -> tuple[int, int, int, int]:
        return self.SLOT.unpack_from(self._hdr, i * self.SLOT.size)

    def _set(self, i: int, valid: int, step: int, size: int, seq: int) -> None:
        self.SLOT.pack_into(self._hdr, i * self.SLOT.size, valid, step, size, seq)

    def newest(self) -> tuple[int, int] | None:
        """(slot, step) of the newest complete snapshot here, if any."""
        best = None
        for i in (0, 1):
            valid, step, _, seq = self._slot(i)
            if valid == 1 and (best is None or seq > best[2]):
                best = (i, step, seq)
        return (best[0], best[1]) if best else None

    def buffer(self, i: int, size: int) -> mmap.mmap:
        """Slot ``i``'s memory, at least ``size`` bytes, marked invalid until ``commit``."""
        _, _, _, seq = self._slot(i)
        self._set(i, 0, -1, 0, seq)
        m = self._maps.get(i)
        if m is None or len(m) < size:
            if m is not None:
                m.close()
            if self.dir is None:
                self._maps[i] = mmap.mmap(-1, size)
                return self._maps[i]
            fd = os.open(self.dir / f"slot{i}.bin", os.O_RDWR | os.O_CREAT, 0o600)
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
            fd = os.open(self.dir / f"slot{i}.bin", os.O_RDWR)
            try:
                m = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self._maps[i] = m
        return memoryview(m)[:size]

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # a view is alive: unmapped at exit
                m.close()
        self._hdr.close()
