"""The default process group destroyed at the worker's exit, where the script left it.

Scripts written for torchrun often end without ``destroy_process_group`` (accelerate's
and the Hugging Face Trainer's do). torch then frees a gloo group while the interpreter
finalizes, and its threads now and then abort the process ("terminate called without
an active exception", SIGABRT) after the last step: a job that trained to the end was
reported FAILED (pytorch/pytorch#190489; here, 1 run in 12 of the accelerate example
on a loaded host). An NCCL group left so makes every rank warn at exit that it "can
leak resources" (an H200, 2026-11-29). Destroying the group at exit, while the
interpreter is whole, frees it in order. gloo and NCCL only (other backends keep
torch's own end). Bounded: a group with work pending on a lost peer is left as it was.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading

BOUND = 2.0  # seconds the destroy may take at exit
OURS = frozenset({"gloo", "nccl"})  # the backends whose group is destroyed at exit


def destroys(backend: str) -> bool:
    """Whether a default group of ``backend`` is destroyed at exit: gloo, NCCL, or both
    (``cpu:gloo,cuda:nccl``, torch's default on a GPU)."""
    names = {part.rpartition(":")[2] for part in backend.lower().split(",")}
    return bool(names) and names <= OURS


def _destroy() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return  # the script never loaded it: no group
    with contextlib.suppress(Exception):
        if not dist.is_initialized() or not destroys(str(dist.get_backend())):
            return

        def destroy() -> None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

        done = threading.Thread(target=destroy, name="elastic-destroy", daemon=True)
        done.start()
        done.join(BOUND)


def at_exit() -> None:
    """Destroy the default group at exit, if the script has not (once per process)."""
    if not getattr(at_exit, "registered", False):
        atexit.register(_destroy)
        at_exit.registered = True  # type: ignore[attr-defined]
