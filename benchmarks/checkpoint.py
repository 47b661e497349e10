"""What a snapshot costs the training loop, against a bare memory copy and torch.save.

Part 1, per state size (100 MB and 1 GB of fp32 parameters plus SGD momentum): the time
the training thread is blocked by

  - a bare memory copy of the same tensors into preallocated memory (the floor),
  - ``State.snapshot()`` copying everything into shared memory before returning,
  - ``State.commit()`` as training uses it: parameters and optimizer state copied while the
    next forward/backward runs (measured: the time commit() takes, plus the time the next
    optimizer.step() waits for the copy, with a forward/backward in between),
  - ``torch.save`` of the state to a file on disk.

Part 2: training throughput of a ~100M-parameter MLP with Adam, with ``commit()``
snapshotting every step (1.2 GB of parameters and Adam state) against the same loop
without it, at two batch sizes: the copy hides behind the next forward/backward, so what
it costs depends on how long that takes.

    python benchmarks/checkpoint.py [--sizes 100,1000] [--repeat 5] [--batches 256,1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from elastic import SnapshotPolicy, State
from elastic.contract import NODE_DIR_ENV


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


def throughput(batch: int, phases: int, shm: Path, every: int = 1) -> dict[str, float]:
    """Seconds per step with and without commit(), in interleaved phases of three steps
    on the same model (this VM's speed drifts by tens of percent over a minute; A/B/B/A
    phases cancel that drift out of the comparison)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    os.environ[NODE_DIR_ENV] = str(shm / f"train{batch}-{every}")
    state = State(model=model, optimizer=opt, snapshot_policy=SnapshotPolicy(every=every))
    x = torch.randn(batch, 4096)

    def step(commit: bool) -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if commit:
            state.commit()

    for _ in range(2):  # allocate optimizer state and both snapshot slots
        step(True)
    state.flush()
    state.stats.blocked_seconds = 0.0
    runs: dict[bool, list[float]] = {False: [], True: []}
    n = max(3, every)  # a phase holds at least one snapshot
    for phase in range(phases):
        for commit in (False, True) if phase % 2 == 0 else (True, False):
            t = time.perf_counter()
            for _ in range(n):
                step(commit)
            state.flush()
            runs[commit].append((time.perf_counter() - t) / n)
    state.close()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": state.stats.snapshot_bytes,
        "blocked": state.stats.blocked_seconds / (n * phases),
        "base": statistics.median(runs[False]),
        "commit": statistics.median(runs[True]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000", help="state sizes in MB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batches", default="256,1024", help="batch sizes for part 2")
    ap.add_argument("--phases", type=int, default=12)
    a = ap.parse_args()
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=shm_root) as shm, tempfile.TemporaryDirectory() as disk:
        print(
            "Seconds the training thread is blocked (median of "
            f"{a.repeat}); ratio to the bare memory copy"
        )
        for mb in (int(s) for s in a.sizes.split(",")):
            r = blocking(mb, a.repeat, Path(shm) / f"s{mb}", Path(disk))
            base = r["bare copy"]
            print(f"\nstate {r['bytes'] / 1e6:.0f} MB")
            for k in ("bare copy", "snapshot (full copy)", "commit (overlapped)", "torch.save"):
                print(f"  {k:<24}{r[k]:>9.3f}s{r[k] / base:>8.2f}x")
        print(
            "\nTraining throughput with commit() against the same loop without it "
            f"(median of {a.phases} interleaved phases)"
        )
        cases = [(int(b), 1) for b in a.batches.split(",")] + [(int(a.batches.split(",")[0]), 10)]
        for batch, every in cases:
            t = throughput(batch, a.phases, Path(shm), every)
            loss = (t["commit"] / t["base"] - 1) * 100
            print(
                f"  {t['params'] / 1e6:.0f}M-param MLP + Adam ({t['bytes'] / 1e9:.2f} GB of "
                f"state), batch {batch:>4}, snapshot every {every:>2} step(s): "
                f"{t['base']:.2f}s/step without, {t['commit']:.2f}s/step with: "
                f"{loss:+.1f}%; blocked {t['blocked'] * 1000:.0f}ms/step"
            )
        print("\ntargets: blocking within 2x of the bare copy; throughput loss under 5%")


if __name__ == "__main__":
    main()
