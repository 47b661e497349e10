"""The agent's GPU metrics against nvidia-smi, sampled side by side while the snapshot
benchmark trains (a busy, changing GPU: utilisation, memory and power move).

It runs ``elastic-run --metrics-port 0 benchmarks/gpu_snapshot.py ARGS`` (its output is
passed through) and every ``--every`` seconds asks nvidia-smi, scrapes the agent's
/metrics, and asks nvidia-smi again. Printed at the end, per quantity (utilisation in
percentage points, memory in MiB, power in watts, the worker's own GPU memory against
nvidia-smi's compute-apps row): how far apart the readings were over all samples, and
over the samples where nvidia-smi read the same before and after (utilisation
unchanged, memory within 0.1 %, power within 2 %). While the load changes, two reads a
moment apart differ, and NVML averages utilisation over a sampling window of its own.

    python benchmarks/gpu_metrics.py [--every 1.0] [-- gpu_snapshot.py arguments]
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

SNAPSHOT = str(Path(__file__).resolve().parent / "gpu_snapshot.py")
MIB = 2**20


def scrape(port: int) -> dict[str, list[float]]:
    """The agent's GPU gauges, by metric name (one value per GPU, or per worker)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("elastic_run_gpu_"):
            for s in fam.samples:
                out.setdefault(s.name, []).append(s.value)
    return out


# quantity -> (the agent's metric, its scale to nvidia-smi's unit)
QUANTITIES = {
    "utilisation": ("elastic_run_gpu_utilization_ratio", 100.0),
    "memory used": ("elastic_run_gpu_memory_used_bytes", 1 / MIB),
    "power": ("elastic_run_gpu_power_watts", 1.0),
    "worker memory": ("elastic_run_gpu_process_memory_bytes", 1 / MIB),
}
# quantity -> (unit, how far nvidia-smi's two reads may differ, relative, to count as steady)
LIMITS = {
    "utilisation": (" points", 0.0),
    "memory used": (" MiB", 0.001),
    "power": (" W", 0.02),
    "worker memory": (" MiB", 0.001),
}


def read_smi(exe: str) -> dict[str, Any]:
    """nvidia-smi's reading of GPU 0 (worker memory: every compute process's)."""
    got: dict[str, Any] = {}
    gpus = smi(exe, "utilization.gpu,memory.used,power.draw")
    if gpus:
        for q, v in zip(("utilisation", "memory used", "power"), gpus[0], strict=True):
            x = number(v)
            if x is not None:
                got[q] = x
    apps = [x for x in (number(row[1]) for row in smi(exe, "pid,used_memory", "compute-apps")) if x]
    if apps:
        got["worker memory"] = apps
    return got


def smi(exe: str, query: str, kind: str = "gpu") -> list[list[str]]:
    out = subprocess.run(
        [exe, f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    return [[v.strip() for v in row] for row in csv.reader(io.StringIO(out)) if row]


def number(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:  # "[N/A]"
        return None


def spread(pairs: list[tuple[float, float]], unit: str) -> str:
    if not pairs:
        return "no samples"
    diffs = [abs(a - b) for a, b in pairs]
    line = f"{len(pairs)}, |ours - nvidia-smi| median {statistics.median(diffs):.2f}{unit}"
    line += f", max {max(diffs):.2f}{unit}"
    rel = [abs(a - b) / b * 100 for a, b in pairs if b]
    if rel and unit != " points":
        line += f" ({statistics.median(rel):.2f} % median, {max(rel):.2f} % max)"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("rest", nargs="*", help="arguments for gpu_snapshot.py (after --)")
    a = ap.parse_args()
    exe = shutil.which("nvidia-smi")
    if exe is None:
        print("skipped: no nvidia-smi here, nothing to compare the metrics with")
        return
    cmd = [sys.executable, "-m", "elastic", "--metrics-addr", "127.0.0.1", "--metrics-port",
           "0", SNAPSHOT, *a.rest]  # fmt: skip
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port: list[int] = []
    errors: list[str] = []

    def read_stderr() -> None:
        assert job.stderr is not None
        for line in job.stderr:
            errors.append(line)
            m = re.search(r"metrics on http://[^:]+:(\d+)/metrics", line)
            if m and not port:
                port.append(int(m.group(1)))

    def read_stdout() -> None:
        assert job.stdout is not None
        for line in job.stdout:
            print(line, end="", flush=True)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stderr, read_stdout)]
    for r in readers:
        r.start()
    # per quantity: (ours, nvidia-smi just before our scrape, nvidia-smi just after it)
    seen: dict[str, list[tuple[float, float, float]]] = {q: [] for q in QUANTITIES}
    while job.poll() is None:
        time.sleep(a.every)
        if not port:
            continue
        try:
            before = read_smi(exe)
            ours = scrape(port[0])
            after = read_smi(exe)
        except (OSError, subprocess.SubprocessError):
            continue
        for q, (metric, scale) in QUANTITIES.items():
            mine = ours.get(metric, [])
            if len(mine) == 1 and q in before and q in after:
                theirs = (before[q], after[q])
                if q == "worker memory":  # nvidia-smi lists every process: the closest
                    theirs = tuple(min(t, key=lambda v: abs(v - mine[0] * scale)) for t in theirs)
                seen[q].append((mine[0] * scale, *theirs))
    for r in readers:
        r.join(timeout=5)
    if job.returncode != 0:
        print("".join(errors[-40:]), file=sys.stderr)
        raise SystemExit(f"the snapshot benchmark failed (exit {job.returncode})")
    print(f"GPU metrics against nvidia-smi, sampled every {a.every:g} s during the run:")
    for q, rows in seen.items():
        unit, steady = LIMITS[q]
        print(f"  {q}: all samples: {spread([(o, b) for o, b, _ in rows], unit)}")
        still = [(o, (b + c) / 2) for o, b, c in rows if abs(b - c) <= steady * max(abs(b), 1)]
        print(f"  {' ' * len(q)}  nvidia-smi unchanged across our read: {spread(still, unit)}")


if __name__ == "__main__":
    main()
