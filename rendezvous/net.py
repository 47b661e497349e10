"""Small network helpers: free ports and the address other nodes reach this one at."""

from __future__ import annotations

import enum
import random
import socket
from pathlib import Path


def ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def server_port(host: str = "127.0.0.1", avoid: set[int] | None = None) -> int:
    """A free port below the kernel's range for outgoing connections, for a server that
    may be restarted on it (an etcd): a port from that range can be taken meanwhile by
    any outgoing connection on the machine, a client of that very server included."""
    floor = ephemeral_floor()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(64):
        port = random.randrange(max(1024, floor - 12000), floor)
        if avoid and port in avoid:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return free_port(host, avoid)


def free_port(host: str = "127.0.0.1", avoid: set[int] | None = None) -> int:
    """A port the kernel says is free on ``host`` now (bind to 0, read it back, release)."""
    for _ in range(64):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if not avoid or port not in avoid:
            return port
    raise OSError(f"no free port found on {host}")


def default_local_addr() -> str:
    """torchrun's default for --local-addr: this host's fully qualified domain name."""
    return socket.getfqdn()


def resolve(host: str) -> str:
    """The first address ``host`` resolves to (as a client would use), or ``host``."""
    try:
        return str(socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return host


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine: its address can be bound here."""
    addr = resolve(host)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether anything accepts a TCP connection at host:port now."""
    return reach(host, port, timeout) is Reach.ANSWERS


class Reach(enum.Enum):
    """What a TCP connection to an address meets: each points at another cause."""

    ANSWERS = "accepts connections"
    REFUSED = "refuses connections"  # the host is up, nothing listens on the port
    NO_ROUTE = "is unreachable from this host (no route)"  # a link down, a partition
    SILENT = "does not answer at all"  # packets dropped: a partition, a firewall, a frozen host
    UNKNOWN_HOST = "does not resolve"


def reach(host: str, port: int, timeout: float = 1.0) -> Reach:
    """What a TCP connection to host:port meets now (``Reach``)."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout):
            return Reach.ANSWERS
    except socket.gaierror:
        return Reach.UNKNOWN_HOST
    except TimeoutError:
        return Reach.SILENT
    except (ConnectionRefusedError, ConnectionResetError):
        return Reach.REFUSED
    except OSError:  # unreachable, or a route that rejects (blackhole, prohibit)
        return Reach.NO_ROUTE


def unreached(reaches: dict[str, Reach], answered_before: bool) -> str:
    """What a user can check when no endpoint (``reaches``: what a connection to each
    met) accepts a connection: a server that is not running is told apart from a network
    between here and there that carries nothing."""
    met = set(reaches.values())
    if met == {Reach.REFUSED}:
        return "nothing accepts connections there: is etcd running, and is the port right?"
    said = "; ".join(f"{e} {r.value}" for e, r in reaches.items())
    if met & {Reach.NO_ROUTE, Reach.SILENT}:
        why = "this host may be cut off from it (a link down, a partition, a firewall)"
        return f"{said}: {why}" + (", as etcd answered there before" if answered_before else "")
    if met == {Reach.UNKNOWN_HOST}:
        return f"{said}: is the host name right?"
    return f"{said}: is etcd running, and are the host names and ports right?"
