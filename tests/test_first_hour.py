"""What a new user meets first: Ctrl-C, waiting, connecting, ids, the last lines of a job."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness import ROOT, port_pair, wait_until

from elastic.agent.etcd_server import EtcdServer

pytestmark = pytest.mark.slow
TRAIN = str(ROOT / "examples" / "train_ddp.py")


def agent(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """An agent in a session of its own, as a shell starts a foreground job."""
    return subprocess.Popen(
        [sys.executable, "-m", "elastic", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def leftovers(tmp: Path, pid: int) -> list[str]:
    """What agent ``pid``, given TMPDIR ``tmp``, left: its embedded etcd's data, its node
    folder (named after its pid) in shared memory or under TMPDIR. Nothing else: other
    agents on this machine may be running."""
    node_dirs = (f"/dev/shm/elastic-run-{os.getuid()}", f"{tmp}/elastic-run-{os.getuid()}")
    return glob.glob(f"{tmp}/elastic-run-etcd-*") + [
        d for base in node_dirs for d in glob.glob(f"{base}/*.{pid}")
    ]


@pytest.mark.parametrize(("start_method", "presses"), [("spawn", 1), ("forkserver", 2)])
def test_ctrl_c_exits_promptly_with_nothing_left(
    start_method: str, presses: int, tmp_path: Path
) -> None:
    """The terminal's SIGINT reaches the whole foreground process group: the agent must
    still leave through its embedded etcd and stop every helper, within a bound. Twice
    in a row (``timeout -s INT`` sends it so; an impatient user too) once hung the agent
    for good: a lock in the signal handler (``elastic/agent/signals.py``)."""
    p = agent("--start-method", start_method, "--nproc-per-node", "2", TRAIN, "--epochs", "100",
              "--step-time", "0.02", env={"TMPDIR": str(tmp_path)})  # fmt: skip
    try:
        assert p.stdout is not None
        wait_until(lambda: "epoch" in p.stdout.readline(), 90, "training")
        family = [p.pid, *(c.pid for c in psutil.Process(p.pid).children(recursive=True))]
        assert len(family) >= 4  # workers, the embedded etcd, the store helper (, zygote)
        assert leftovers(tmp_path, p.pid)  # the check can see them
        sent = time.monotonic()
        for _ in range(presses):
            os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGINT
    assert took < 5, f"Ctrl-C took {took:.1f}s"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert " W " not in err.split("received SIGINT")[-1], err  # no warnings on the way out
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in family), 5, "no orphans")
    assert not leftovers(tmp_path, p.pid)


def test_a_sigterm_while_etcd_is_away_ends_the_agent_at_once(run_id: str) -> None:
    """Kubernetes' SIGTERM (to the agent alone) during an etcd outage: the agent leaves
    without waiting on etcd (the others see its lease expire), exits 143 as for any
    SIGTERM, and says why; it took 25 s and exited 1 with an etcd error."""
    with EtcdServer() as etcd:
        p = agent("--nnodes", "1:2", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
                  TRAIN, "--epochs", "100", "--step-time", "0.02")  # fmt: skip
        try:
            assert p.stdout is not None
            wait_until(lambda: "epoch" in p.stdout.readline(), 90, "training")
            etcd.stop(signal.SIGKILL)
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "leaves without telling" in err and "error:" not in err, err


def test_waiting_for_nodes_says_so(etcd: EtcdServer, run_id: str) -> None:
    p = agent("--nnodes", "2", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, TRAIN)
    try:
        assert p.stderr is not None
        line = wait_until(
            lambda: (lambda s: s if "still waiting" in s else None)(p.stderr.readline()),
            30,
            "a waiting message",
        )
        assert "1 of at least 2 nodes present" in str(line) and "join_timeout in" in str(line)
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)


def test_a_shared_etcd_needs_a_job_id(etcd: EtcdServer) -> None:
    p = agent("--rdzv-endpoint", etcd.endpoint, TRAIN)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "--rdzv-id is needed with a shared etcd" in err


def test_a_port_that_is_not_etcd_is_named_as_such() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = agent("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x",
                  "--rdzv-conf", "connect_timeout=2", TRAIN)  # fmt: skip
        _, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "connecting to the etcd at http://127.0.0.1" in err and "giving up after 2s" in err
    assert "is this etcd's client port" in err


def test_standalone_says_it_overrides_nnodes_and_the_job_ends_with_a_summary(
    tmp_path: Path,
) -> None:
    p = agent("--standalone", "--nnodes", "2", "--checkpoint-dir", str(tmp_path), TRAIN,
              "--epochs", "1")  # fmt: skip
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "--standalone runs one node: ignoring --nnodes 2" in err
    summary = [line for line in err.splitlines() if "summary:" in line]
    assert len(summary) == 1 and "0 restart(s)" in summary[0], err
    assert f"checkpoints in {tmp_path}" in summary[0] and "step " in summary[0]
    assert "worker logs in" not in err  # nothing was written to log files: nothing to point at


def test_a_second_node_without_its_node_rank_is_told_to_give_one() -> None:
    """``elastic-run --nnodes 2 ...`` in a second terminal: the first waits as node rank
    0; the second is node rank 0 too. It is told to take --node-rank 1 first."""
    flags = ("--nnodes", "2", "--master-port", str(port_pair()))
    first = agent(*flags, TRAIN)
    said: list[str] = []

    def registered() -> bool:
        assert first.stderr is not None
        said.append(first.stderr.readline())
        assert said[-1] or first.poll() is None, "".join(said)  # it ended: why
        return "registered as" in said[-1]

    try:
        wait_until(registered, 60, "node 0 registers")
        second = agent(*flags, TRAIN)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 1
        [line] = [x for x in err.splitlines() if "error:" in x]
        assert "node rank 0 of job 'none' already runs" in line
        assert "start this node with --node-rank 1 to join it" in line
        assert line.index("--node-rank 1") < line.index("--master-port")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)


def test_a_free_port_of_this_host_is_served_with_a_warning_that_says_how_to_choose() -> None:
    """A mistyped port of a local etcd looks like torchrun's c10d form (the agent on that
    host serves it): the job runs, and the log says so as a warning with the way out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    echo = str(ROOT / "tests" / "scripts" / "echo.py")
    p = agent("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "typo", echo)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    [line] = [x for x in err.splitlines() if "serving the job's etcd" in x]
    assert " W " in line and f"127.0.0.1:{port} myself: nothing answered there" in line
    assert "is_host=false waits for one instead" in line


def test_both_nodes_end_a_job_in_the_same_words() -> None:
    """Whichever node closes the job, each says the same last two lines; a default run
    does not name the default job id, and counts say '1 worker'."""
    echo = str(ROOT / "tests" / "scripts" / "echo.py")
    flags = ("--nnodes", "2", "--master-port", str(port_pair()))
    node0 = agent(*flags, "--node-rank", "0", echo)
    node1 = agent(*flags, "--node-rank", "1", echo)
    ends = []
    for p in (node0, node1):
        _, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        lines = [x.split(": ", 1)[1] for x in err.splitlines() if " I elastic-run" in x]
        ends.append(lines[-2:])
        assert "job none" not in err and "1 workers" not in err
        assert "joining (2 node(s), 1 worker per node)" in err
    assert ends[0][0] == ends[1][0] == "job finished: all workers succeeded"
    assert all(e[1].startswith("summary: ") for e in ends)
