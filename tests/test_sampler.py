"""ElasticSampler and BatchPolicy, without processes: the arithmetic of exactly-once."""

from __future__ import annotations

import random

import pytest
import torch

from elastic.worker.sampler import BatchPolicy, ElasticSampler


def run_epoch(
    n: int, policy: BatchPolicy, worlds: list[int], steps_per_world: int, seed: int = 0
) -> list[int]:
    """Train one epoch, resizing every ``steps_per_world`` steps; the indices used."""
    state = None
    used: list[int] = []
    for k, world in enumerate(worlds):
        samplers = [
            ElasticSampler(n, policy, seed=seed, rank=r, world_size=world) for r in range(world)
        ]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        iters = [iter(s) for s in samplers]
        accumulation = policy.accumulation(world)
        last = k == len(worlds) - 1
        for _ in range(10**6 if last else steps_per_world):
            try:
                batches = [[next(it) for _ in range(accumulation)] for it in iters]
            except StopIteration:
                break
            assert all(b for rank in batches for b in rank), "every rank gets data"
            used += [i for rank in batches for b in rank for i in b]
            for s in samplers:
                s.advance(1)
        state = samplers[0].state_dict()
        assert all(s.state_dict() == state for s in samplers)
    return used


@pytest.mark.parametrize(
    "policy", [BatchPolicy(micro_batch=4, global_batch=24), BatchPolicy(micro_batch=3)]
)
def test_exactly_once_across_resizes(policy: BatchPolicy) -> None:
    rng = random.Random(7)
    for n in (24, 100, 241, 480):
        for _ in range(5):
            worlds = [rng.choice([1, 2, 3, 6]) for _ in range(rng.randint(1, 5))]
            if policy.global_batch:
                worlds = [w for w in worlds if 24 % (4 * w) == 0] or [1]
            used = run_epoch(n, policy, worlds, rng.randint(1, 4))
            assert sorted(used) == list(range(n)), (n, worlds)


def test_same_order_whatever_the_world_size() -> None:
    policy = BatchPolicy(micro_batch=2)
    one = run_epoch(20, policy, [1], 0)
    s = ElasticSampler(20, policy, seed=0, rank=0, world_size=1)
    assert one == torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()
    assert sorted(run_epoch(20, policy, [2, 4], 1)) == sorted(one)
    assert len(s) == 10


def test_every_rank_gets_the_same_number_of_batches_even_at_the_tail() -> None:
    policy = BatchPolicy(micro_batch=4)
    for n in range(1, 60):
        counts = {len(list(ElasticSampler(n, policy, rank=r, world_size=3))) for r in range(3)}
        assert len(counts) == 1, n


def test_plan_merges_a_tiny_tail_into_the_last_step() -> None:
    assert ElasticSampler.plan(26, 3, 1, 4) == [12, 14]
    assert ElasticSampler.plan(27, 3, 1, 4) == [12, 12, 3]
    assert ElasticSampler.plan(2, 3, 1, 4) == [2]


def test_prefetched_batches_are_not_counted_until_committed() -> None:
    s = ElasticSampler(40, BatchPolicy(micro_batch=5), rank=0, world_size=2, shuffle=False)
    it = iter(s)
    next(it), next(it), next(it)  # a DataLoader prefetching three batches
    s.advance(1)
    assert s.state_dict()["consumed"] == 10


def test_policy_errors_and_lr_scaling() -> None:
    with pytest.raises(ValueError, match="not both"):
        BatchPolicy(micro_batch=4, global_batch=16, scale_lr=True)
    with pytest.raises(ValueError, match="multiple of micro_batch"):
        BatchPolicy(micro_batch=4, global_batch=18)
    with pytest.raises(ValueError, match="cannot be split over world size 3"):
        BatchPolicy(micro_batch=4, global_batch=16).accumulation(3)
    assert BatchPolicy(micro_batch=4, global_batch=16).accumulation(2) == 2
    p = BatchPolicy(micro_batch=4, scale_lr=True, base_world_size=2)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    p.apply(opt, sched, world=4)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    opt.step()
    sched.step()  # the schedule goes on from the scaled rate
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    p.apply(opt, sched, world=2)  # shrink: relative to what was applied, progress kept
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert sched.base_lrs[0] == pytest.approx(0.1)


def test_state_of_another_dataset_is_refused() -> None:
    s = ElasticSampler(10, 2)
    with pytest.raises(ValueError, match="dataset of 12 samples, this one has 10"):
        s.load_state_dict({"epoch": 0, "consumed": 0, "seed": 0, "n": 12})
