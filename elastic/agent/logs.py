"""Where worker output goes: the console with a ``[rankN]:`` prefix, files, or both.

Follows torchrun's ``--redirects``/``--tee``/``--local-ranks-filter`` rules. Every start of
the workers gets its own ``attempt_<k>`` directory, so no attempt's logs overwrite
another's (torchrun reuses ``attempt_<restarts>`` and loses the logs of resizes).

    <log_dir>/<run_id>_<node_id>/attempt_<k>/<local_rank>/{stdout,stderr}.log, error.json
"""

from __future__ import annotations

import contextlib
import os
import string
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, ClassVar

OUT, ERR = 1, 2
_console_lock = threading.Lock()


def _console(stream: int) -> BinaryIO:
    return (sys.stdout if stream == OUT else sys.stderr).buffer


@dataclass
class Pump:
    """Copies one worker stream line by line to the console (prefixed) and/or a file."""

    source: BinaryIO
    prefix: bytes
    stream: int
    console: bool
    file: BinaryIO | None
    filters: tuple[bytes, ...] = ()
    filtered: BinaryIO | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True, name="log-pump")
        self.thread.start()

    def _run(self) -> None:
        for line in iter(self.source.readline, b""):
            if self.file is not None:
                self.file.write(line)
                self.file.flush()
            if self.filtered is not None and any(f in line for f in self.filters):
                self.filtered.write(self.prefix + line)
                self.filtered.flush()
            if self.console:
                with _console_lock:
                    out = _console(self.stream)
                    out.write(
                        self.prefix + line if line.endswith(b"\n") else self.prefix + line + b"\n"
                    )
                    out.flush()
        self.source.close()


@dataclass
class WorkerStreams:
    """The Popen arguments for one worker's stdout/stderr, and how to finish them."""

    stdout: int | BinaryIO
    stderr: int | BinaryIO
    error_file: str
    files: list[BinaryIO] = field(default_factory=list)
    pumps: list[Pump] = field(default_factory=list)

    def attach(self, proc: subprocess.Popen, prefix: bytes, plan: dict[int, tuple]) -> None:
        for stream, pipe in ((OUT, proc.stdout), (ERR, proc.stderr)):
            if pipe is not None:
                console, file, filters, filtered = plan[stream]
                self.pumps.append(Pump(pipe, prefix, stream, console, file, filters, filtered))

    def close(self, timeout: float = 5.0) -> None:
        """Wait for the pumps to drain (the worker has exited), then close the files."""
        for p in self.pumps:
            p.thread.join(timeout)
        for f in self.files:
            with contextlib.suppress(OSError):
                f.close()


class LogRouter:
    """Decides, per worker and per stream, console/file/both, and owns the log directories."""

    PREFIX_ENV: ClassVar[str] = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"

    def __init__(
        self,
        log_dir: str | None,
        run_id: str,
        node_id: str,
        redirects: dict[int, int],
        tee: dict[int, int],
        local_ranks_filter: frozenset[int] | None,
        role: str = "default",
        stdout_filters: tuple[str, ...] = (),
        stderr_filters: tuple[str, ...] = (),
    ):
        base = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="torchelastic_"))
        self.run_dir = base / f"{run_id}_{node_id}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.redirects, self.tee, self.filter = redirects, tee, local_ranks_filter
        self.role = role
        self.filters = {
            OUT: tuple(f.encode() for f in stdout_filters),
            ERR: tuple(f.encode() for f in stderr_filters),
        }
        self.template = os.environ.get(self.PREFIX_ENV, "[rank${rank}]:")
        self.attempt_dir: Path | None = None

    def new_attempt(self) -> Path:
        """A fresh ``attempt_<k>`` directory; k counts every start of the workers."""
        k = 0
        while (self.run_dir / f"attempt_{k}").exists():
            k += 1
        self.attempt_dir = self.run_dir / f"attempt_{k}"
        self.attempt_dir.mkdir(parents=True)
        return self.attempt_dir

    def prefix(self, rank: int, local_rank: int) -> bytes:
        text = string.Template(self.template).safe_substitute(
            role_name=self.role, rank=rank, local_rank=local_rank
        )
        return (text + " ").encode() if text and not text.endswith(" ") else text.encode()

    def streams(self, local_rank: int) -> tuple[WorkerStreams, dict[int, tuple]]:
        """Popen targets for a worker and the pump plan for what goes through a pipe."""
        assert self.attempt_dir is not None, "new_attempt() first"
        d = self.attempt_dir / str(local_rank)
        d.mkdir()
        shown = self.filter is None or local_rank in self.filter
        ws = WorkerStreams(
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, error_file=str(d / "error.json")
        )
        plan: dict[int, tuple] = {}
        for stream, name in ((OUT, "stdout"), (ERR, "stderr")):
            to_file = bool(
                (self.redirects.get(local_rank, 0) | self.tee.get(local_rank, 0)) & stream
            )
            console = shown and (not to_file or bool(self.tee.get(local_rank, 0) & stream))
            filters = self.filters[stream]
            target: int | BinaryIO = subprocess.DEVNULL
            file = filtered = None
            if to_file:
                file = open(d / f"{name}.log", "wb")  # noqa: SIM115 - closed by WorkerStreams
                ws.files.append(file)
            if filters:
                filtered = open(self.attempt_dir / f"filtered_{name}.log", "ab")  # noqa: SIM115
                ws.files.append(filtered)
            if console or filters:
                target = subprocess.PIPE
            elif file is not None:
                target, file = file, None  # the worker writes its file directly
            plan[stream] = (console, file, filters, filtered)
            if stream == OUT:
                ws.stdout = target
            else:
                ws.stderr = target
        return ws, plan
