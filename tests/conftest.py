"""Fixtures: real etcd servers on free loopback ports, and processes that never leak."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import code_tools
import psutil
import pytest
from harness import TAG_VAR, Proc, tagged_processes

from elastic.agent.etcd_server import EtcdServer
from rendezvous.client import EtcdClient
from rendezvous.config import build_options

REQUIRE_ALL = os.environ.get("ELASTIC_RUN_REQUIRE_ALL") == "1"
PARALLEL = "PYTEST_XDIST_WORKER" in os.environ  # one of several pytest-xdist workers


def pytest_collection_finish(session: pytest.Session) -> None:
    if PARALLEL:  # every worker collects every test: the one that runs them starts the tools
        return
    items = session.items
    code_tools.start(
        [i.callspec.id for i in items if getattr(i, "originalname", "") == "test_tool_is_clean"]
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    code_tools.stop()
    if not hasattr(session.config, "workerinput"):  # the last one out: no worker runs now
        from elastic.agent import nodedir

        nodedir.remove_stale(grace=0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report ends with what each of its processes said (most tests wait
    on an event, and the event that did not come is explained in an agent's log)."""
    report = yield
    if report.failed and call.when == "call":
        for p in item.stash.get(STARTED, []):
            report.sections.append((f"{p.name} (pid {p.pid})", p.transcript()))
    return report


def need(condition: bool, why: str) -> None:
    """Skip when a tool or privilege is missing here; in CI (ELASTIC_RUN_REQUIRE_ALL=1) fail."""
    if not condition:
        if REQUIRE_ALL:
            pytest.fail(f"required for CI: {why}")
        pytest.skip(why)


def need_binary(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, f"{name} is not installed")
    return path  # type: ignore[return-value]


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    """One etcd for the session; tests keep apart by run id."""
    with EtcdServer(name="session") as server:
        yield server


@pytest.fixture
def fresh_etcd() -> Iterator[EtcdServer]:
    """An etcd of this test's own, for tests that stop, freeze or restart it."""
    server = EtcdServer(name="fresh")
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def client(etcd: EtcdServer, run_id: str) -> Iterator[EtcdClient]:
    """A connection to the session's etcd."""
    e, _ = build_options(etcd.endpoint, run_id, 1, 1)
    c = EtcdClient(e)
    yield c
    c.close()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:40].strip("-")
    return f"{name}-{uuid.uuid4().hex[:6]}"


STARTED = pytest.StashKey[list[Proc]]()


@pytest.fixture
def procs(request: pytest.FixtureRequest) -> Iterator[list[Proc]]:
    """Processes a test starts; all killed (with descendants) at the end."""
    started: list[Proc] = []
    request.node.stash[STARTED] = started
    yield started
    for p in started:
        p.kill_tree()


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every process a test starts carries a tag; none may outlive the test. Namespaces and
    mounts are this worker's own (by name, under its base temp) when workers run side by side."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    old = os.environ.get(TAG_VAR)
    os.environ[TAG_VAR] = tag
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(TAG_VAR, None)
        else:
            os.environ[TAG_VAR] = old
        deadline = time.monotonic() + 5
        left = tagged_processes(tag)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = tagged_processes(tag)
        names = []
        for p in left:
            with contextlib.suppress(psutil.Error):
                names.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
                p.kill()
        if left:
            pytest.fail("processes left behind:\n" + "\n".join(names), pytrace=False)
        from faults import leftover_namespaces, sh

        spaces = leftover_namespaces()
        for ns in spaces:
            sh("ip", "netns", "del", ns, check=False)
        base = str(tmp_path_factory.getbasetemp())
        mounts = [
            line.split()[1]
            for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(base)
        ]
        for m in mounts:
            sh("umount", "-l", m, check=False)
        if spaces or mounts:
            pytest.fail(f"left behind: namespaces {spaces}, mounts {mounts}", pytrace=False)
        # Node directories of agents a test SIGKILLed are otherwise only swept by a later
        # launch, minutes later; sweep them here so /dev/shm holds nothing after the suite.
        # Side by side, another worker's test may be about to restart a node that inherits
        # its dead folder: then only the session's end sweeps (pytest_sessionfinish).
        if not PARALLEL:
            from elastic.agent import nodedir

            nodedir.remove_stale(grace=0)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo group of one rank in this process (torch is imported where it is asked for)."""
    import torch.distributed as dist

    from rendezvous.net import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()
