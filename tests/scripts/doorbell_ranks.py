"""One rank of a gloo DDP job (for tests/test_agreement.py) that commits every step; rank 1
alone is asked to stop once step STOP_AT is committed. Beside the model State holds, the
same model trains on the same data under a DDP of its own, without State. Prints where
it stopped, whether the doorbell rode in DDP's gradient all-reduce, how many agreements
of their own the ranks held, and whether the two models' weights are bitwise equal.

    doorbell_ranks.py fold       # State around the module, DDP built after it
    doorbell_ranks.py fold-view  # the same, both DDPs with gradient_as_bucket_view
    doorbell_ranks.py own-hook   # rank 0's DDP carries a hook of the script's own
    doorbell_ranks.py late-hook  # at the first step from LATE on where the bell rides in
                                 # State's DDP, rank 0 registers a Python hook, rank 1 a
                                 # built-in one (both DDPs alike); calls: rank 0's
    doorbell_ranks.py peer-lost  # State's DDP alone; rank 1 exits after committing LOST;
                                 # prints "rank R left|failed-after STEP"
    doorbell_ranks.py split      # rank 0 finds the hook would not pay, rank 1 that it would

Except in split, every rank finds that the hook pays: left to its figures, this tiny
model's step is too short for it (``agreement.bell_pays``).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from agreements import Agreements, stop_rank_1_at, stopped_at  # this directory
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic
from elastic.worker import doorbell
from elastic.worker.agreement import Bell

STEPS, STOP_AT, LATE, LOST = 300, 200, 50, 100


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # the ranks' figures on either side of the line (split); else the bell on for this
    # tiny model, whose step is too short for the hook to pay (bell_pays)
    verdict = Bell(rank != 0 or mode != "split", f"rank {rank}'s figures, as the test says")
    doorbell.bell_pays = lambda pass_s, step_s, buckets: verdict
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    agreements = Agreements()
    state = elastic.State(model=net, optimizer=opt)
    agreements.state = state
    stop_rank_1_at(state, rank, STOP_AT)
    view = mode == "fold-view"  # the gradients are views of DDP's buckets
    ddp = DDP(net, gradient_as_bucket_view=view)
    plain = DDP(ref, gradient_as_bucket_view=view)
    if mode == "own-hook" and rank == 0:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    data = torch.Generator().manual_seed(rank)
    stopped = None
    calls = 0

    def counted(state, bucket):  # unannotated: DDP checks the annotations of a hook
        nonlocal calls
        calls += 1
        return default_hooks.allreduce_hook(state, bucket)

    late = -1  # the step whose reduction the script's hook first took (late-hook)
    for i in range(STEPS):
        if mode == "late-hook" and late < 0 and i >= LATE and state._core.doorbell.active:
            late = i
            for d in (plain, ddp):
                if rank == 0:
                    d.register_comm_hook(None, counted)
                else:
                    d._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        x = torch.randn(4, 8, generator=data)
        pairs = ((ddp, opt),) if mode == "peer-lost" else ((plain, ref_opt), (ddp, opt))
        try:
            for model, optimizer in pairs:
                loss = model(x).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        except RuntimeError:  # gloo's error for a lost peer
            if mode != "peer-lost":
                raise
            print(f"rank {rank} failed-after {state.step}")
            os._exit(0)
        stopped = stopped_at(state)
        if stopped is not None:
            break
        if mode == "peer-lost" and rank == 1 and state.step == LOST:
            print(f"rank {rank} left-after {state.step}", flush=True)
            os._exit(0)
    same = all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters(), strict=True))
    active = state._core.doorbell.active
    print(
        f"rank {rank} stopped {stopped} active {active} agreements {agreements.count} {same} "
        f"calls {calls} agreed-at {','.join(map(str, agreements.steps[-4:]))} late {late} "
        f"hooked {bool(ddp._comm_hooks)}"
    )
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
