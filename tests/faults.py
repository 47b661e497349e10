"""A "node" in a network namespace of its own, joined to this one by a veth pair whose link
can be cut and restored, and small tmpfs mounts: faults made for real, always undone."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import need

PREFIX = "elrtest"


def sh(*cmd: str, check: bool = True) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class NetNode:
    ns: str
    host_if: str  # the veth end in this namespace
    node_if: str  # the veth end in the node's namespace
    host_ip: str
    node_ip: str

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the node's namespace (same pid: ip execs it)."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def agent(self, inside: bool, env: dict[str, str]) -> dict[str, Any]:
        """``start_agent``'s placement of an agent inside the node's namespace or on this
        side of the link: its address, its workers' gloo interface, how it is run."""
        return {
            "env": {**env, "GLOO_SOCKET_IFNAME": self.node_if if inside else self.host_if},
            "local_addr": self.node_ip if inside else self.host_ip,
            "prefix": tuple(self.command([])) if inside else (),
        }

    def cut(self) -> None:
        """The cable is pulled: nothing in or out, and no resets either. Only the node's
        end goes down: this end loses its carrier but keeps its route, so what it sends
        is dropped unanswered (then "no route to host", once ARP gives up), as on a real
        cable. Down here too, the route would go and the node's address would be sent
        off the machine by the default route, where something answered with resets: a
        partition that looked like a dead agent."""
        sh("ip", "-n", self.ns, "link", "set", self.node_if, "down")

    def restore(self) -> None:
        sh("ip", "-n", self.ns, "link", "set", self.node_if, "up")

    def throttle(self, rate: str) -> None:
        """What this side sends the node goes at ``rate`` (tc's token bucket on this end;
        gone with the link): a large transfer to the node stays in flight for a while."""
        sh("tc", "qdisc", "add", "dev", self.host_if, "root", "tbf", "rate", rate,
           "burst", "64kb", "latency", "1s")  # fmt: skip


def can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@contextlib.contextmanager
def isolated_node() -> Iterator[NetNode]:
    need(can_make_namespaces(), "network namespaces need root and iproute2")
    tag = f"{_mine()}{random.randrange(100):02d}"
    lane, lanes = _lane()
    # pytest-xdist workers never share a subnet, nor take one still on a link (a killed
    # run's leftover there would take the node's traffic, silently)
    taken = set(re.findall(r"inet 10\.231\.(\d+)\.", sh("ip", "-o", "-4", "addr", "show")))
    subnet = random.choice([s for s in range(1 + lane, 250, lanes) if str(s) not in taken])
    node = NetNode(
        ns=f"{PREFIX}{tag}",
        host_if=f"elh{tag}",
        node_if=f"eln{tag}",
        host_ip=f"10.231.{subnet}.1",
        node_ip=f"10.231.{subnet}.2",
    )
    try:
        sh("ip", "netns", "add", node.ns)
        sh("ip", "link", "add", node.host_if, "type", "veth", "peer", "name", node.node_if)
        sh("ip", "link", "set", node.node_if, "netns", node.ns)
        sh("ip", "addr", "add", f"{node.host_ip}/24", "dev", node.host_if)
        sh("ip", "link", "set", node.host_if, "up")
        sh("ip", "-n", node.ns, "addr", "add", f"{node.node_ip}/24", "dev", node.node_if)
        sh("ip", "-n", node.ns, "link", "set", node.node_if, "up")
        sh("ip", "-n", node.ns, "link", "set", "lo", "up")
        yield node
    finally:
        for pid in sh("ip", "netns", "pids", node.ns, check=False).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGCONT)
                os.kill(int(pid), signal.SIGKILL)
        sh("ip", "netns", "del", node.ns, check=False)
        sh("ip", "link", "del", node.host_if, check=False)


def _mine() -> str:
    """This test process's part of a namespace's name: a parallel worker sweeps only its own."""
    return f"{os.getpid() % 10000:04d}"


def _lane() -> tuple[int, int]:
    """This pytest-xdist worker's index and the number of workers ((0, 1) without xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return int(worker or 0), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def leftover_namespaces() -> list[str]:
    if not can_make_namespaces():
        return []
    return [
        line.split()[0]
        for line in sh("ip", "netns", "list", check=False).splitlines()
        if line.startswith(f"{PREFIX}{_mine()}")
    ]


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` (a disk that fills up), unmounted at the end."""
    need(os.geteuid() == 0, "mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        sh("umount", "-l", str(path), check=False)


def mounted(path: Path) -> bool:
    return any(
        line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines()
    )
