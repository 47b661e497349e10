"""One rank of a two-rank gloo job (for tests/test_agreement.py): what becomes of State's
control group and of its collectives' work once they are done.

- The tensors its agreements were made of: any that was freed, freed on the main
  thread (never by gloo's, which needs the GIL for it and aborts the process if the
  interpreter is finalizing), and how many were.
- The group, after the script's ``destroy_process_group``: gone, and a new group gets
  a new control group (it meets on the port given as the first argument)."""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from elastic.worker import comm

AGREEMENTS = 8


def main() -> None:
    dist.init_process_group("gloo")
    freed: list[bool] = []  # for each tensor freed: on the main thread?
    made = torch.tensor

    def tracked(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = made(*args, **kwargs)
        on_main = lambda: freed.append(threading.current_thread() is threading.main_thread())  # noqa: E731
        weakref.finalize(t, on_main)
        return t

    torch.tensor = tracked  # type: ignore[assignment]
    for _ in range(AGREEMENTS):
        assert comm.control().all_reduce([dist.get_rank()], "SUM") == [1]
    torch.tensor = made  # type: ignore[assignment]
    time.sleep(0.2)  # gloo's threads let go of what they hold
    print(f"freed-on-main {all(freed)} freed {len(freed)}")

    world = weakref.ref(dist.group.WORLD)
    generation = comm.control().generation
    dist.destroy_process_group()
    print(f"alive-after-destroy {world() is not None}")
    # The new group meets on a port of its own: on the old one, a rank quicker than
    # rank 0 can reach the old store before rank 0 has closed it, and lose it mid-read.
    os.environ["MASTER_PORT"] = sys.argv[1]
    dist.init_process_group("gloo")
    assert comm.control().all_reduce([1], "SUM") == [2]
    print(f"new-generation {comm.control().generation > generation}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
