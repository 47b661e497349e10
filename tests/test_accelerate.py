"""The accelerate helper: ``ElasticLoader`` keeps a prepared loader's place through
``elastic.State``. In one process (a real ``Accelerator`` on the CPU) and under real
agents, where a node lost mid-epoch leaves the rest of the epoch to the survivor with no
sample lost or repeated."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from agents import samples_once, start_agent, steps, wait_world
from conftest import need
from harness import ROOT, Proc
from torch.utils.data import DataLoader, IterableDataset

from elastic.agent.etcd_server import EtcdServer

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
    saved = first.state_dict()
    assert {k: v for k, v in saved.items() if not k.startswith("order")} == {
        "epoch": 1,
        "consumed": 12,
        "batches": 3,
        "lead": 0,
    }
    torch.manual_seed(1)  # a new process: another global RNG state
    again = ElasticLoader(prepared(resumed_with))
    again.load_state_dict(saved)
    rest = [b.tolist() for b in again.epoch(1)]
    assert trained + rest == undisturbed
    done = {k: v for k, v in again.state_dict().items() if not k.startswith("order")}
    assert done == {"epoch": 1, "consumed": 40, "batches": 10, "lead": 3}  # nothing left
    assert len(list(again.epoch(2))) == 10  # the epoch after is whole


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


@pytest.mark.slow
def test_a_node_lost_mid_epoch_resizes_without_losing_or_repeating_a_sample(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Two nodes, one worker each, gradient accumulation 2; b is SIGKILLed mid-epoch and a
    trains on alone: every sample of every epoch once in the kept steps, and at most the
    snapshot interval (2) of steps redone."""
    args = ("--adapter", "--samples", "96", "--epochs", "2", "--accumulate", "2")
    args += ("--step-time", "0.05")
    extra = ("--snapshot-every", "2")
    env = {"RESULT_DIR": str(tmp_path)}
    kw = {"nnodes": "1:2", "nproc": 1, "extra": extra, "env": env}
    a = start_agent(procs, etcd.endpoint, run_id, "a", SCRIPT, *args, **kw)  # type: ignore[arg-type]
    a.wait_output("registered as a", timeout=30)
    b = start_agent(procs, etcd.endpoint, run_id, "b", SCRIPT, *args, **kw)  # type: ignore[arg-type]
    wait_world(tmp_path, 2, timeout=120)
    time.sleep(0.5)  # a few steps into the epoch
    killed = time.time()
    b.signal(signal.SIGKILL)
    wait_world(tmp_path, 1, after=killed, timeout=60)
    assert a.wait(180) == 0, a.transcript()
    history = steps(tmp_path)
    assert sorted({r["world"] for r in history}) == [1, 2]
    samples_once(history, 96, 2)
    before = max(r["step"] for r in history if r["world"] == 2)
    after = min(r["step"] for r in history if r["world"] == 1)
    assert 0 <= before + 1 - after <= 2, (before, after)


@pytest.mark.slow
def test_the_example_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic", "--nproc-per-node", "2", "--metrics-port", "0",
         "examples/accelerate_ddp.py", "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(ROOT),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epoch 0: loss" in done.stdout and "(step 8, 2 processes)" in done.stdout, done.stdout
