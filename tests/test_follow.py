"""A State that follows another's run() (``State.follow``, ``State.held_shards``): what a
framework that makes its sharded objects anew in each fit hands from one State to the
next. One gloo rank in this process, FSDP2 on CPU; the live path end to end is in
tests/test_frameworks.py (Lightning's ModelParallelStrategy under run())."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh

from elastic.contract import SnapshotPolicy
from elastic.worker.state import State


def sharded_state(tmp: Path) -> tuple[State, torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    policy = SnapshotPolicy(every=0, checkpoint_dir=str(tmp))  # no snapshot by policy
    return State(policy, model=model, optimizer=opt), model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.usefixtures("one_rank")
def test_a_state_follows_a_run_only_where_memory_can_re_shard_it_live(tmp_path: Path) -> None:
    """Refused, with the reason the adapter logs: state that is not sharded (the whole
    checkpoint is snapshotted otherwise), and a run that is not kept live (torchrun,
    plain python: nothing re-forms in place)."""
    run = State()
    plain = State(model=torch.nn.Linear(2, 2))
    assert plain.follow(run) == "the state is not sharded"
    state, _, _ = sharded_state(tmp_path)
    assert state.follow(run) == "the run is not kept live"
    assert not run._core.delegated and state._core.group is None


@pytest.mark.usefixtures("one_rank")
def test_the_shards_held_for_the_next_state_are_the_last_committed_step(tmp_path: Path) -> None:
    """After a commit the rows as they are (views: nothing copied), at the committed
    step; an optimizer that stepped after it leaves only the last snapshot's copies (none
    here), since the rest the framework kept is a step behind those rows; and without
    ``live`` (the framework kept no rest of that step) the same."""
    state, model, opt = sharded_state(tmp_path)
    train_step(model, opt)
    state.commit()
    held = state.held_shards(live=True)
    assert held is not None and held.step == 1
    keys = {p.key for p in held.pieces}
    assert "model.0.weight" in keys and "optimizer:model.0.weight:exp_avg" in keys
    weight = next(p for p in held.pieces if p.key == "model.0.weight")
    local = model[0].weight.to_local()  # type: ignore[operator]
    assert weight.tensor.data_ptr() == local.data_ptr()  # a view of the live rows
    assert state.held_shards(live=False) is None  # no snapshot kept in memory
    train_step(model, opt)  # the optimizer steps; the fault comes before the commit
    assert state.held_shards(live=True) is None
    assert State(model=torch.nn.Linear(2, 2)).held_shards(live=True) is None
