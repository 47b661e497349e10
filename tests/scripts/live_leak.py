"""A worker that trains in ``elastic.State.run`` and reports, at each entry into the
training function, what its process holds: for the live re-formation leak test.

Each entry appends ``{"t", "entry", "pid", "rank", "world", "rss", "fds", "threads"}`` to
``$RESULT_DIR/w<pid>.jsonl`` after its first step on the new process group.
``LEAK_BACKEND=nccl``: the model on the worker's GPU, the group on NCCL.
``LEAK_UNWATCHED_RANK=N``: local rank N forms its first group through
``init_process_group`` bound before ``import elastic`` (as ``from torch.distributed import
init_process_group`` at the top of a script does), which elastic does not see.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import socket
import threading
import time

import psutil
import torch
import torch.distributed as dist
from torch.distributed import init_process_group as unwatched_init  # before elastic wraps it
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastic

entries = 0
own: socket.socket | None = None


def train(
    state: elastic.State, model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device
) -> None:
    global entries
    entries += 1
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = state.sampler
    data = TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
    # worker processes of its own each round: they must go with the round
    loader = DataLoader(data, batch_sampler=sampler, num_workers=1)
    reported = False
    for epoch in range(state.epoch, 10**6):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.commit()
            if not reported:
                reported = True
                gc.collect()
                me = psutil.Process()
                row = {"t": time.time(), "entry": entries, "pid": os.getpid()}
                row.update(rank=dist.get_rank())
                row.update(world=dist.get_world_size(), rss=me.memory_info().rss)
                row.update(fds=me.num_fds(), threads=threading.active_count())
                row.update(os_threads=me.num_threads())
                if own is not None:  # the script's own connection, opened before State.run
                    own.sendall(b"x")
                    row.update(own_connection=own.recv(1) == b"x")
                with open(
                    os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl"), "a"
                ) as f:
                    f.write(json.dumps(row) + "\n")
            time.sleep(0.01)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks when stuck
    backend = os.environ.get("LEAK_BACKEND", "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    unwatched = os.environ.get("LEAK_UNWATCHED_RANK") == os.environ["LOCAL_RANK"]
    (unwatched_init if unwatched else dist.init_process_group)(backend)
    global own
    if os.environ.get("ECHO_PORT"):  # a logging or data service of the script's own
        own = socket.create_connection(("127.0.0.1", int(os.environ["ECHO_PORT"])))
        own.settimeout(5.0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters())
    sampler = elastic.ElasticSampler(4096, batch_size=32, seed=0)
    state = elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
    state.run(train, state, model, opt, device)


if __name__ == "__main__":
    main()
