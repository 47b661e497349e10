"""A newcomer's word that it is on its way, before it registers.

A newcomer whose workers start ahead registers only once they are ready (the others
train on meanwhile: ``elastic.agent.lobby``), seconds later. A node told to leave that
alone holds the job's newest state hands it over to a newcomer first
(``elastic.agent.handover``), and must see one in those seconds too. So the newcomer
puts ``arriving/<id>`` on a lease of its own while its workers start, and withdraws it
once registered (its record says the rest). Nothing else reads it: rounds are planned
from registered nodes only, and its value is never decoded.
"""

from __future__ import annotations

from rendezvous import records
from rendezvous.client import EtcdClient
from rendezvous.config import RendezvousOptions
from rendezvous.errors import RendezvousError
from rendezvous.lease import LeaseKeeper


class Arrival:
    """This node's ``arriving/`` key and the lease it is on, kept alive until withdrawn."""

    def __init__(self, client: EtcdClient, options: RendezvousOptions, node_id: str) -> None:
        self._client = client
        self.key = options.job_prefix + records.ARRIVING + node_id
        self._lease = LeaseKeeper(client, options.lease_ttl, options.keep_alive_interval)

    def announce(self, timeout: float) -> None:
        """Put the key (again, on a fresh lease). Raises RendezvousError."""
        self.withdraw()
        lease_id = self._lease.grant(timeout=timeout)
        try:
            self._client.put(self.key, b"", lease=lease_id, timeout=timeout)
        except RendezvousError:
            self.withdraw()
            raise

    def withdraw(self) -> None:
        """Drop the key with its lease (it expires within a TTL where etcd is away)."""
        if self._lease.lease_id:
            self._lease.stop()
            self._lease.revoke(timeout=1.0)


def others(client: EtcdClient, prefix: str, me: str, timeout: float) -> int:
    """The nodes other than ``me`` registered in the job or on their way to it, read in
    one transaction (only the keys count, those on a lease: every agent holds its keys
    on one, and a value on none, which no agent wrote, would never go). Raises
    RendezvousError."""
    _, kvs = client.read([], [prefix + records.NODES, prefix + records.ARRIVING], timeout=timeout)
    ids = {kv.key[len(prefix) :].partition("/")[2] for kv in kvs if kv.lease}
    return len(ids - {me})
