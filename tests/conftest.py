"""Fixtures: real etcd servers on free loopback ports, and processes that never leak."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import code_tools
import psutil
import pytest
from harness import TAG_VAR, Proc, tagged_processes

from elastic.agent.etcd_server import EtcdServer
from rendezvous.client import EtcdClient
from rendezvous.config import build_options

REQUIRE_ALL = os.environ.get("ELASTIC_RUN_REQUIRE_ALL") == "1"


def pytest_collection_finish(session: pytest.Session) -> None:
    items = session.items
    code_tools.start(
        [i.callspec.id for i in items if getattr(i, "originalname", "") == "test_tool_is_clean"]
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    code_tools.stop()


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


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts; all killed (with descendants) at the end."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill_tree()


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every process a test starts carries a tag; none may outlive the test."""
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
        mounts = [
            line.split()[1]
            for line in Path("/proc/mounts").read_text().splitlines()
            if "/pytest-of-" in line.split()[1]
        ]
        for m in mounts:
            sh("umount", "-l", m, check=False)
        if spaces or mounts:
            pytest.fail(f"left behind: namespaces {spaces}, mounts {mounts}", pytrace=False)
        # Node directories of agents a test SIGKILLed are otherwise only swept by a later
        # launch, minutes later; sweep them here so /dev/shm holds nothing after the suite.
        from elastic.agent import nodedir

        nodedir.remove_stale(grace=0)
