"""The accelerate helper: ``ElasticLoader`` keeps a prepared loader's place through
``elastic.State``. In one process (a real ``Accelerator`` on the CPU) and under real
agents, where a node lost mid-epoch leaves the rest of the epoch to the survivor with no
sample lost or repeated."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import need
from harness import ROOT
from torch.utils.data import DataLoader, IterableDataset

SCRIPT = ROOT / "tests" / "scripts" / "accelerate_train.py"


@pytest.fixture(autouse=True)
def _accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        need(False, "accelerate is not installed (pip install -e '.[test]')")


def prepared(generator: bool, n: int = 40, batch: int = 4) -> object:
    from accelerate import Accelerator

    g = torch.Generator() if generator else None
    return Accelerator(cpu=True).prepare(DataLoader(range(n), batch, shuffle=True, generator=g))


@pytest.mark.parametrize(
    ("generator", "resumed_with"),
    [(True, True), (False, False), (True, False), (False, True)],
    ids=["generator", "global-rng", "generator-then-none", "none-then-generator"],
)
def test_a_restored_loader_goes_on_at_the_next_sample_and_then_whole_epochs(
    generator: bool, resumed_with: bool
) -> None:
    """The order is a RandomSampler's: drawn from its generator, or from a seed it draws
    from the global RNG each epoch, whose state a new process does not have; after a
    resize the loader may have a generator where it had none (accelerate gives one to
    several ranks), or none where it had one."""
    from elastic.integrations.accelerate import ElasticLoader

    torch.manual_seed(0)
    undisturbed = [b.tolist() for b in ElasticLoader(prepared(generator)).epoch(1)]
    torch.manual_seed(0)
    first = ElasticLoader(prepared(generator))
    it = first.epoch(1)
    trained = [next(it).tolist() for _ in range(3)]
    first.on_commit()  # State.commit: three batches trained
    next(it)  # a fourth handed out, its step cut short: not trained
    saved = first.state_dict()
    assert {k: v for k, v in saved.items() if not k.startswith("order")} == {
        "epoch": 1,
        "consumed": 12,
        "lead": 0,
    }
    torch.manual_seed(1)  # a new process: another global RNG state
    again = ElasticLoader(prepared(resumed_with))
    again.load_state_dict(saved)
    rest = []
    for b in again.epoch(1):
        rest.append(b.tolist())
        again.on_commit()
    assert trained + rest == undisturbed
    done = {k: v for k, v in again.state_dict().items() if not k.startswith("order")}
    assert done == {"epoch": 1, "consumed": 40, "lead": 3}  # nothing left
    assert len(list(again.epoch(2))) == 10  # the epoch after is whole


@pytest.mark.parametrize("generator", [True, False], ids=["own-generator", "global-rng"])
def test_a_loader_prepared_again_goes_on_from_the_last_commit(generator: bool) -> None:
    """State.run after a re-formation: the same process prepares its loader again for the
    new group, and the epoch goes on from the last commit (the batch whose step a fault
    cut short is handed out again)."""
    from elastic.integrations.accelerate import ElasticLoader

    torch.manual_seed(0)
    undisturbed = [b.tolist() for b in ElasticLoader(prepared(generator)).epoch(1)]
    torch.manual_seed(0)
    data = ElasticLoader(prepared(generator))
    it = data.epoch(1)
    trained = [next(it).tolist() for _ in range(3)]
    data.on_commit()
    next(it)  # cut short
    data.use(prepared(generator))
    assert trained + [b.tolist() for b in data.epoch(1)] == undisturbed


@pytest.mark.parametrize("generator", [True, False], ids=["own-generator", "global-rng"])
def test_without_a_fault_the_order_is_the_loaders_own(generator: bool) -> None:
    from elastic.integrations.accelerate import ElasticLoader

    torch.manual_seed(0)
    plain: Any = prepared(generator)
    own = []
    for epoch in range(3):
        plain.set_epoch(epoch)
        own.append([b.tolist() for b in plain])
    torch.manual_seed(0)
    data = ElasticLoader(prepared(generator))
    assert [[b.tolist() for b in data.epoch(e)] for e in range(3)] == own


def test_an_unsized_loader_is_refused_with_the_reason() -> None:
    from accelerate import Accelerator

    from elastic.integrations.accelerate import ElasticLoader

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(8))

    with pytest.raises(ValueError, match="sized dataset"):
        ElasticLoader(Accelerator(cpu=True).prepare(DataLoader(Stream(), batch_size=2)))


def test_state_hooks_the_optimizer_that_accelerates_wrapper_steps() -> None:
    """``AcceleratedOptimizer`` hands its step to the optimizer it holds: State's step
    hooks (a snapshot copy finishes before parameters change) go there, and State can be
    made with it at all (it raised AttributeError before)."""
    from accelerate import Accelerator

    import elastic

    model, optimizer = Accelerator(cpu=True).prepare(
        torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    )
    state = elastic.State(model=model, optimizer=optimizer)
    try:
        assert state._core.optimizers() == [optimizer.optimizer]
        assert not state._core.stepped
        optimizer.step()
        assert state._core.stepped  # the hook on the inner optimizer ran
    finally:
        state.close()
