"""What a snapshot costs the training loop, against a bare memory copy and torch.save.

Part 1, per state size (100 MB and 1 GB of fp32 parameters plus SGD momentum): the time
the training thread is blocked by

  - a bare memory copy of the same tensors into preallocated memory (the floor),
  - ``State.snapshot()`` copying everything into shared memory before returning,
  - ``State.commit()`` as training uses it: parameters and optimizer state copied while the
    next forward/backward runs (measured: the time commit() takes, plus the time the next
    optimizer.step() waits for the copy, with a forward/backward in between),
  - ``torch.save`` of the state to a file on disk.

Part 2: step time of a ~100M-parameter MLP with Adam (1.2 GB of parameters and Adam
state) at two batch sizes, with no checkpointing; with elastic-run's default policy
(``--snapshot-every auto``: as often as keeps the cost within 2% of step time); with a
snapshot every step; and with ``torch.save`` and ``torch.distributed.checkpoint.async_save``
every N steps, N being the interval the default policy chose. Each with the most steps
a crash can lose.

    python benchmarks/checkpoint.py [--sizes 100,1000] [--repeat 5] [--batches 256,1024]
                                    [--rounds 2]     (--sizes "": part 2 only)
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from elastic import SnapshotPolicy, State
from elastic.contract import NODE_DIR_ENV


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def model_of(mbytes: int) -> nn.Module:
    """Linear layers of 2048x2048 fp32 (16 MiB each) adding up to about ``mbytes`` MB."""
    layers = max(1, round(mbytes * 1e6 / (2048 * 2048 * 4 * 2)))  # params + momentum
    return nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(layers)])


def timed(fn, repeat: int) -> float:
    fn()  # warm up: first touch of the destination pages
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def blocking(mbytes: int, repeat: int, shm: Path, disk: Path) -> dict[str, float]:
    torch.manual_seed(0)
    model = model_of(mbytes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 2048)
    model(x).sum().backward()
    opt.step()  # momentum buffers exist now
    tensors = [t for t in model.state_dict().values()]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    dest = [torch.empty_like(t) for t in tensors]

    def bare() -> None:
        for d, t in zip(dest, tensors, strict=True):
            d.copy_(t)

    os.environ[NODE_DIR_ENV] = str(shm)
    state = State(model=model, optimizer=opt, snapshot_policy=SnapshotPolicy(every=1))
    full = timed(lambda: state.snapshot(wait=True), repeat)

    def overlapped() -> float:
        t = time.perf_counter()
        state.commit()
        blocked = time.perf_counter() - t
        model(x).sum().backward()  # the next step's compute, while the copy runs
        t = time.perf_counter()
        opt.step()  # waits for the copy, if it is not done yet
        return blocked + time.perf_counter() - t

    overlapped()
    commit = statistics.median(overlapped() for _ in range(repeat))
    state.close()
    path = disk / "state.pt"
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    save = timed(lambda: torch.save(sd, path), repeat)
    path.unlink()
    return {
        "bytes": nbytes,
        "bare copy": timed(bare, repeat),
        "snapshot (full copy)": full,
        "commit (overlapped)": commit,
        "torch.save": save,
    }


class Loop:
    """The ~100M-parameter MLP with Adam (1.2 GB of parameters and optimizer state) and
    one way of saving it: steps timed in blocks."""

    def __init__(self, name: str, batch: int, save: Callable[[Loop, int], None]) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, 4096)
        self.save = save
        self.step = 0
        self.times: list[float] = []  # seconds per step, one per block
        self.state: State | None = None
        self.pending: list[Any] = []  # async_save futures

    def run(self, steps: int, timed: bool = True) -> None:
        t = time.perf_counter()
        for _ in range(steps):
            self.model(self.x).pow(2).mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.step += 1
            self.save(self, self.step)
        self.finish()
        if timed:
            self.times.append((time.perf_counter() - t) / steps)

    def finish(self) -> None:
        """What is in flight is part of the block's cost."""
        if self.state is not None:
            self.state.flush()
        for f in self.pending:
            f.result()
        self.pending.clear()

    def sd(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}


def policies(batch: int, shm: Path, disk: Path, rounds: int) -> None:
    """Step time with no checkpointing, elastic-run's default policy, a snapshot every
    step, and torch.save / async_save every N (N: the interval the default policy chose),
    in blocks of N steps run ABCDE EDCBA ``rounds`` times (this VM's speed drifts by
    tens of percent over minutes; mirrored blocks cancel a steady drift)."""

    def with_state(policy: SnapshotPolicy) -> Callable[[Loop, int], None]:
        def commit(loop: Loop, step: int) -> None:
            if loop.state is None:
                os.environ[NODE_DIR_ENV] = str(shm / f"{batch}-{policy.every}")
                loop.state = State(model=loop.model, optimizer=loop.opt, snapshot_policy=policy)
            loop.state.commit()

        return commit

    auto = Loop("elastic-run default (auto, 2% budget)", batch, with_state(SnapshotPolicy()))
    auto.run(1, timed=False)  # the State exists; then let it measure and choose
    assert auto.state is not None
    cadence = auto.state._cadence
    while (cadence.interval == 0 or auto.step < 12) and auto.step < 60:
        auto.run(1, timed=False)
    n = max(cadence.interval, 1)
    path = disk / f"save-{batch}.pt"

    def torch_save(loop: Loop, step: int) -> None:
        if step % n == 0:
            torch.save(loop.sd(), path)

    def async_save(loop: Loop, step: int) -> None:
        if step % n == 0:
            for f in loop.pending:  # one in flight at a time, as its docs advise
                f.result()
            where = disk / f"dcp-{batch}-{step // n % 2}"  # the older one is complete
            loop.pending = [dcp.async_save(loop.sd(), checkpoint_id=str(where))]

    loops = [
        Loop("no checkpointing", batch, lambda loop, step: None),
        auto,
        Loop("elastic-run, snapshot every step", batch, with_state(SnapshotPolicy(every=1))),
        Loop(f"torch.save every {n}", batch, torch_save),
        Loop(f"DCP async_save every {n}", batch, async_save),
    ]
    for loop in loops:  # allocate optimizer state, snapshot slots, files
        if loop is not auto:
            loop.run(2, timed=False)
    for r in range(rounds):
        order = loops if r % 2 == 0 else loops[::-1]
        for loop in order + order[::-1]:
            loop.run(n)
    base = statistics.median(loops[0].times)
    lost = {
        "no checkpointing": "all",
        auto.name: str(cadence.at_risk),
        loops[2].name: "1",
        loops[3].name: str(n),
        loops[4].name: f"{2 * n} (one save in flight)",
    }
    print(f"\nbatch {batch}: {base:.2f} s a step without checkpoints; N = {n}", flush=True)
    for loop in loops:
        took = statistics.median(loop.times)
        blocked = ""
        if loop.state is not None:
            waited = loop.state.stats.blocked_seconds / loop.step
            blocked = f"; training thread blocked {waited * 1e3:.0f} ms a step"
        print(
            f"  {loop.name:<40}{took:>7.2f}s{took / base:>8.3f}x   "
            f"steps lost: {lost[loop.name]}{blocked}",
            flush=True,
        )
    step_s, cost_s = cadence.step_s or 0.0, cadence.cost_s or 0.0
    print(
        f"  the default policy measured: step {step_s:.2f}s, snapshot cost {cost_s * 1e3:.0f} ms"
        f" -> every {cadence.interval} steps = "
        f"{cost_s / max(cadence.interval * step_s, 1e-9):.1%} of step time"
    )
    for loop in loops:
        if loop.state is not None:
            loop.state.close()
    for slots in shm.glob(f"{batch}-*"):  # two slots of 1.2 GB each, in memory
        shutil.rmtree(slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000", help="state sizes in MB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batches", default="256,1024", help="batch sizes for part 2")
    ap.add_argument("--rounds", type=int, default=2, help="ABCDE EDCBA rounds in part 2")
    a = ap.parse_args()
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=shm_root) as shm, tempfile.TemporaryDirectory() as disk:
        print(
            "Seconds the training thread is blocked (median of "
            f"{a.repeat}); ratio to the bare memory copy"
        )
        for mb in (int(s) for s in a.sizes.split(",") if s):
            r = blocking(mb, a.repeat, Path(shm) / f"s{mb}", Path(disk))
            base = r["bare copy"]
            print(f"\nstate {r['bytes'] / 1e6:.0f} MB")
            for k in ("bare copy", "snapshot (full copy)", "commit (overlapped)", "torch.save"):
                print(f"  {k:<24}{r[k]:>9.3f}s{r[k] / base:>8.2f}x")
        print(
            "\nStep time of a 101M-parameter MLP with Adam (1.2 GB of state), median of "
            f"{2 * a.rounds} blocks of N steps; ratio to no checkpointing"
        )
        if not dist.is_initialized():  # async_save wants a process group
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        for batch in (int(b) for b in a.batches.split(",")):
            policies(batch, Path(shm), Path(disk), a.rounds)
        print("\ntargets: blocking within 2x of the bare copy; the default policy <= 2%")


if __name__ == "__main__":
    main()
