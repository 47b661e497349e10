"""Worker failures: what ``@record`` wrote to TORCHELASTIC_ERROR_FILE, what the worker
printed last, whether it was a consequence of a peer vanishing, and the root-cause report.

A failure's ``detail`` dict travels through etcd (JSON), so every agent can print the same
report. The root cause is the earliest failure that is not a consequence of another
(``rendezvous.rules.earliest_failure``).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elastic.contract import peer_gone


def last_line(text: str) -> str:
    """The exception line of a traceback (the last non-empty line)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    local_rank: int
    pid: int
    exitcode: int  # negative: killed by that signal
    time: float
    message: str = ""
    traceback: str = ""
    error_file: str = ""  # "" when the script has no @record (no file was written)
    consequence: bool = False  # it failed because a peer vanished (see peer_gone)

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
    stderr_tail: str = "",
) -> WorkerFailure:
    """A failed worker, from its error file if it wrote one, else from what it printed
    last (``stderr_tail``: its last traceback)."""
    message, tb, stamp = read_error_file(error_file)
    written = bool(message or tb)
    if not written:
        message, tb = last_line(stderr_tail), stderr_tail
    return WorkerFailure(
        rank,
        local_rank,
        pid,
        exitcode,
        stamp or seen_at or time.time(),
        message,
        tb[-4000:],
        error_file if written else "",
        consequence=exitcode > 0 and peer_gone(f"{message}\n{last_line(tb)}"),
    )


def summarize(failures: list[WorkerFailure], node_id: str, host: str) -> dict[str, Any]:
    """The detail a node reports to the job: its first failure that is a cause leads."""
    ordered = sorted(failures, key=lambda f: (f.consequence, f.time))
    first = ordered[0]
    msg = last_line(first.message)
    summary = f"rank {first.rank} (local_rank {first.local_rank}) on {node_id}: {first.how}"
    return {
        "summary": summary + (f": {msg}" if msg else ""),
        "host": host,
        "failures": [asdict(f) for f in ordered],
    }


DOCS = "https://pytorch.org/docs/stable/elastic/errors.html"


def format_report(title: str, root: dict[str, Any]) -> str:
    """A torchrun-like block naming the root cause, for the agent's last words."""
    bar = "=" * 72
    lines = [bar, title, "-" * 72, "Root Cause (first observed failure):"]
    failures = root.get("failures") or []
    f = failures[0] if failures and isinstance(failures[0], dict) else {}
    when = f.get("time") or root.get("time")
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
        elif not wf.error_file and wf.exitcode > 0:
            lines.append(f"  traceback : To enable traceback see: {DOCS}")
            lines.append("              (decorate the script's main() with @record)")
        others = len(failures) - 1
        if others > 0:
            lines.append(f"  (and {others} more failed worker(s) on that node)")
    else:
        lines.append(f"  summary   : {root.get('summary', 'workers failed')}")
    lines.append(bar)
    return "\n".join(lines)
