"""ElasticSampler: every sample exactly once per epoch, across any number of resizes.

The epoch's order is a fixed permutation of the dataset (seeded by ``seed + epoch``),
the same whatever the world size. The sampler counts how many samples of it the job has
consumed (globally: ``State.commit()`` advances it one optimizer step at a time), and on
each iteration it splits what remains over the current world size. So a resize, graceful
or not, re-shards the rest of the epoch instead of restarting or skipping it.

It is a *batch* sampler (``DataLoader(dataset, batch_sampler=sampler)``) so that every
rank always gets the same number of batches, even at the end of an epoch, which DDP
needs: a small remainder is spread over the last step's batches instead of leaving some
ranks without one.

``BatchPolicy`` decides what happens to the batch when the world size changes: keep the
global batch constant by gradient accumulation, or keep the per-rank batch and scale the
learning rate linearly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any

import torch

log = logging.getLogger("elastic.sampler")


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class BatchPolicy:
    """How the batch follows the world size.

    ``BatchPolicy(micro_batch=8, global_batch=64)``: each optimizer step sees 64 samples
    whatever the world size; each rank accumulates gradients over ``accumulation(world)``
    micro-batches of 8 (64 must be a multiple of world x 8).

    ``BatchPolicy(micro_batch=8, scale_lr=True, base_world_size=4)``: each rank takes 8
    per step, so the global batch is 8 x world; ``apply`` multiplies the learning rate by
    world / 4 (the linear scaling rule).
    """

    def __init__(
        self,
        micro_batch: int,
        global_batch: int | None = None,
        scale_lr: bool = False,
        base_world_size: int = 1,
    ) -> None:
        if micro_batch < 1:
            raise ValueError(f"micro_batch={micro_batch}: must be at least 1")
        if global_batch is not None and scale_lr:
            raise ValueError("choose a constant global_batch or scale_lr, not both")
        if global_batch is not None and (global_batch < micro_batch or global_batch % micro_batch):
            raise ValueError(
                f"global_batch={global_batch} must be a multiple of micro_batch={micro_batch}"
            )
        if base_world_size < 1:
            raise ValueError(f"base_world_size={base_world_size}: must be at least 1")
        self.micro_batch = micro_batch
        self.global_batch = global_batch
        self.scale_lr = scale_lr
        self.base_world_size = base_world_size

    def accumulation(self, world: int) -> int:
        """Micro-batches per rank per optimizer step."""
        if self.global_batch is None:
            return 1
        per_step = world * self.micro_batch
        if self.global_batch % per_step:
            raise ValueError(
                f"global batch {self.global_batch} cannot be split over world size {world} "
                f"x micro batch {self.micro_batch}; pick a global batch divisible by "
                f"{self.micro_batch} x every world size the job may have"
            )
        return self.global_batch // per_step

    def lr_factor(self, world: int) -> float:
        return world / self.base_world_size if self.scale_lr else 1.0

    def apply(
        self, optimizer: torch.optim.Optimizer, scheduler: Any = None, world: int | None = None
    ) -> None:
        """Scale learning rates for ``world`` (relative to what was applied before, so a
        schedule's progress is kept across resizes). No-op without ``scale_lr``."""
        if not self.scale_lr:
            return
        world = _world()[1] if world is None else world
        factor = self.lr_factor(world)
        for i, group in enumerate(optimizer.param_groups):
            ratio = factor / group.get("elastic_lr_factor", 1.0)
            group["lr"] = group["lr"] * ratio
            group["elastic_lr_factor"] = factor
            if scheduler is not None and hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs[i] *= ratio
                if hasattr(scheduler, "_last_lr"):
                    scheduler._last_lr[i] = group["lr"]


class ElasticSampler:
    """A distributed batch sampler whose epochs survive resizes (see module doc)."""

    def __init__(
        self,
        data_source: Sized | int,
        batch_size: int | BatchPolicy,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        if self.n < 1:
            raise ValueError("ElasticSampler needs a non-empty dataset")
        self.policy = (
            batch_size
            if isinstance(batch_size, BatchPolicy)
            else BatchPolicy(micro_batch=batch_size)
        )
        self.shuffle = shuffle
        self.seed = seed
        self._rank, self._world = rank, world_size
        self.epoch = 0
        self.consumed = 0  # samples of this epoch the job has finished, all ranks together
        self._steps: list[int] = []  # global samples per step, for the current iteration
        self._done_steps = 0
        self._warned = False

    # -- where we are -----------------------------------------------------------------
    def _where(self) -> tuple[int, int]:
        rank, world = _world()
        return (
            self._rank if self._rank is not None else rank,
            self._world if self._world is not None else world,
        )

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per optimizer step at the current world size."""
        return self.policy.accumulation(self._where()[1])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (from its beginning), unless it is the epoch in progress."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0
            self._steps, self._done_steps = [], 0

    # -- the split ----------------------------------------------------------------------
    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g)

    @staticmethod
    def plan(remaining: int, world: int, accumulation: int, micro_batch: int) -> list[int]:
        """Global samples per optimizer step for the rest of the epoch. A tail too small
        to give every micro-batch a sample joins the step before it."""
        full = world * accumulation * micro_batch
        slots = world * accumulation
        steps = [full] * (remaining // full)
        tail = remaining % full
        if tail:
            if tail >= slots or not steps:
                steps.append(tail)
            else:
                steps[-1] += tail
        return steps

    def __iter__(self) -> Iterator[list[int]]:
        rank, world = self._where()
        accumulation = self.policy.accumulation(world)
        order = self._order()[self.consumed :].tolist()
        self._steps = self.plan(len(order), world, accumulation, self.policy.micro_batch)
        self._done_steps = 0
        slots = world * accumulation
        pos = 0
        for size in self._steps:
            chunk = order[pos : pos + size]
            pos += size
            q, r = divmod(size, slots)
            bounds = [0]
            for s in range(slots):
                bounds.append(bounds[-1] + q + (s < r))
            for j in range(rank * accumulation, (rank + 1) * accumulation):
                batch = chunk[bounds[j] : bounds[j + 1]]
                if not batch:  # fewer samples left than micro-batches: repeat one
                    if not self._warned:
                        log.warning(
                            "only %d sample(s) left in epoch %d for %d micro-batches; "
                            "padding with repeats",
                            size,
                            self.epoch,
                            slots,
                        )
                        self._warned = True
                    batch = chunk[:1]
                yield batch

    def __len__(self) -> int:
        world = self._where()[1]
        accumulation = self.policy.accumulation(world)
        steps = self.plan(self.n - self.consumed, world, accumulation, self.policy.micro_batch)
        return len(steps) * accumulation

    def advance(self, steps: int = 1) -> None:
        """``steps`` optimizer steps of the current iteration are done (State.commit)."""
        for _ in range(steps):
            if self._done_steps < len(self._steps):
                self.consumed += self._steps[self._done_steps]
                self._done_steps += 1

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("n") != self.n:
            raise ValueError(
                f"sampler state is for a dataset of {state.get('n')} samples, this one has {self.n}"
            )
        if state.get("seed") != self.seed:
            raise ValueError(
                f"sampler state has seed {state.get('seed')}, this sampler {self.seed}"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._steps, self._done_steps = [], 0
