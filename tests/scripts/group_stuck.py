"""One rank of a two-rank gloo group owned by ``elastic.worker.group.Group`` (for
tests/test_group.py): rank 0 broadcasts 64 MB; rank 1 posts its receive and stops itself
(SIGSTOP) as the data arrive (not gloo's notices ahead of them), so that rank 0's send
fills the connection, and the test SIGKILLs it; if its gloo thread read it all first, it
says so and ends. gloo leaves rank 0's unfinished send queued and never fails it: only
the group's timeout (60 s here) would. Rank 0 prints when it is in the broadcast and, if
it ever returns, how."""

from __future__ import annotations

import datetime
import fcntl
import os
import signal
import sys
import termios
import time

import torch
import torch.distributed as dist

from elastic.contract import ControlBlock
from elastic.worker.group import Group

CONTROL = 4096  # more bytes than gloo's notices (a send or receive is ready) ever take


def main() -> None:
    block = ControlBlock(os.environ["BLOCK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    g = Group(block)
    g.adopt()
    data = torch.zeros(16 << 20)
    dist.barrier()
    if dist.get_rank() == 1:
        fds = [fd for fd, _, _ in g.sockets.formed]
        print("receiving", flush=True)
        work = dist.broadcast(data, 0, async_op=True)
        waiting = bytearray(4)
        while not work.is_completed():  # until data waits in a connection: the transfer is on
            for fd in fds:
                fcntl.ioctl(fd, termios.FIONREAD, waiting)
                if int.from_bytes(waiting, sys.byteorder) > CONTROL:
                    os.kill(os.getpid(), signal.SIGSTOP)
        print("received it all before it could stop", flush=True)
        return
    print("sending", flush=True)
    started = time.monotonic()
    try:
        dist.broadcast(data, 0)
        print(f"returned after {time.monotonic() - started:.1f}s", flush=True)
    except Exception as e:
        print(f"failed after {time.monotonic() - started:.1f}s: {e}", flush=True)


if __name__ == "__main__":
    main()
