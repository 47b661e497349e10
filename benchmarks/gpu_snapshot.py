"""What elastic.State snapshots cost a GPU training loop (run it on a machine with CUDA).

A ~134M-parameter MLP (8 x Linear(4096, 4096)) with Adam on one GPU: 1.6 GB of parameters
and optimizer state in device memory. Step time (forward, backward, optimizer.step) with
no snapshot; with ``State.commit()`` snapshotting every step and every 10 steps (run it
under elastic-run: snapshots go to the node's shared memory), with the time the training
thread is blocked per snapshot against a bare device-to-host copy of the same bytes into
pinned memory; and with ``torch.save`` and ``torch.distributed.checkpoint.async_save``
every 10 steps. Mean step times, as ratios to no snapshot.

    elastic-run benchmarks/gpu_snapshot.py [--steps 30] [--batch 256]
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


def model_and_opt(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4096, 4096) for _ in range(8)]
    model = torch.nn.Sequential(*layers).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def steps(model, opt, x, n: int, after: Callable[[int], None] = lambda i: None) -> list[float]:
    times = []
    for i in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        after(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times[3:]  # warm-up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    device = torch.device("cuda", 0)
    x = torch.randn(a.batch, 4096, device=device)
    model, opt = model_and_opt(device)
    base = statistics.mean(steps(model, opt, x, a.steps))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # + Adam m, v
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    flat = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    torch.cuda.synchronize()
    t = time.perf_counter()
    host.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()
    floor = time.perf_counter() - t
    print(
        f"state {nbytes / 1e9:.2f} GB; mean step {base * 1e3:.1f} ms, no snapshots, batch {a.batch}"
    )
    print(
        f"bare device-to-host copy of the same bytes: {floor * 1e3:.1f} ms "
        f"({nbytes / floor / 1e9:.1f} GB/s)"
    )
    n = 10 * a.steps // 3  # ten times as many steps when saving every 10
    for every in (1, 10, "auto"):
        os.environ[POLICY_ENV] = SnapshotPolicy(every=every).encode()
        model, opt = model_and_opt(device)
        state = elastic.State(model=model, optimizer=opt)
        state.restore()
        took = statistics.mean(
            steps(model, opt, x, a.steps if every == 1 else n, lambda i, s=state: s.commit())
        )
        blocked = state.stats.blocked_seconds / max(state.stats.snapshots, 1)
        chose = state._core.cadence
        state.close()
        if every == "auto":
            every = (
                f"auto (chose {chose.interval}: snapshot {(chose.cost_s or 0) * 1e3:.0f} ms, "
                f"step {(chose.step_s or 0) * 1e3:.1f} ms; {state.stats.snapshots} taken)"
            )
        print(
            f"elastic.State snapshot every {every:>2} step(s): mean step {took * 1e3:.1f} ms = "
            f"{took / base:.2f}x; training thread blocked {blocked * 1e3:.1f} ms a snapshot "
            f"= {blocked / floor:.2f}x the bare copy"
        )
    model, opt = model_and_opt(device)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.pt")

        def save(i: int) -> None:
            if i % 10 == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

        took = statistics.mean(steps(model, opt, x, n, save))
        print(f"torch.save every 10 steps: mean step {took * 1e3:.1f} ms = {took / base:.2f}x")
        if not dist.is_initialized():
            dist.init_process_group("cpu:gloo,cuda:nccl")  # async_save needs a CPU backend
        pending: list = []

        def async_save(i: int) -> None:
            if i % 10 == 0:
                if pending:
                    pending.pop().result()  # one in flight at a time, as its docs advise
                sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                pending.append(dcp.async_save(sd, checkpoint_id=os.path.join(d, f"dcp{i}")))

        took = statistics.mean(steps(model, opt, x, n, async_save))
        for f in pending:
            f.result()
        print(
            f"torch.distributed.checkpoint.async_save every 10 steps: mean step "
            f"{took * 1e3:.1f} ms = {took / base:.2f}x"
        )


if __name__ == "__main__":
    main()
