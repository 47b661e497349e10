"""What elastic.State snapshots cost a GPU training loop (run it under elastic-run, on a
machine with CUDA: the snapshots go to the node's shared memory).

An MLP (``--layers`` x Linear(``--width``, ``--width``); by default 134M parameters, 1.6
GB with Adam's state) trains on one GPU. For each batch size: the mean step time
(forward, backward, optimizer.step) with no snapshot; with ``State.commit()``
snapshotting every step (straight into the page-locked slot, and staged through pinned
memory as where CUDA refuses to pin the slot), every 10 steps and at the interval the
cost policy chooses; and with ``torch.save`` and
``torch.distributed.checkpoint.async_save`` every step and every 10 steps. Each as a
ratio to no snapshot, with the time the training thread was blocked per snapshot
against a bare device-to-host copy of the same bytes into pinned memory.

    elastic-run benchmarks/gpu_snapshot.py [--batches 256,2048] [--width 4096]
                                           [--layers 8] [--steps 30] [--no-peers]
                                           [--peers-at 256]

With ``--device cpu`` it runs the same loop on the CPU (a check of the script itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import elastic
from elastic.contract import POLICY_ENV, SnapshotPolicy
from elastic.worker.pinning import PIN_ENV

WARM = 3  # steps not timed: allocations, the first snapshots' slot set-up


def sync(device: torch.device) -> None:
    """Wait for the training stream, as a loop that reads its loss every step does; not
    for the whole device, which would wait for the snapshot's copy on its side stream."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def model_and_opt(
    device: torch.device, width: int, layers: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = model.to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    n: int,
    after: Callable[[int], None] = lambda i: None,
) -> float:
    """The mean time of ``n`` steps after ``WARM`` untimed ones."""
    times = []
    for i in range(n + WARM):
        sync(x.device)
        t = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        after(i)
        sync(x.device)
        times.append(time.perf_counter() - t)
    return statistics.mean(times[WARM:])


def bare_copy(nbytes: int, device: torch.device) -> float:
    """Seconds to copy ``nbytes`` from the device into pinned host memory (best of 3)."""
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        host.copy_(flat, non_blocking=pinned)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def with_state(
    device: torch.device, a: argparse.Namespace, x: torch.Tensor, every: int | str, pin: bool
) -> tuple[float, float, str]:
    """(mean step, training-thread block per snapshot, what the policy chose)."""
    os.environ[POLICY_ENV] = SnapshotPolicy(every=every).encode()
    os.environ[PIN_ENV] = "1" if pin else "0"
    model, opt = model_and_opt(device, a.width, a.layers)
    state = elastic.State(model=model, optimizer=opt)
    state.restore()
    n = a.steps if every == 1 else 10 * a.steps // 3
    warm: list[tuple[float, int]] = []

    def commit(i: int) -> None:
        state.commit()
        if i == WARM - 1:  # the first snapshots map and page-lock the slots: not timed
            warm.append((state.stats.blocked_seconds, state.stats.snapshots))

    took = steps(model, opt, x, n, commit)
    state.flush()
    s = state.stats
    if s.snapshots > warm[0][1]:
        blocked = (s.blocked_seconds - warm[0][0]) / (s.snapshots - warm[0][1])
    else:  # none after the warm-up (the policy's interval is longer than the run)
        blocked = s.blocked_seconds / max(s.snapshots, 1)
    chose = state._core.cadence
    label = ""
    if every == "auto":
        label = (
            f" (chose every {chose.interval}: snapshot {(chose.cost_s or 0) * 1e3:.0f} ms, "
            f"step {(chose.step_s or 0) * 1e3:.1f} ms; {state.stats.snapshots} taken)"
        )
    state.close()
    return took, blocked, label


def peers(device: torch.device, a: argparse.Namespace, x: torch.Tensor, base: float) -> None:
    """torch.save and DCP's async_save at the same intervals as the snapshots."""
    model, opt = model_and_opt(device, a.width, a.layers)
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    with tempfile.TemporaryDirectory() as d:
        for every, n in ((1, 4), (10, 2 * a.steps)):

            def save(i: int, every: int = every) -> None:
                if i % every == 0:
                    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                    torch.save(sd, os.path.join(d, "state.pt"))

            took = steps(model, opt, x, n, save)
            print(
                f"  torch.save every {every:>2} step(s): {took * 1e3:.1f} ms = {took / base:.2f}x"
            )
            pending: list = []

            def async_save(i: int, every: int = every, pending: list = pending) -> None:
                if i % every == 0:
                    if pending:
                        pending.pop().result()  # one in flight at a time, as its docs advise
                    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                    pending.append(
                        dcp.async_save(sd, checkpoint_id=os.path.join(d, f"dcp{every}-{i}"))
                    )

            took = steps(model, opt, x, n, async_save)
            for f in pending:
                f.result()
            print(
                f"  torch.distributed.checkpoint.async_save every {every:>2} step(s): "
                f"{took * 1e3:.1f} ms = {took / base:.2f}x"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,2048")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-peers", action="store_true", help="skip torch.save and async_save")
    ap.add_argument(
        "--peers-at", type=int, default=0, help="the batch size they run at (default: the first)"
    )
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device here (--device cpu runs the loop on the CPU)")
        return
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, _ = model_and_opt(device, a.width, a.layers)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    del model, _
    nbytes = 3 * params  # parameters, Adam's exp_avg and exp_avg_sq
    floor = bare_copy(nbytes, device)
    print(
        f"model {a.layers} x Linear({a.width}, {a.width}): parameters {params / 1e9:.2f} GB, "
        f"with Adam's state {nbytes / 1e9:.2f} GB on {device}; bare device-to-host copy "
        f"{floor * 1e3:.1f} ms ({nbytes / floor / 1e9:.1f} GB/s)"
    )
    batches = [int(b) for b in a.batches.split(",")]
    for batch in batches:
        x = torch.randn(batch, a.width, device=device)
        model, opt = model_and_opt(device, a.width, a.layers)
        base = steps(model, opt, x, a.steps)
        del model, opt
        print(f"batch {batch}: mean step {base * 1e3:.1f} ms with no snapshot")
        runs: list[tuple[int | str, bool, str]] = [
            (1, True, "every step, into the page-locked slot"),
            (1, False, "every step, staged through pinned memory"),
            (10, True, "every 10 steps"),
            ("auto", True, "at the policy's interval"),
        ]
        for every, pin, what in runs:
            took, blocked, chose = with_state(device, a, x, every, pin)
            print(
                f"  elastic.State {what}: {took * 1e3:.1f} ms = {took / base:.2f}x; training "
                f"thread blocked {blocked * 1e3:.1f} ms a snapshot = {blocked / floor:.2f}x "
                f"the bare copy{chose}",
                flush=True,
            )
        if not a.no_peers and batch == (a.peers_at or batches[0]):
            peers(device, a, x, base)


if __name__ == "__main__":
    main()
