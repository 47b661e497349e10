"""A liveness probe faster than a lease TTL, for the one case it can prove: a dead process.

Each participant listens on a TCP port of its own and advertises it in its node record.
When the others wait on a member that is not stopping its workers, they connect to it:
"connection refused" means no process holds that port any more (the agent crashed or was
killed on a host that is up), so its lease can be revoked at once instead of waiting for
the TTL. Anything else (accepted, timeout, unreachable: a frozen process, a dead host, a
partition) proves nothing, and the lease TTL decides as before.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from typing import TypeVar, cast

K = TypeVar("K")
BATCH = 256  # sockets open at once while probing


class ProbeListener:
    """Accepts and drops connections, as long as this process lives."""

    def __init__(self, host: str = "") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(4096)  # a round's worth of probes at once (capped by somaxconn)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, name="probe-listener", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def gone_among(targets: dict[K, tuple[str, int]], timeout: float = 0.5) -> list[K]:
    """The keys of ``targets`` (address, probe port) that actively refuse their port:
    nothing listens there now. All are probed at once (a leader probing a thousand
    members one by one would take seconds); accepted, timed out or unreachable proves
    nothing."""
    gone: list[K] = []
    items = [(k, a, p) for k, (a, p) in targets.items() if p]
    for start in range(0, len(items), BATCH):
        gone += _probe_batch(items[start : start + BATCH], timeout)
    return gone


def _probe_batch(items: list[tuple[K, str, int]], timeout: float) -> list[K]:
    gone: list[K] = []
    with selectors.DefaultSelector() as sel:
        try:
            for key, addr, port in items:
                try:
                    family, kind, proto, _, sockaddr = socket.getaddrinfo(
                        addr, port, type=socket.SOCK_STREAM
                    )[0]
                    sock = socket.socket(family, kind, proto)
                except OSError:
                    continue  # unresolvable: proves nothing
                sock.setblocking(False)
                err = sock.connect_ex(sockaddr)
                if err == errno.ECONNREFUSED:
                    gone.append(key)
                    sock.close()
                elif err in (0, errno.EINPROGRESS):
                    sel.register(sock, selectors.EVENT_WRITE, key)
                else:
                    sock.close()
            deadline = time.monotonic() + timeout
            while sel.get_map() and (left := deadline - time.monotonic()) > 0:
                for sk, _ in sel.select(left):
                    sock = cast(socket.socket, sk.fileobj)
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED:
                        gone.append(sk.data)
                    sel.unregister(sock)
                    sock.close()
        finally:
            for sk in list(sel.get_map().values()):
                sel.unregister(sk.fileobj)
                cast(socket.socket, sk.fileobj).close()
    return gone
