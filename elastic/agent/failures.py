"""Worker failures: what ``@record`` wrote to TORCHELASTIC_ERROR_FILE, and the summary.

The root cause is the earliest failure by time, as torchrun reports it. A failure's
``detail`` dict travels through etcd (JSON), so every agent can print the same report.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    local_rank: int
    pid: int
    exitcode: int  # negative: killed by that signal
    time: float
    message: str = ""
    traceback: str = ""
    error_file: str = ""

    @property
    def how(self) -> str:
        if self.exitcode < 0:
            try:
                return f"signal {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"signal {-self.exitcode}"
        return f"exit code {self.exitcode}"


def read_error_file(path: str) -> tuple[str, str, float | None]:
    """(message, traceback, timestamp) from torch's error file; empty when absent or odd."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return "", "", None
    msg = data.get("message", "") if isinstance(data, dict) else ""
    if isinstance(msg, str):
        return msg, "", None
    if not isinstance(msg, dict):
        return "", "", None
    extra = msg.get("extraInfo") or {}
    stamp = extra.get("timestamp") if isinstance(extra, dict) else None
    try:
        when = float(stamp) if stamp is not None else None
    except (TypeError, ValueError):
        when = None
    tb = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
    return str(msg.get("message", "")), str(tb), when


def collect(
    rank: int,
    local_rank: int,
    pid: int,
    exitcode: int,
    error_file: str,
    seen_at: float | None = None,
) -> WorkerFailure:
    message, tb, stamp = read_error_file(error_file)
    return WorkerFailure(
        rank,
        local_rank,
        pid,
        exitcode,
        stamp or seen_at or time.time(),
        message,
        tb[-4000:],
        error_file,
    )


def summarize(failures: list[WorkerFailure], node_id: str, host: str) -> dict:
    """The detail a node reports to the job: its first failure leads."""
    first = min(failures, key=lambda f: f.time)
    msg = first.message.strip().splitlines()[-1] if first.message.strip() else ""
    summary = f"rank {first.rank} (local_rank {first.local_rank}) on {node_id}: {first.how}"
    return {
        "summary": summary + (f": {msg}" if msg else ""),
        "host": host,
        "failures": [asdict(f) for f in sorted(failures, key=lambda f: f.time)],
    }


def format_report(title: str, root: dict) -> str:
    """A torchrun-like block naming the root cause, for the agent's last words."""
    bar = "=" * 72
    lines = [bar, title, "-" * 72, "Root Cause (first observed failure):"]
    failures = root.get("failures") or []
    f = failures[0] if failures and isinstance(failures[0], dict) else {}
    when = root.get("time") or f.get("time")
    stamp = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(float(when))) if when else "?"
    lines.append(f"  time      : {stamp}")
    lines.append(f"  node      : {root.get('node', '?')} (host {root.get('host', '?')})")
    if f:
        wf = WorkerFailure(**{k: f[k] for k in WorkerFailure.__dataclass_fields__ if k in f})
        lines.append(f"  rank      : {wf.rank} (local_rank: {wf.local_rank})")
        lines.append(f"  exitcode  : {wf.how} (pid: {wf.pid})")
        lines.append(f"  error_file: {wf.error_file or '<N/A>'}")
        if wf.message:
            lines.append(f"  message   : {wf.message.strip()}")
        if wf.traceback:
            lines.append("  traceback :")
            lines += ["    " + line for line in wf.traceback.rstrip().splitlines()]
        others = len(failures) - 1
        if others > 0:
            lines.append(f"  (and {others} more failed worker(s) on that node)")
    else:
        lines.append(f"  summary   : {root.get('summary', 'workers failed')}")
    lines.append(bar)
    return "\n".join(lines)
