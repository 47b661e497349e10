"""The agent's GPU metrics against nvidia-smi, sampled side by side while the snapshot
benchmark trains (a busy, changing GPU: utilisation, memory and power move).

It runs ``elastic-run --metrics-port 0 benchmarks/gpu_snapshot.py ARGS`` (its output is
passed through) and every ``--every`` seconds scrapes the agent's /metrics and then asks
nvidia-smi. Printed at the end: per quantity, the samples compared and how far apart
the two readings were (utilisation in percentage points: NVML averages it over a
sampling window of its own, so two reads a moment apart can differ while the load
changes; memory in per cent; power in watts and per cent; the worker's own GPU memory
against nvidia-smi's compute-apps row).

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


def spread(pairs: list[tuple[float, float]], unit: str, relative: bool = False) -> str:
    if not pairs:
        return "no samples"
    diffs = [abs(a - b) for a, b in pairs]
    line = f"{len(pairs)} samples, |ours - nvidia-smi| median {statistics.median(diffs):.2f}{unit}"
    line += f", max {max(diffs):.2f}{unit}"
    if relative:
        rel = [abs(a - b) / b * 100 for a, b in pairs if b]
        if rel:
            line += f" ({statistics.median(rel):.2f} % median, {max(rel):.2f} % max)"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("rest", nargs="*", help="arguments for gpu_snapshot.py (after --)")
    a = ap.parse_args()
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise SystemExit("no nvidia-smi here: nothing to compare the metrics with")
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
    util: list[tuple[float, float]] = []
    used: list[tuple[float, float]] = []
    power: list[tuple[float, float]] = []
    proc: list[tuple[float, float]] = []
    while job.poll() is None:
        time.sleep(a.every)
        if not port:
            continue
        try:
            ours = scrape(port[0])
        except OSError:
            continue
        gpus = smi(exe, "utilization.gpu,memory.used,power.draw")
        apps = smi(exe, "pid,used_memory", kind="compute-apps")
        if not ours.get("elastic_run_gpu_utilization_ratio") or not gpus:
            continue
        g = gpus[0]
        util.append((ours["elastic_run_gpu_utilization_ratio"][0] * 100, float(g[0])))
        used.append((ours["elastic_run_gpu_memory_used_bytes"][0] / MIB, float(g[1])))
        watts = number(g[2])
        if ours.get("elastic_run_gpu_power_watts") and watts is not None:
            power.append((ours["elastic_run_gpu_power_watts"][0], watts))
        mine = ours.get("elastic_run_gpu_process_memory_bytes", [])
        theirs = [t for t in (number(row[1]) for row in apps) if t is not None]
        if len(mine) == 1 and theirs:
            closest = min(theirs, key=lambda t: abs(t - mine[0] / MIB))
            proc.append((mine[0] / MIB, closest))
    for r in readers:
        r.join(timeout=5)
    if job.returncode != 0:
        print("".join(errors[-40:]), file=sys.stderr)
        raise SystemExit(f"the snapshot benchmark failed (exit {job.returncode})")
    print(f"GPU metrics against nvidia-smi, sampled every {a.every:g} s during the run:")
    print(f"  utilisation: {spread(util, ' points')}")
    print(f"  memory used: {spread(used, ' MiB', relative=True)}")
    print(f"  power:       {spread(power, ' W', relative=True)}")
    print(f"  the worker's GPU memory: {spread(proc, ' MiB', relative=True)}")


if __name__ == "__main__":
    main()
