"""How many workers ``--nproc-per-node auto|cpu|gpu|xpu|N`` means here, without importing torch.

GPUs are counted through NVML (nvidia-ml-py, imported lazily: no NVML means no GPUs),
narrowed by ``CUDA_VISIBLE_DEVICES`` the way CUDA reads it.
"""

from __future__ import annotations

import contextlib
import os


class DeviceError(ValueError):
    """The requested devices do not exist here."""


def nvml_device_count() -> int:
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return 0
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def visible_gpus(environ: dict[str, str] | None = None, total: int | None = None) -> list[str]:
    """GPU ids a process started with ``environ`` can use, in CUDA's order."""
    env = os.environ if environ is None else environ
    total = nvml_device_count() if total is None else total
    if total == 0:
        return []
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return [str(i) for i in range(total)]
    ids = []
    for item in (x.strip() for x in cvd.split(",")):
        valid = item.startswith(("GPU-", "MIG-")) or (item.isdigit() and int(item) < total)
        if not valid:
            break  # CUDA ignores everything from the first invalid entry on
        ids.append(item)
    return ids


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def count_devices(spec: str, visible: int | None = None) -> int:
    """Worker count for ``--nproc-per-node`` (``visible``: GPUs chosen with --devices)."""
    if spec.isdigit() or (spec.startswith("-") and spec[1:].isdigit()):
        n = int(spec)
        if n < 1:
            raise DeviceError("must be at least 1")
        return n
    if spec == "cpu":
        return cpu_count()
    if spec == "gpu":
        n = len(visible_gpus()) if visible is None else visible
        if n == 0:
            raise DeviceError(
                "no GPU is visible here (NVML finds none, or CUDA_VISIBLE_DEVICES hides them)"
            )
        return n
    if spec == "auto":
        return (len(visible_gpus()) if visible is None else visible) or cpu_count()
    if spec == "xpu":
        import torch

        if not torch.xpu.is_available():
            raise DeviceError("no XPU is available here")
        return torch.xpu.device_count()
    raise DeviceError("expected a number, auto, cpu, gpu or xpu")


def choose_devices(text: str, total: int | None = None) -> list[str]:
    """``--devices 0,2`` (NVML indices or GPU UUIDs) checked against this machine's GPUs."""
    wanted = [d.strip() for d in text.split(",") if d.strip()]
    if not wanted:
        raise DeviceError("expected GPU indices or UUIDs, like 0,2")
    if len(set(wanted)) != len(wanted):
        raise DeviceError("a device is listed twice")
    total = nvml_device_count() if total is None else total
    if total == 0:
        raise DeviceError("no GPU is visible here (NVML finds none)")
    for d in wanted:
        if d.isdigit():
            if int(d) >= total:
                raise DeviceError(f"device {d} does not exist: this machine has GPUs 0-{total - 1}")
        elif not d.startswith(("GPU-", "MIG-")):
            raise DeviceError(f"device {d!r}: expected an index or a GPU-/MIG- UUID")
    return wanted
