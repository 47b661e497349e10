"""Training state as bytes: one format for shared-memory snapshots, checkpoint files and
the broadcast to new nodes (the layout is in ``elastic.stored``).

The meta part is the state with every tensor replaced by (marker, dtype, shape, offset,
nbytes), saved with torch.save and loaded with weights_only=True: no code runs on load.

Writing is a plain copy of each tensor into a preallocated buffer (the shared memory of
the node), which is as fast as copying state gets; everything else happens off the
training path.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic import stored
from elastic.stored import ALIGN, HEADER, HEADER_SIZE, MAGIC, Layout, SnapshotError

_MARK = "__elastic_run_tensor__"


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


def to_bytes(state: Any) -> memoryview:
    """``state`` in the snapshot format, in a buffer of its own (to send it to a peer)."""
    packed = pack(state)
    buf = bytearray(packed.size)
    write_into(buf, packed)
    return memoryview(buf)


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
    sources: dict[int, torch.Tensor] | None = None,
) -> None:
    """The same copy while the training thread computes. torch's copy would start an
    OpenMP team that fights the training's own for the cores; here CPU tensors go in
    32 MiB pieces of plain memmove (no GIL held) over ``threads`` threads, each calling
    ``setup`` first (the caller lowers their priority). ``sources``: host copies to read
    instead of a tensor (the pinned staging of a GPU tensor)."""
    sources = sources or {}
    anchor = ctypes.c_char.from_buffer(buf)
    start = ctypes.addressof(anchor)
    pieces: list[tuple[int, int, int]] = []
    rest = []
    for i in which:
        t = sources.get(i, packed.tensors[i])
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
    layout = Layout.of(view)
    if verify:
        stored.verify(view)
    try:
        skeleton = torch.load(
            io.BytesIO(bytes(view[HEADER_SIZE : layout.meta_end])), weights_only=True
        )
    except Exception as e:  # any unpickling failure means the bytes are not ours
        raise SnapshotError(f"unreadable metadata: {e}") from None

    def build(marker: tuple[Any, ...]) -> torch.Tensor:
        _, dtype, shape, offset, nbytes = marker
        if offset + nbytes > layout.data_len:
            raise SnapshotError("tensor outside the data region")
        if not nbytes:
            return torch.empty(shape, dtype=_dtype(dtype))
        with warnings.catch_warnings():  # read-only bytes are fine: we copy them out
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(
                view, dtype=torch.uint8, count=nbytes, offset=layout.data_start + offset
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
