"""etcd fixtures beyond the embedded one: slow logins, TLS-only members and three-member
clusters."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import tempfile
import urllib.request
from dataclasses import dataclass, field

from elastic.agent.etcd_server import EtcdServer


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS-only etcd: its CA, its server pair, and a client pair."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str | None = None
    client_key: str | None = None


@dataclass
class SlowLoginEtcdServer(EtcdServer):
    """A member that hashes passwords at bcrypt cost ``cost``: each login (etcd's
    Authenticate) then takes it about a second per 2**14 rounds, as a loaded etcd may."""

    cost: int = field(default=14, kw_only=True)

    def command(self) -> list[str]:
        return [*super().command(), "--bcrypt-cost", str(self.cost)]


@dataclass
class TlsEtcdServer(EtcdServer):
    """A member that serves clients over TLS only and demands client certificates."""

    tls: TlsFiles | None = field(default=None, kw_only=True)

    @property
    def scheme(self) -> str:
        return "https"

    def command(self) -> list[str]:
        assert self.tls is not None
        return [
            *super().command(),
            "--cert-file", self.tls.server_cert,
            "--key-file", self.tls.server_key,
            "--trusted-ca-file", self.tls.ca,
            "--client-cert-auth",
        ]  # fmt: skip

    def healthy(self) -> bool:
        assert self.tls is not None
        ctx = ssl.create_default_context(cafile=self.tls.ca)
        if self.tls.client_cert:
            ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1, context=ctx) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False


@dataclass
class ClusterMember(EtcdServer):
    """A member of a multi-member cluster: it must be told the whole cluster."""

    initial_cluster: str = field(default="", kw_only=True)
    cluster_token: str = field(default="elastic-run", kw_only=True)

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--initial-cluster") + 1] = self.initial_cluster
        return [*cmd, "--initial-cluster-token", self.cluster_token]


class EtcdCluster:
    """Several members on loopback forming one cluster."""

    def __init__(self, size: int = 3) -> None:
        self._dir = tempfile.mkdtemp(prefix="elastic-run-etcd-cluster-")
        self.members = [
            ClusterMember(name=f"m{i}", data_dir=os.path.join(self._dir, f"m{i}", "data"))
            for i in range(size)
        ]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster
            m.cluster_token = os.path.basename(self._dir)

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
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
