"""Where worker output goes: the console as it is, files, or both, as torchrun does it.

Console output is the workers' own, unprefixed, unless ``--tee`` copies a stream to a
file as well: then its console lines carry torchrun's prefix (``[default0]:``, or
``$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``). ``--redirects`` sends streams to files only;
``--local-ranks-filter`` keeps other ranks off the console. Every start of the workers
gets its own ``attempt_<k>`` directory, so no attempt's logs overwrite another's (torchrun
reuses ``attempt_<restarts>`` and loses the logs of resizes)::

    <log_dir>/<run_id>_<node_id>/attempt_<k>/<local_rank>/{stdout,stderr}.log, error.json

Two things differ on purpose. A traceback a worker prints as it dies is held back for a
moment, so that when it only says that a peer vanished (the peer's node was lost), the
agent can print one line instead, naming the loss as the cause, and keep the traceback in
the worker's ``stderr.log``. Any other traceback is printed as it came. And a C++ stack
that torch's own warning about a vanished peer carries (``[W ... TCPStore.cpp] recvValue
failed ...: Connection reset by peer``, then 20-odd ``frame #N`` lines, as a store host
dies while a worker re-forms, which the agent handles) goes to ``stderr.log``; the
console keeps the warning and one line saying where its stack is. So does the stack of
any message of torch's distributed layer (``[c10d]``: the store's and the group's network
errors, which the agent judges from the workers' state, not from their stacks).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import string
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO

from elastic.agent.failures import last_line
from elastic.agent.procs import Process
from elastic.contract import peer_gone

OUT, ERR = 1, 2
PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
DEFAULT_PREFIX = "[${role_name}${local_rank}]:"
QUIET = 2.0  # seconds without output that end a traceback the worker survived
_TRACEBACK = b"Traceback (most recent call last):"
_CPP_STACK = re.compile(rb"^Exception raised from .* \(most recent call first\):\s*$")
_CPP_FRAME = re.compile(rb"^(?:frame #\d+: |<omitting python frames>|\s*$)")
_console_lock = threading.Lock()


def _console(stream: int) -> BinaryIO:
    return (sys.stdout if stream == OUT else sys.stderr).buffer


def to_console(stream: int, data: bytes) -> None:
    if not data:
        return
    with _console_lock:
        out = _console(stream)
        out.write(data)
        out.flush()


def _starts_traceback(line: bytes) -> bool:
    # torch prefixes an uncaught exception's lines with "[rankN]: " once a process group
    # exists (its excepthook); look past that
    return line.lstrip().startswith(_TRACEBACK) or (b"]: " + _TRACEBACK) in line


@dataclass
class StreamPlan:
    """Where one worker stream goes."""

    console: bool  # shown on the agent's console
    prefix: bytes  # before each console line (only when tee'd, as torchrun)
    file: BinaryIO | None  # its log file, written by the pump
    filters: tuple[bytes, ...] = ()  # lines containing any of these ...
    filtered: BinaryIO | None = None  # ... are copied here too
    filtered_prefix: bytes = b""  # with the rank prefix, as torchrun's filtered files
    kept: Path | None = None  # where what the console leaves out is (its file, if any)


class Pump:
    """Copies one worker stream to the console and/or files, line by line, in a thread.

    On stderr it also remembers the last traceback (``tail``), and a traceback that ends
    the stream and only says that a peer vanished is held (``held``) for the agent."""

    def __init__(self, source: IO[bytes], stream: int, plan: StreamPlan) -> None:
        self.source = source
        self.stream = stream
        self.plan = plan
        self.tail = ""
        self.held = b""
        self._block: list[bytes] = []
        self._frames: list[bytes] | None = None  # a C++ stack left off the console
        self._last = b""  # the last line shown
        self.thread = threading.Thread(target=self._run, daemon=True, name="log-pump")
        self.thread.start()

    def _run(self) -> None:
        fd = self.source.fileno()
        pending = b""
        try:
            while True:
                waiting = self._block or self._frames is not None
                if waiting and not select.select([fd], [], [], QUIET)[0]:
                    self._end_frames()
                    self._end_block(dying=False)  # it printed a traceback and lived on
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    self._line(line + b"\n")
            if pending:
                self._line(pending + b"\n")
            self._end_frames()
            self._end_block(dying=True)
        finally:
            self.source.close()

    def _line(self, line: bytes) -> None:
        plan = self.plan
        if plan.file is not None:
            plan.file.write(line)
            plan.file.flush()
        if plan.filtered is not None and any(f in line for f in plan.filters):
            plan.filtered.write(plan.filtered_prefix + line)
            plan.filtered.flush()
        if not plan.console:
            return
        if self.stream == ERR and self._frames is not None:
            if _CPP_FRAME.match(line):
                self._frames.append(line)
                if not line.strip():  # c10 ends its stack with an empty line
                    self._end_frames()
                return
            self._end_frames()
        if self.stream == ERR and (self._block or _starts_traceback(line)):
            self._block.append(line)
            return
        if (
            self.stream == ERR
            and _CPP_STACK.match(line)
            and (b"[c10d]" in self._last or peer_gone(self._last.decode(errors="replace")))
        ):
            self._frames = [line]
            return
        self._last = line
        to_console(self.stream, plan.prefix + line)

    def _end_frames(self) -> None:
        """A C++ stack of a c10d message, or of one about a vanished peer, is complete: into
        the worker's stderr file (where it is already if stderr is tee'd), one line on the
        console."""
        frames, self._frames = self._frames, None
        if not frames:
            return
        kept = self.plan.kept
        if kept is not None and self.plan.file is None:
            try:
                with open(kept, "ab") as f:
                    f.write(b"".join(frames))
            except OSError:
                kept = None
        count = sum(1 for line in frames if line.startswith(b"frame #"))
        where = f": in {kept}" if kept is not None else ""
        note = f"(its C++ stack, {count} frames, left off the console{where})\n"
        to_console(self.stream, self.plan.prefix + note.encode())

    def _end_block(self, dying: bool) -> None:
        """A traceback is complete: print it, or (a peer-gone one as the stream ends) hold
        it for the agent's verdict."""
        if not self._block:
            return
        text = b"".join(self.plan.prefix + line for line in self._block)
        self.tail = b"".join(self._block).decode(errors="replace")
        self._block = []
        if dying and peer_gone(last_line(self.tail)):
            self.held = text
        else:
            to_console(self.stream, text)


@dataclass
class WorkerStreams:
    """The Popen arguments for one worker's stdin/stdout/stderr, and how to finish them."""

    stdout: int | BinaryIO | None
    stderr: int | BinaryIO | None
    error_file: str
    log_dir: Path
    plans: dict[int, StreamPlan] = field(default_factory=dict)
    files: list[BinaryIO] = field(default_factory=list)
    pumps: list[Pump] = field(default_factory=list)

    def attach(self, proc: Process) -> None:
        for stream, pipe in ((OUT, proc.stdout), (ERR, proc.stderr)):
            if pipe is not None:
                self.pumps.append(Pump(pipe, stream, self.plans[stream]))

    def settle(self, timeout: float = 1.0) -> None:
        """Wait for the pumps to reach the end of what the (exited) worker wrote."""
        for p in self.pumps:
            p.thread.join(timeout)

    @property
    def tail(self) -> str:
        """The last traceback the worker printed on stderr, if any."""
        pumped = next((p.tail for p in self.pumps if p.stream == ERR), None)
        if pumped is not None:
            return pumped
        try:  # stderr went straight to its file
            with open(self.log_dir / "stderr.log", "rb") as f:
                f.seek(max(f.seek(0, os.SEEK_END) - 8192, 0))
                data = f.read()
        except OSError:
            return ""
        start = data.rfind(_TRACEBACK)
        return data[start:].decode(errors="replace") if start >= 0 else ""

    def release(self, show: bool) -> Path | None:
        """What to do with a held traceback: print it (``show``), or keep it only in the
        worker's ``stderr.log`` (returned)."""
        path = None
        for p in self.pumps:
            held, p.held = p.held, b""
            if not held:
                continue
            if show:
                to_console(p.stream, held)
                continue
            path = self.log_dir / "stderr.log"
            if p.plan.file is None:  # the file has all of stderr otherwise
                with open(path, "ab") as f:
                    f.write(held)
        return path

    def close(self, timeout: float = 5.0) -> None:
        """Drain the pumps (the worker has exited), show anything still held, close files."""
        self.settle(timeout)
        self.release(show=True)
        for f in self.files:
            with contextlib.suppress(OSError):
                f.close()


class LogRouter:
    """Decides, per worker and per stream, console/file/both, and owns the log directories."""

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
        self._base = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="torchelastic_"))
        self._own_base = not log_dir
        self.run_dir = self._base / f"{run_id}_{node_id}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.redirects, self.tee, self.filter = redirects, tee, local_ranks_filter
        self.role = role
        self.filters = {
            OUT: tuple(f.encode() for f in stdout_filters),
            ERR: tuple(f.encode() for f in stderr_filters),
        }
        self.template = os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX
        self.attempt_dir: Path | None = None

    @property
    def writes_files(self) -> bool:
        """Some worker stream goes to a file."""
        modes = [*self.redirects.values(), *self.tee.values()]
        return any(modes) or any(self.filters.values())

    def new_attempt(self) -> Path:
        """A fresh ``attempt_<k>`` directory; k counts every start of the workers."""
        k = 0
        while (self.run_dir / f"attempt_{k}").exists():
            k += 1
        self.attempt_dir = self.run_dir / f"attempt_{k}"
        self.attempt_dir.mkdir(parents=True)
        return self.attempt_dir

    def prefix(self, rank: int, local_rank: int) -> bytes:
        return (
            string.Template(self.template)
            .safe_substitute(role_name=self.role, rank=rank, local_rank=local_rank)
            .encode()
        )

    def streams(self, rank: int, local_rank: int) -> WorkerStreams:
        """Popen targets for a worker, and the plan for what goes through a pipe."""
        assert self.attempt_dir is not None, "new_attempt() first"
        d = self.attempt_dir / str(local_rank)
        d.mkdir()
        shown = self.filter is None or local_rank in self.filter
        ws = WorkerStreams(None, None, error_file=str(d / "error.json"), log_dir=d)
        for stream, name in ((OUT, "stdout"), (ERR, "stderr")):
            tee = bool(self.tee.get(local_rank, 0) & stream)
            to_file = tee or bool(self.redirects.get(local_rank, 0) & stream)
            console = shown and (tee or not to_file)
            filters = self.filters[stream]
            file = filtered = None
            if to_file:
                file = open(d / f"{name}.log", "wb")  # noqa: SIM115 - closed by WorkerStreams
                ws.files.append(file)
            if filters:
                filtered = open(self.attempt_dir / f"filtered_{name}.log", "ab")  # noqa: SIM115
                ws.files.append(filtered)
            target: int | BinaryIO | None
            if console and stream == OUT and not tee and not filters:
                target = None  # straight to the agent's stdout, as torchrun does
            elif console or filters:
                target = subprocess.PIPE
            elif file is not None:
                target, file = file, None  # the worker writes its file directly
            else:
                target = subprocess.DEVNULL
            prefix = self.prefix(rank, local_rank)
            ws.plans[stream] = StreamPlan(
                console, prefix if tee else b"", file, filters, filtered, prefix, d / f"{name}.log"
            )
            if stream == OUT:
                ws.stdout = target
            else:
                ws.stderr = target
        return ws

    def close(self, say: Callable[[str], None]) -> None:
        """Remove the directories nothing was written to; say where the logs are if any."""
        for d in sorted(self.run_dir.rglob("*"), reverse=True):
            if d.is_dir():
                with contextlib.suppress(OSError):
                    d.rmdir()  # only if empty
        with contextlib.suppress(OSError):
            self.run_dir.rmdir()
        if self._own_base:
            with contextlib.suppress(OSError):
                self._base.rmdir()
        if self.run_dir.exists():
            say(f"worker logs in {self.run_dir}")
        elif self._own_base:
            shutil.rmtree(self._base, ignore_errors=True)
