"""One rank of a gloo DDP job (for tests/test_agreement.py) that commits every step; rank 1
alone is asked to stop once step STOP_AT is committed. Prints where it stopped, whether
the doorbell rode in DDP's gradient all-reduce, how many agreements of their own the
ranks held, and a digest of the final weights.

    doorbell_ranks.py fold       # State around the module, DDP built after it
    doorbell_ranks.py own-hook   # rank 0's DDP carries a hook of the script's own
    doorbell_ranks.py plain      # no State: the weights DDP alone gives (the same steps)
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist
from agreements import Agreements, stop_rank_1_at  # this directory
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic

STEPS, STOP_AT = 300, 200


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    state = None
    agreements = Agreements()
    if mode != "plain":
        state = elastic.State(model=net, optimizer=opt)
        stop_rank_1_at(state, rank, STOP_AT)
    ddp = DDP(net)
    if mode == "own-hook" and rank == 0:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    data = torch.Generator().manual_seed(rank)
    stopped = None
    for i in range(STEPS):
        x = torch.randn(4, 8, generator=data)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if state is None:
            if i + 1 == STOP_AT + 1:  # where the fold stops: the step after it was asked
                break
            continue
        try:
            state.commit()
        except SystemExit:  # saved and stopping for a resize (exit code 75)
            stopped = state.step
            break
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    digest = hashlib.sha1(repr(weights.tolist()).encode()).hexdigest()[:12]
    active = state is not None and state._core.doorbell.active  # type: ignore[union-attr]
    print(f"rank {rank} stopped {stopped} active {active} agreements {agreements.count} {digest}")
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
