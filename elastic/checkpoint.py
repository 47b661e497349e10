"""Durable checkpoints: snapshot bytes written to files in the background.

Each file is written as ``.tmp``, fsynced, its sha256 stamped in its header, and renamed
into place, so a reader sees a complete file or none. The newest ``keep`` files stay.
Loading verifies the checksum; a corrupt or truncated file is skipped, with a warning,
for the previous good one. A full disk or a read-only directory costs one failed
checkpoint (logged and counted), never the previous checkpoint or the training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic import snapshot

log = logging.getLogger("elastic.checkpoint")

_NAME = re.compile(r"^step-(\d{12})\.elr$")
ENV = "ELASTIC_RUN_CHECKPOINT_DIR"


def path_for(directory: Path, step: int) -> Path:
    return directory / f"step-{step:012d}.elr"


@dataclass
class WriteResult:
    step: int
    ok: bool
    seconds: float
    nbytes: int
    error: str = ""


class CheckpointDir:
    """The checkpoint files of one job in one directory."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least one checkpoint must be kept")
        self.dir = Path(directory)
        self.keep = keep

    def steps(self) -> list[int]:
        """Steps with a checkpoint file here, newest first (not yet verified)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        found = [int(m.group(1)) for n in names if (m := _NAME.match(n))]
        return sorted(found, reverse=True)

    def newest_valid(self, below: int | None = None) -> tuple[int, bytes] | None:
        """(step, bytes) of the newest intact checkpoint (optionally below a step)."""
        for step in self.steps():
            if below is not None and step >= below:
                continue
            path = path_for(self.dir, step)
            try:
                data = path.read_bytes()
                snapshot.parse(data, verify=True)
            except (OSError, snapshot.SnapshotError) as e:
                log.warning("skipping checkpoint %s: %s", path, e)
                continue
            return step, data
        return None

    def write(self, step: int, data: memoryview) -> WriteResult:
        """Write ``data`` (snapshot bytes, digest not yet stamped) as the step's file."""
        started = time.monotonic()
        final = path_for(self.dir, step)
        tmp = final.with_name(final.name + ".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            digest = snapshot.digest(data)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                header = bytearray(snapshot.HEADER_SIZE)
                header[:] = data[: snapshot.HEADER_SIZE]
                magic, meta_len, data_len, _ = snapshot.HEADER.unpack_from(header, 0)
                snapshot.HEADER.pack_into(header, 0, magic, meta_len, data_len, digest)
                _write_all(fd, header)
                _write_all(fd, data[snapshot.HEADER_SIZE :])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return WriteResult(
                step, False, time.monotonic() - started, 0, f"{type(e).__name__}: {e}"
            )
        self.prune()
        return WriteResult(step, True, time.monotonic() - started, len(data))

    def prune(self) -> None:
        for step in self.steps()[self.keep :]:
            with contextlib.suppress(OSError):
                path_for(self.dir, step).unlink()


def _write_all(fd: int, data: memoryview | bytearray) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view[: 1 << 26])
        view = view[n:]


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class BackgroundWriter:
    """Writes one checkpoint at a time in a thread; a request while busy is skipped."""

    def __init__(self, target: CheckpointDir, done: Callable[[WriteResult], None]) -> None:
        self.target = target
        self._done = done
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, data: memoryview, release: Callable[[], None]) -> bool:
        """Write in the background; ``release`` runs once ``data`` is no longer read."""
        if self.busy:
            return False

        def run() -> None:
            try:
                result = self.target.write(step, data)
            finally:
                release()
            self._done(result)

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
