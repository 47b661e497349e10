"""One rank of two that form a gloo group while a connection of the script's own opens
(``ECHO_PORT``: an echo server's), then find which connections are the group's
(``GroupSockets.settle``) and cut them. Prints one JSON line: whether the group's
all-reduce failed after the cut, whether the script's connection still echoes, and
what the settling kept. ``UNWATCHED=1``: every connection of the process is a candidate,
as for a group formed before elastic watched."""

from __future__ import annotations

import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from elastic.worker.group import GroupSockets, _connections


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    at = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    sockets = GroupSockets()
    with sockets.forming():  # another thread of the script connects meanwhile
        own = socket.create_connection(("127.0.0.1", int(os.environ["ECHO_PORT"])))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    if os.environ.get("UNWATCHED"):
        sockets.adopt(None)
    candidates = len(sockets.formed)
    store = dist.distributed_c10d._get_default_store()
    sockets.settle(store, rank, world, at, lambda: False)
    deadline = time.monotonic() + 20
    while len(sockets.formed) == candidates and time.monotonic() < deadline:
        time.sleep(0.01)
    kept = len(sockets.formed)
    dist.barrier()  # both settled: now cut
    # what the cut can reach: a kept connection may close by itself (torch's own, under
    # load) before the cut looks, or after: a closed one is not there to cut
    group = sockets.formed
    alive = len(group & _connections())
    cut = sockets.cut()
    left = len(group & _connections())
    try:
        dist.all_reduce(torch.ones(4))
        failed = False
    except RuntimeError:
        failed = True
    own.settimeout(5.0)
    own.sendall(b"x")
    echoed = own.recv(1) == b"x"
    said = dict(candidates=candidates, kept=kept, alive=alive, cut=cut, left=left, failed=failed)
    print(json.dumps({**said, "echoed": echoed}))
    sockets.close()
    os._exit(0)  # the group is broken: no orderly destroy


if __name__ == "__main__":
    main()
