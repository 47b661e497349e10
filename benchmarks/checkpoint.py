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
a crash can lose. This VM's speed drifts by tens of percent over minutes, so costs are
paired: a saver's steps against its own clean steps, every-step snapshots against no
checkpointing in interleaved phases of three steps.

    python benchmarks/checkpoint.py [--sizes 100,1000] [--repeat 5] [--batches 256,1024]
                                    [--phases 12]    (--sizes "": part 2 only)
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
    one way of saving it (``save`` returns whether it saved at that step): every step
    timed, and the steps that saved remembered."""

    def __init__(self, name: str, batch: int, save: Callable[[Loop, int], bool]) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, 4096)
        self.save = save
        self.step = 0
        self.times: dict[int, float] = {}  # seconds, by step
        self.saved: set[int] = set()
        self.state: State | None = None
        self.pending: list[Any] = []  # async_save futures

    def run(self, steps: int) -> float:
        """Seconds per step over ``steps``, finishing what is in flight."""
        started = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            self.model(self.x).pow(2).mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.step += 1
            if self.save(self, self.step):
                self.saved.add(self.step)
            self.times[self.step] = time.perf_counter() - t
        if self.state is not None:
            self.state.flush()
        for f in self.pending:
            f.result()
        self.pending.clear()
        return (time.perf_counter() - started) / steps

    def overhead(self, first: int) -> float:
        """What saving added, against this loop's own clean steps (no save in them or
        the two before): paired in time, so the VM's drift over minutes cancels."""
        steps = [s for s in self.times if s >= first]
        clean = [self.times[s] for s in steps if not {s, s - 1, s - 2} & self.saved]
        return sum(self.times[s] for s in steps) / (len(steps) * statistics.median(clean)) - 1

    def sd(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}


def policies(batch: int, shm: Path, disk: Path, phases: int) -> None:
    """elastic-run's default policy, then torch.save and async_save every N (N: the
    interval the policy chose), each over three intervals, their cost measured against
    their own clean steps; and a snapshot every step against no checkpointing, in
    interleaved phases of three steps (this VM's speed drifts by tens of percent over
    minutes: only paired measurements resolve a few percent)."""

    def with_state(policy: SnapshotPolicy) -> Callable[[Loop, int], bool]:
        def commit(loop: Loop, step: int) -> bool:
            if loop.state is None:
                os.environ[NODE_DIR_ENV] = str(shm / f"{batch}-{policy.every}")
                loop.state = State(model=loop.model, optimizer=loop.opt, snapshot_policy=policy)
            loop.state.commit()
            return loop.state._core.cadence.last == step

        return commit

    auto = Loop("elastic-run default (auto, 2% budget)", batch, with_state(SnapshotPolicy()))
    auto.run(12)  # measures steps, takes one probe snapshot, chooses
    assert auto.state is not None
    cadence = auto.state._core.cadence
    while cadence.interval == 0 and auto.step < 60:
        auto.run(1)
    first = auto.step + 1
    auto.run(3 * cadence.interval)
    n = cadence.interval
    path = disk / f"save-{batch}.pt"

    def torch_save(loop: Loop, step: int) -> bool:
        if step % n:
            return False
        torch.save(loop.sd(), path)
        return True

    def async_save(loop: Loop, step: int) -> bool:
        if step % n:
            return False
        for f in loop.pending:  # one in flight at a time, as its docs advise
            f.result()
        where = disk / f"dcp-{batch}-{step // n % 2}"  # the older one is complete
        loop.pending = [dcp.async_save(loop.sd(), checkpoint_id=str(where))]
        return True

    rows: list[tuple[str, float, str, float | None]] = []

    def blocked(loop: Loop, since: int) -> float | None:
        if loop.state is None:
            return None
        return loop.state.stats.blocked_seconds / max(loop.step - since + 1, 1)

    rows.append((auto.name, auto.overhead(first), str(cadence.at_risk), blocked(auto, 1)))
    for name, save, lost in (
        (f"torch.save every {n}", torch_save, str(n)),
        (f"DCP async_save every {n}", async_save, f"{2 * n} (one save in flight)"),
    ):
        loop = Loop(name, batch, save)
        loop.run(2)  # optimizer state allocated, first files written
        loop.run(3 * n)
        rows.append((name, loop.overhead(3), lost, None))
        del loop
    every = Loop("elastic-run, snapshot every step", batch, with_state(SnapshotPolicy(every=1)))
    none = Loop("no checkpointing", batch, lambda loop, step: False)
    for loop in (every, none):
        loop.run(2)
    assert every.state is not None
    every.state.stats.blocked_seconds = 0.0
    paired: dict[str, list[float]] = {every.name: [], none.name: []}
    for phase in range(phases):
        for loop in (every, none) if phase % 2 == 0 else (none, every):
            paired[loop.name].append(loop.run(3))
    ratio = statistics.median(paired[every.name]) / statistics.median(paired[none.name])
    rows.append((every.name, ratio - 1, "1", blocked(every, 3)))
    base = statistics.median(paired[none.name])
    print(f"\nbatch {batch}: {base:.2f} s a step without checkpoints", flush=True)
    for name, extra, lost, waited in rows:
        note = "" if waited is None else f"; blocked {waited * 1e3:.0f} ms a step"
        print(f"  {name:<40}{extra:>+8.1%}   steps lost: {lost}{note}", flush=True)
    print(
        f"  the default policy's own figures: step {(cadence.step_s or 0):.2f} s, snapshot "
        f"cost {(cadence.cost_s or 0) * 1e3:.0f} ms -> every {cadence.interval} steps",
        flush=True,
    )
    for loop in (auto, every):
        if loop.state is not None:
            loop.state.close()
    for slots in shm.glob(f"{batch}-*"):  # two slots of 1.2 GB each, in memory
        shutil.rmtree(slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000", help="state sizes in MB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batches", default="256,1024", help="batch sizes for part 2")
    ap.add_argument("--phases", type=int, default=12, help="every step vs none, part 2")
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
            "\nWhat each way of saving adds to the step time of a 101M-parameter MLP with "
            "Adam (1.2 GB of state)"
        )
        if not dist.is_initialized():  # async_save wants a process group
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        for batch in (int(b) for b in a.batches.split(",")):
            policies(batch, Path(shm), Path(disk), a.phases)
        print("\ntargets: blocking within 2x of the bare copy; the default policy <= 2%")


if __name__ == "__main__":
    main()
