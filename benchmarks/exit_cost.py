"""What a worker's interpreter exit costs, side by side (``elastic.worker.quick_exit``).

Four kinds of worker train a small model for a few steps and end, ``--repeat`` times,
taking turns so that a slow spell of the machine hits all alike:

- ``script``: a plain torch script, as torchrun runs it (Python's own exit);
- ``state``: the same under ``elastic.State`` (the heap frozen at exit);
- ``forked``: forked from a parent that imported torch, as ``--start-method forkserver``
  did before (the child exits as Python does);
- ``forked-frozen``: forked from a parent that froze its heap first, as the fork
  server now does.

Printed: each kind's median seconds from the script's last line to the process's end,
its median CPU seconds in all, and both as ratios to ``script``'s (or ``forked``'s).

    python benchmarks/exit_cost.py [--repeat 8]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import subprocess
import sys
import time

WORK = """
import torch
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
opt = torch.optim.Adam(model.parameters())
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(16, 64)).sum().backward()
    opt.step()
"""
STATE = "import elastic\nstate = elastic.State(model=model, optimizer=opt)\n"
LAST = "print('done', flush=True)\n"


def spawned(code: str) -> tuple[float, float]:
    """(seconds from the last line to the end, CPU seconds) of ``python -c code``."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"done\n"
    said = time.perf_counter()
    _, status, usage = os.wait4(proc.pid, 0)
    ended = time.perf_counter()
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, proc.returncode
    return ended - said, usage.ru_utime + usage.ru_stime


def forked(freeze: bool) -> tuple[float, float]:
    """The same for a child forked from a parent (a fresh one per run: ``python -c``)
    that imported torch, and froze its heap first if ``freeze``."""
    parent = f"""
import gc, os, sys, time, torch, torch.distributed
{"gc.freeze()" if freeze else ""}
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    exec(compile({WORK!r}, "work", "exec"))
    os.write(w, b"x")
    sys.exit(0)
os.close(w)
os.read(r, 1)
said = time.perf_counter()
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - said, usage.ru_utime + usage.ru_stime, status)
"""
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True)
    took, cpu, status = out.stdout.split()
    assert status == "0", out.stderr
    return float(took), float(cpu)


KINDS = {
    "script": lambda: spawned(WORK + LAST),
    "state": lambda: spawned(WORK + STATE + LAST),
    "forked": lambda: forked(freeze=False),
    "forked-frozen": lambda: forked(freeze=True),
}
BASE = {"script": "script", "state": "script", "forked": "forked", "forked-frozen": "forked"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args()
    gc.collect()
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    for _ in range(args.repeat):
        for kind, run in KINDS.items():
            results[kind].append(run())
    exit_s = {k: statistics.median(t for t, _ in v) for k, v in results.items()}
    cpu_s = {k: statistics.median(c for _, c in v) for k, v in results.items()}
    print(
        f"{'kind':<14} {'exit s':>7} {'ratio':>6} {'CPU s':>6} {'ratio':>6}"
        f"   (median of {args.repeat})"
    )
    for kind in KINDS:
        base = BASE[kind]
        print(
            f"{kind:<14} {exit_s[kind]:7.3f} {exit_s[kind] / exit_s[base]:5.2f}x "
            f"{cpu_s[kind]:6.2f} {cpu_s[kind] / cpu_s[base]:5.2f}x"
        )
    print(
        f"(children's CPU: this machine's {os.cpu_count()} cores, "
        f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime:.0f} s user in all)"
    )


if __name__ == "__main__":
    main()
