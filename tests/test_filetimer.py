"""torch's file-timer watchdog served by the agent: torch's real client, real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import wait_until
from torch.distributed.elastic.timer import FileTimerClient
from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest

from elastic.agent.filetimer import FileTimerServer


@pytest.fixture
def server(tmp_path: Path):
    s = FileTimerServer(str(tmp_path / "timer"))
    yield s
    s.close()
    assert not (tmp_path / "timer").exists()


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def arm(server: FileTimerServer, pid: int, scope: str, after: float) -> None:
    """What torch's client sends on acquire (after < 0: release), for another pid."""
    expires = time.time() + after if after >= 0 else -1
    FileTimerClient(server.path)._send_request(FileTimerRequest(pid, scope, expires, 9))


def test_an_expired_worker_is_killed_and_named(server: FileTimerServer) -> None:
    p = sleeper()
    try:
        server.workers = lambda: [p.pid]
        arm(server, p.pid, "step", 0.3)
        assert p.wait(10) == -9
        assert server.expired(p.pid) == "step"
    finally:
        p.kill()


def test_a_released_timer_kills_nobody(server: FileTimerServer) -> None:
    p = sleeper()
    try:
        server.workers = lambda: [p.pid]
        arm(server, p.pid, "step", 0.5)
        arm(server, p.pid, "step", -1)  # release: negative expiration
        time.sleep(1.0)
        assert p.poll() is None and server.expired(p.pid) is None
    finally:
        p.kill()
        p.wait()


def test_a_pid_that_is_not_a_worker_is_never_signalled(server: FileTimerServer) -> None:
    p = sleeper()
    try:
        server.workers = lambda: []
        arm(server, p.pid, "step", 0.1)
        wait_until(lambda: not server._timers, 5, "the request handled")
        assert p.poll() is None and server.expired(p.pid) is None
    finally:
        p.kill()
        p.wait()


def test_a_worker_arms_it_through_the_environment(server: FileTimerServer) -> None:
    """A real worker script using torch's API, as under torchrun."""
    script = (
        "import os, time\n"
        "from torch.distributed.elastic import timer\n"
        "timer.configure(timer.FileTimerClient(os.environ['TORCHELASTIC_TIMER_FILE']))\n"
        "with timer.expires(after=0.5, scope='slow'):\n"
        "    time.sleep(30)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "TORCHELASTIC_TIMER_FILE": server.path}
    )
    try:
        server.workers = lambda: [p.pid]
        assert p.wait(60) == -9
        assert server.expired(p.pid) == "slow"
    finally:
        p.kill()
