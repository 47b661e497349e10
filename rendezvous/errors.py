"""Rendezvous errors. Messages are complete sentences for the user; no torch import here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rendezvous.records import ClosedRecord


class RendezvousError(Exception):
    """Base of everything the rendezvous raises on purpose."""


class EtcdUnavailableError(RendezvousError):
    """etcd could not be reached (or refused us) within the configured time."""


class RendezvousClosedError(RendezvousError):
    """The job is over; ``record`` says how and why."""

    def __init__(self, message: str, record: ClosedRecord) -> None:
        super().__init__(message)
        self.record = record


class RendezvousTimeoutError(RendezvousError):
    """Not enough nodes arrived within join_timeout."""


class MalformedRecordError(RendezvousError):
    """A value under the job's prefix is not what elastic-run wrote; names the key."""


class LeaseLostError(RendezvousError):
    """etcd says this node's lease is gone: the others have already moved on without it."""


class LeaseNotFoundError(RendezvousError):
    """etcd refused a write on a lease it no longer has: the lease expired before the
    write came (etcd was away for longer than its TTL), or was revoked."""


class RendezvousCancelled(RendezvousError):
    """The caller asked the wait to end (the agent got a signal)."""
