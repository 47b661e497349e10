"""The node's snapshot slots page-locked for CUDA, so a GPU tensor's bytes go straight
into shared memory by DMA on a side stream: no pinned staging buffer, and no second
copy of every byte from the staging into the slot, which at every-step snapshots of a
large model is most of the cost (host memory bandwidth, and a thread that competes
with training for it).

The driver's ``cuMemHostRegister`` pins an existing mapping in place (portable: for
every context). The driver API and not the runtime's ``cudaHostRegister``: a failed
runtime call stays behind as the runtime's last error, which torch's next kernel-launch
check raises as its own (seen on an H200: "resource already mapped" from Adam's
kernels); a driver call only returns its error. Where it fails (an old driver, memory
already registered, a platform that refuses it) or ``ELASTIC_RUN_PIN_SLOTS=0`` says not
to, the snapshotter stages through pinned memory: correct either way, only slower.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from typing import Any

import torch

log = logging.getLogger("elastic.state")
PIN_ENV = "ELASTIC_RUN_PIN_SLOTS"
_PORTABLE = 0x01  # CU_MEMHOSTREGISTER_PORTABLE: pinned for every context


def _address(buf: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # no export left: the slot can still close its map


class _Driver:
    """The few CUDA driver calls registration needs, through ctypes."""

    def __init__(self) -> None:
        self.lib: Any = ctypes.CDLL("libcuda.so.1")
        self.lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
        ]
        self.lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
        self.lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def error(self, rc: int) -> str:
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorString(rc, ctypes.byref(text)) != 0 or not text.value:
            return f"CUDA driver error {rc}"
        return f"{text.value.decode()} ({rc})"

    def register(self, addr: int, size: int, device: int) -> int:
        """cuMemHostRegister in a context: the thread's own, else the device's primary
        one (torch's) pushed for the call."""
        current = ctypes.c_void_p()
        rc = self.lib.cuCtxGetCurrent(ctypes.byref(current))
        if rc != 0:
            return int(rc)
        if current.value:
            return int(self.lib.cuMemHostRegister_v2(addr, size, _PORTABLE))
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        rc = self.lib.cuDeviceGet(ctypes.byref(dev), device)
        if rc != 0:
            return int(rc)
        rc = self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        if rc != 0:
            return int(rc)
        try:
            rc = self.lib.cuCtxPushCurrent_v2(ctx)
            if rc != 0:
                return int(rc)
            try:
                return int(self.lib.cuMemHostRegister_v2(addr, size, _PORTABLE))
            finally:
                self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            self.lib.cuDevicePrimaryCtxRelease_v2(dev)

    def unregister(self, addr: int) -> int:
        return int(self.lib.cuMemHostUnregister(addr))


class PinnedSlots:
    """Which slot mappings are registered with CUDA; one owner (the snapshotter), which
    says ``release`` before a slot's map is closed."""

    def __init__(self) -> None:
        self.enabled = os.environ.get(PIN_ENV, "1") != "0"
        self._driver: _Driver | None = None
        self._pinned: dict[int, tuple[mmap.mmap, int]] = {}  # slot -> (its map, address)

    def ensure(self, slot: int, buf: mmap.mmap, device: torch.device) -> bool:
        """``buf`` (slot ``slot``'s map) is page-locked for CUDA, registering it now if
        it is new; False where registration is off or failed (then: stage)."""
        have = self._pinned.get(slot)
        if have is not None and have[0] is buf:
            return True
        self.release(slot)
        if not self.enabled or device.type != "cuda":
            return False
        try:
            if self._driver is None:
                self._driver = _Driver()
        except (OSError, AttributeError) as e:  # no libcuda.so.1, or too old a driver
            return self._give_up(f"the CUDA driver library: {e}")
        addr = _address(buf)
        rc = self._driver.register(addr, len(buf), device.index or 0)
        if rc != 0:
            return self._give_up(f"registering the shared-memory slot: {self._driver.error(rc)}")
        self._pinned[slot] = (buf, addr)
        return True

    def _give_up(self, why: str) -> bool:
        self.enabled = False
        log.warning("snapshots stage GPU tensors through pinned memory (slower): %s", why)
        return False

    def release(self, slot: int) -> None:
        """Unregister slot ``slot``'s map (before it is closed or replaced)."""
        have = self._pinned.pop(slot, None)
        if have is not None and self._driver is not None:
            rc = self._driver.unregister(have[1])
            if rc != 0:
                log.warning("unregistering a snapshot slot: %s", self._driver.error(rc))
