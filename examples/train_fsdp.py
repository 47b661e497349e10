"""FSDP2 training whose workers keep their processes through membership changes:
``State.run`` with a ``reshard`` function.

    elastic-run --nproc-per-node 2 --checkpoint-dir /tmp/fsdp-ckpt examples/train_fsdp.py

Each rank holds only its shard of the parameters and of Adam's state, and the shards are
bound to the process group they were cut over. So the model is sharded in a function,
``shard()``, that ``State.run`` calls again after each change; ``State`` moves the newest
state into what it returns, from the ranks' memory (a survivor keeps its shards, a
newcomer gets its own, a lost node's rows come from the copy the next node kept at the
last snapshot), and from the DCP checkpoint in ``--checkpoint-dir`` only when memory
does not hold a whole step (a restart of the whole job reads it too). Two rules follow:

- Everything that holds the model or the optimizer is made in ``shard()`` and returned
  by the name ``State`` holds it under (a learning-rate scheduler too); the training
  function reads them from ``state`` (``state.model``), as they change.
- As with DDP, the rank and world size are read inside the training function.

Kill a node (``kill -9`` its agent): the agents left log ``workers re-form live``, and
rank 0 prints ``training from step N`` from the same process.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import init_distributed, synthetic
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import elastic


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--step-time", type=float, default=0.0, help="sleep after each step, to watch changes"
    )
    a = ap.parse_args()
    device = init_distributed()

    def shard() -> dict[str, Any]:
        """The model cut over this round's ranks, and what holds it."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1)).to(device)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        return {"model": model, "optimizer": opt}

    data = synthetic()
    sampler = elastic.ElasticSampler(data, batch_size=a.batch_size, shuffle=True, seed=0)
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = elastic.State(sampler=sampler, epoch=0, **shard())

    def train() -> None:
        model, opt = state.model, state.optimizer  # this round's
        rank, world = state.round.rank, state.round.world_size
        if state.step and rank == 0:
            print(f"training from step {state.step} at world size {world}", flush=True)
        for epoch in range(state.epoch, a.epochs):
            state.epoch = epoch
            sampler.set_epoch(epoch)
            started, total, batches = time.time(), 0.0, 0
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
                state.commit(loss=loss.item())
                total, batches = total + loss.item(), batches + 1
                time.sleep(a.step_time)
            if rank == 0:
                print(
                    f"epoch {epoch}: loss {total / max(batches, 1):.4f} "
                    f"({time.time() - started:.2f}s, world size {world})",
                    flush=True,
                )

    state.run(train, reshard=shard)  # restores, trains; re-shards and again after a change
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
