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
import socket
import threading


class ProbeListener:
    """Accepts and drops connections, as long as this process lives."""

    def __init__(self, host: str = "") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
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


def process_gone(addr: str, port: int, timeout: float = 0.5) -> bool:
    """True only when ``addr`` actively refused ``port``: nothing listens there now."""
    if not port:
        return False
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
