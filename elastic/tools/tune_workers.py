"""How many DataLoader workers? Measure instead of guessing.

    elastic-run tune-workers examples/dataloader_workers.py:make_dataset --batch-size 64

Loads a fixed number of batches from the user's dataset with ``num_workers`` = 0, 1, 2,
4, ... up to the cores this process may use, and prints, for each, the start-up time (the
first batch: the workers are forked and warm up) and the steady rate. The recommendation
is the fastest steady rate, or the smallest worker count within 5% of it (more workers
cost memory and cores the training needs).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.agent.args import Parser, UsageError
from elastic.agent.devices import cpu_count


@dataclass(frozen=True)
class Trial:
    num_workers: int
    startup: float  # seconds to the first batch
    rate: float  # batches per second after it

    def samples_per_second(self, batch_size: int) -> float:
        return self.rate * batch_size


def candidates(cores: int) -> list[int]:
    """0, 1, 2, 4, 8 ... up to ``cores`` (and ``cores`` itself)."""
    out = [0, 1]
    n = 2
    while n <= cores:
        out.append(n)
        n *= 2
    if cores > 1 and out[-1] != cores:
        out.append(cores)
    return out


def measure(
    dataset: Any, batch_size: int, batches: int, num_workers: int, **loader_kw: Any
) -> Trial:
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers, **loader_kw
    )
    started = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter()
    done = 0
    for _ in range(batches):
        try:
            next(it)
        except StopIteration:  # a small dataset: go round again, as an epoch would
            it = iter(loader)
            next(it)
        done += 1
    end = time.perf_counter()
    del it
    return Trial(num_workers, first - started, done / max(end - first, 1e-9))


def tune(
    dataset: Any,
    batch_size: int = 32,
    batches: int = 50,
    workers: Sequence[int] | None = None,
    report: Callable[[Trial], None] = lambda t: None,
    nproc_per_node: int = 1,
    **loader_kw: Any,
) -> list[Trial]:
    """Time each worker count on ``dataset``; ``report`` sees each result as it comes.
    By default counts go up to this process's share of the cores: the training runs
    ``nproc_per_node`` processes per node, each with its own loader workers."""
    trials = []
    for n in workers if workers is not None else candidates(core_share(nproc_per_node)):
        t = measure(dataset, batch_size, batches, n, **loader_kw)
        report(t)
        trials.append(t)
    return trials


def core_share(nproc_per_node: int) -> int:
    """The cores one of ``nproc_per_node`` training processes may give its loader."""
    return max(cpu_count() // max(nproc_per_node, 1), 1)


def recommend(trials: list[Trial], tolerance: float = 0.05) -> Trial:
    best = max(t.rate for t in trials)
    return min((t for t in trials if t.rate >= best * (1 - tolerance)), key=lambda t: t.num_workers)


def load_factory(spec: str) -> Callable[..., Any]:
    """``path/to/file.py:function`` or ``package.module:function``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not name:
        raise UsageError(f"{spec!r}: expected FILE.py:FUNCTION or MODULE:FUNCTION")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise UsageError(f"{target}: no such file")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise UsageError(f"{target}: cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UsageError(f"{target}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(f"{spec}: {name} is not a function in {target}")
    made: Callable[..., Any] = factory
    return made


def main(argv: Sequence[str]) -> int:
    p = Parser(
        prog="elastic-run tune-workers",
        description="Time DataLoader num_workers on your dataset; recommend one.",
    )
    p.add_argument("dataset", help="FILE.py:FUNCTION or MODULE:FUNCTION returning a Dataset")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=50, help="batches timed per setting")
    p.add_argument(
        "--workers",
        default=None,
        help="worker counts to try, like 0,2,4 (default: 0, 1, 2, 4, ... up to the cores)",
    )
    p.add_argument("--pin-memory", action="store_true")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=int(os.environ.get("PET_NPROC_PER_NODE", "1") or 1),
        help="training processes per node, each with its own loader workers: counts go up "
        "to its share of the cores (default: 1, or $PET_NPROC_PER_NODE)",
    )
    try:
        a = p.parse_args(list(argv))
        if a.batch_size < 1 or a.batches < 1 or a.nproc_per_node < 1:
            raise UsageError("--batch-size, --batches and --nproc-per-node must be at least 1")
        workers = [int(w) for w in a.workers.split(",")] if a.workers else None
        if workers is not None and any(w < 0 for w in workers):
            raise UsageError("--workers: counts must be >= 0")
        dataset = load_factory(a.dataset)()
    except ValueError as e:  # UsageError, or int() of a bad --workers value
        print(f"elastic-run tune-workers: error: {e}", file=sys.stderr)
        return 2
    share = core_share(a.nproc_per_node)
    print(
        f"{len(dataset)} samples, batch size {a.batch_size}, {a.batches} batches per "
        f"setting; {cpu_count()} core(s) here, {a.nproc_per_node} training process(es) per "
        f"node assumed: up to {share} loader worker(s) each"
    )
    print(f"{'num_workers':>11}  {'startup':>9}  {'batches/s':>10}  {'samples/s':>10}")

    def show(t: Trial) -> None:
        print(
            f"{t.num_workers:>11}  {t.startup:>8.2f}s  {t.rate:>10.1f}  "
            f"{t.samples_per_second(a.batch_size):>10.0f}",
            flush=True,
        )

    trials = tune(
        dataset,
        a.batch_size,
        a.batches,
        workers,
        report=show,
        nproc_per_node=a.nproc_per_node,
        pin_memory=a.pin_memory,
    )
    best = recommend(trials)
    print(
        f"recommended: num_workers={best.num_workers} "
        f"({best.samples_per_second(a.batch_size):.0f} samples/s)"
    )
    return 0
