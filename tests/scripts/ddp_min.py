"""A tiny gloo DDP job: a few steps on a linear model, then every rank reports its result."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    checksum = float(sum(p.sum() for p in model.parameters()))
    env = {
        k: os.environ.get(k)
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
        )
    }
    result = {"event": "done", "rank": rank, "world": world, "checksum": checksum, "env": env}
    out = os.environ.get("RESULT_DIR")
    if out:  # one file per rank: concurrent prints to a shared stdout interleave
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
