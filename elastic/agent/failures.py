"""Worker failures: what ``@record`` wrote to TORCHELASTIC_ERROR_FILE, what the worker
printed last, whether it was a consequence of a peer vanishing, and the root-cause report.

A node's ``FailureReport`` travels through etcd (``rendezvous.records``, where its JSON is
encoded and validated), so every agent can print the same report. The root cause is the
earliest failure that is not a consequence of another (``rendezvous.rules.earliest_failure``).
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from elastic.contract import peer_gone
from rendezvous.records import FailureReport, WorkerFailure

__all__ = ["FailureReport", "WorkerFailure", "collect", "format_report", "summarize"]


# what the C++ runtime prints as the process aborts after the exception: gloo's thread,
# freeing a failed collective's tensors while the interpreter exits, takes the process
# down with SIGABRT (about 1 in 3 peers lost mid-transfer of 16 MB, torch 2.13)
_EPILOGUE = "terminate called"


# pybind11 ends an error raised in Python code that C++ called (a DDP comm hook's future
# callback, say) with that code's frames, after the exception's line: "At:", then one
# "file(line): function" line a frame (each line perhaps with a "[rank0]:" prefix)
_PREFIX = r"^(?:\[[^\]]*\]:)?\s*"
_AT = re.compile(_PREFIX + r"At:$")
_FRAME = re.compile(_PREFIX + r"\S.*\(\d+\): \S+$")


def last_line(text: str) -> str:
    """The exception line of a traceback: its last non-empty line, past what the C++
    runtime printed as the process then aborted (``_EPILOGUE``) and the frames pybind11
    lists after an exception raised through C++ (``_AT``)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    while lines and _EPILOGUE in lines[-1]:
        lines.pop()
    frames = len(lines)
    while frames and _FRAME.match(lines[frames - 1]):
        frames -= 1
    if 1 < frames < len(lines) and _AT.match(lines[frames - 1]):
        lines = lines[: frames - 1]
    return lines[-1] if lines else ""


def died_of_its_exception(exitcode: int) -> bool:
    """The worker ended because of the exception it raised: it exited non-zero, or
    aborted as it exited (``_EPILOGUE``)."""
    return exitcode > 0 or exitcode == -signal.SIGABRT


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
        consequence=died_of_its_exception(exitcode) and peer_gone(f"{message}\n{last_line(tb)}"),
    )


def summarize(failures: list[WorkerFailure], node_id: str, host: str) -> FailureReport:
    """The report a node gives the job: its first failure that is a cause leads."""
    ordered = sorted(failures, key=lambda f: (f.consequence, f.time))
    first = ordered[0]
    msg = last_line(first.message)
    summary = f"rank {first.rank} (local_rank {first.local_rank}) on {node_id}: {first.how}"
    return FailureReport(summary + (f": {msg}" if msg else ""), host, tuple(ordered))


DOCS = "https://pytorch.org/docs/stable/elastic/errors.html"


def format_report(title: str, root: FailureReport | None) -> str:
    """A torchrun-like block naming the root cause, for the agent's last words."""
    bar = "=" * 72
    lines = [bar, title, "-" * 72, "Root Cause (first observed failure):"]
    root = root or FailureReport(summary="")
    f = root.failures[0] if root.failures else None
    when = (f.time if f else 0.0) or root.time
    stamp = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(when)) if when else "?"
    lines.append(f"  time      : {stamp}")
    lines.append(f"  node      : {root.node or '?'} (host {root.host or '?'})")
    if f is not None:
        lines.append(f"  rank      : {f.rank} (local_rank: {f.local_rank})")
        how = "" if f.exitcode >= 0 else f"{f.how}, "  # torchrun shows the number alone
        lines.append(f"  exitcode  : {f.exitcode} ({how}pid: {f.pid})")
        lines.append(f"  error_file: {f.error_file or '<N/A>'}")
        if f.message:
            lines.append(f"  message   : {f.message.strip()}")
        if f.traceback:
            lines.append("  traceback :")
            lines += ["    " + line for line in f.traceback.rstrip().splitlines()]
        elif not f.error_file and f.exitcode > 0:
            lines.append(f"  traceback : To enable traceback see: {DOCS}")
            lines.append("              (decorate the script's main() with @record)")
        others = len(root.failures) - 1
        if others > 0:
            lines.append(f"  (and {others} more failed worker(s) on that node)")
    else:
        lines.append(f"  summary   : {root.summary or 'workers failed'}")
    lines.append(bar)
    return "\n".join(lines)
