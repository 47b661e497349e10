"""Shared by the benchmarks: "nodes" as process trees on this machine, and step logs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil


class Node:
    """One launcher process (agent) and everything it starts, in a session of its own."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """A node dies: the agent and its workers, all at once."""
        for p in self.tree():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)

    def term(self) -> None:
        """The node leaves: SIGTERM to its agent, which drains its workers."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def interrupt(self) -> None:
        """Ctrl-C in the node's terminal: SIGINT to its whole process group (the agent
        and its workers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)

    def freeze(self) -> None:
        """The node hangs: SIGSTOP to the agent and its workers."""
        for p in self.tree():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGSTOP)

    def stop(self) -> None:
        for p in self.tree():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log.close()


def steps(result_dir: Path) -> list[dict]:
    out = []
    for f in result_dir.glob("w*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return sorted(out, key=lambda s: s["t"])


def first_step(
    result_dir: Path, world: int, after: float, timeout: float, ranks: int | None = None
) -> float | None:
    """Wall time of the first step at ``world`` after ``after`` (None: not within timeout)."""
    need = world if ranks is None else ranks
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = [s for s in steps(result_dir) if s["world"] == world and s["t"] > after]
        if len({s["rank"] for s in at}) >= need:
            return at[0]["t"]
        time.sleep(0.05)
    return None
