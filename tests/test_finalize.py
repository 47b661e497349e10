"""A gloo group the script leaves is destroyed at the worker's exit, while the
interpreter is whole (torch freeing it during finalization aborted the process now and
then: a job that trained to the end reported FAILED); an NCCL one too
(test_gpu_frameworks: no "destroy_process_group() was not called" at exit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, sys
import torch.distributed as dist
from elastic.worker import finalize
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
finalize.at_exit()
finalize.at_exit()  # once per process
atexit.register(lambda: print("left for the interpreter:", dist.is_initialized()))
finalize._destroy()
print("after:", dist.is_initialized())
"""


def test_the_default_gloo_group_is_destroyed_at_exit(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["after: False", "left for the interpreter: False"]


def test_the_backends_whose_group_is_destroyed() -> None:
    from elastic.worker.finalize import destroys

    for yes in ("gloo", "nccl", "cpu:gloo,cuda:nccl", "NCCL"):
        assert destroys(yes), yes
    for no in ("mpi", "ucc", "cpu:gloo,cuda:ucc", ""):
        assert not destroys(no), no


def test_a_process_without_torch_distributed_has_nothing_to_destroy() -> None:
    code = "import sys; from elastic.worker import finalize; finalize._destroy(); "
    code += "print('torch.distributed' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
