"""The node's snapshot slots page-locked for CUDA, so a GPU tensor's bytes go straight
into shared memory by DMA on a side stream: no pinned staging buffer, and no second
copy of every byte from the staging into the slot, which at every-step snapshots of a
large model is most of the cost (host memory bandwidth, and a thread that competes
with training for it).

``cudaHostRegister`` pins an existing mapping in place. Where it fails (an old driver, a
platform that refuses it) or ``ELASTIC_RUN_PIN_SLOTS=0`` says not to, the snapshotter
stages through pinned memory as before: correct either way, only slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os

import torch

log = logging.getLogger("elastic.state")
PIN_ENV = "ELASTIC_RUN_PIN_SLOTS"


def _address(buf: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # no export left: the slot can still close its map


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister leaves its error as the runtime's last error, which
    torch's next kernel-launch check would raise as its own: read it away through the
    runtime torch loaded (the same library, so the same last-error state)."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(path).cudaGetLastError()


class PinnedSlots:
    """Which slot mappings are registered with CUDA; one owner (the snapshotter), which
    says ``release`` before a slot's map is closed."""

    def __init__(self) -> None:
        self.enabled = os.environ.get(PIN_ENV, "1") != "0"
        self._pinned: dict[int, tuple[mmap.mmap, int]] = {}  # slot -> (its map, address)

    def ensure(self, slot: int, buf: mmap.mmap) -> bool:
        """``buf`` (slot ``slot``'s map) is page-locked for CUDA, registering it now if
        it is new; False where registration is off or failed (then: stage)."""
        have = self._pinned.get(slot)
        if have is not None and have[0] is buf:
            return True
        self.release(slot)
        if not self.enabled or not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()
        addr = _address(buf)
        rc = cudart.cudaHostRegister(addr, len(buf), 0)
        if int(rc) != 0:
            _clear_cuda_error()
            self.enabled = False
            log.info(
                "snapshots stage GPU tensors through pinned memory: cudaHostRegister of the "
                "shared-memory slot failed (%s)",
                cudart.cudaGetErrorString(rc),
            )
            return False
        self._pinned[slot] = (buf, addr)
        return True

    def release(self, slot: int) -> None:
        """Unregister slot ``slot``'s map (before it is closed or replaced)."""
        have = self._pinned.pop(slot, None)
        if have is not None and int(torch.cuda.cudart().cudaHostUnregister(have[1])) != 0:
            _clear_cuda_error()
