"""A node's etcd lease, kept alive in the background.

The lease is the node's liveness: its record is attached to it, so a node that crashes,
freezes or is cut off vanishes from etcd within the TTL, and one that leaves revokes
it and vanishes at once. The keeper distinguishes "etcd is unreachable" (keep going:
the lease may well be alive, and etcd extends every lease when it comes back) from
"etcd says the lease is gone" (the others have moved on: fence).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rendezvous.client import EtcdClient, KeepAliveStream
from rendezvous.errors import EtcdUnavailableError, RendezvousError

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self,
        client: EtcdClient,
        ttl: int,
        interval: float,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self.ttl = ttl
        self._interval = interval
        self._on_change = on_change
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease_id = 0
        self.lost = False
        self.last_ok = 0.0
        self._stream: KeepAliveStream | None = None

    def grant(self, timeout: float | None = None) -> int:
        self.lease_id = self._client.grant(self.ttl, timeout)
        self.lost = False
        self.last_ok = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="etcd-lease", daemon=True)
            self._thread.start()
        return self.lease_id

    @property
    def reachable(self) -> bool:
        """False once no keep-alive has succeeded for a whole TTL."""
        return time.monotonic() - self.last_ok < self.ttl

    def _run(self) -> None:
        while not self._stopped.is_set():
            lease_id = self.lease_id
            if lease_id and not self.lost:
                was_reachable = self.reachable
                try:
                    ttl = self._refresh(lease_id)
                except EtcdUnavailableError as e:
                    if was_reachable and not self.reachable:
                        log.warning(
                            "etcd unreachable for %ss; workers keep running: %s", self.ttl, e
                        )
                        self._on_change()
                except RendezvousError as e:
                    log.warning("lease keep-alive failed: %s", e)
                else:
                    if lease_id != self.lease_id:
                        continue
                    if ttl <= 0:
                        self.lost = True
                        log.warning("etcd says this node's lease %x is gone", lease_id)
                    else:
                        self.last_ok = time.monotonic()
                        if not was_reachable:
                            log.info("etcd reachable again; lease %x still alive", lease_id)
                    if self.lost or not was_reachable:
                        self._on_change()
            self._stopped.wait(self._interval if self.reachable else min(self._interval, 0.5))

    def _refresh(self, lease_id: int) -> int:
        if self._stream is None:
            # the first keep-alive after a break goes the retrying way, which replaces a
            # broken channel (etcd restarted); then on a stream again
            ttl = self._client.refresh(lease_id, timeout=self._interval)
            self._stream = self._client.keep_alive()
            return ttl
        try:
            return self._stream.refresh(lease_id, timeout=self._interval)
        except EtcdUnavailableError:
            self._stream = None  # closed: the next keep-alive opens another
            raise

    def revoke(self) -> None:
        """Drop the lease now: the node's record disappears for everyone at once."""
        lease_id, self.lease_id = self.lease_id, 0
        if lease_id:
            try:
                self._client.revoke(lease_id, timeout=2.0)
            except RendezvousError as e:
                log.warning(
                    "could not revoke lease %x (it expires in %ss): %s", lease_id, self.ttl, e
                )

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._stream is not None:
            self._stream.close()
