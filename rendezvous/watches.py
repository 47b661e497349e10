"""Every watch of one ``EtcdClient`` on one gRPC Watch stream, as etcd's Go client does.

A watch is one create request on the stream; etcd answers each with a "created" message
in the order they were sent (one stream's creates are served in turn) and sends a
watch's events only after its "created", so the answers are matched to the requests in
order and the events to their watch by id. One agent has one mirror and so one stream
either way; a process that simulates many nodes (the scale benchmark) holds one stream
and one reader thread instead of a stream and two threads per node. (gRPC's blocking
stream iterators wake ten times a second: at hundreds of nodes a process, that alone
was a core.)

python3-etcd3's callback watcher loses its callbacks when the stream breaks; here a
broken stream ends every subscription's iteration with the error, and each caller reads
again and watches on from where it was.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2
from etcd3.utils import prefix_range_end

from rendezvous.client import EtcdClient
from rendezvous.errors import EtcdUnavailableError, RendezvousError

log = logging.getLogger(__name__)
_DELETE = kv_pb2.Event.DELETE
_END = object()


@dataclass(frozen=True)
class Event:
    """One change from a watch: ``value`` is None for a delete."""

    key: str
    value: bytes | None
    create_revision: int
    mod_revision: int
    lease: int


class Compacted(RendezvousError):
    """The watch asked for history etcd has compacted away; read everything again."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"etcd history compacted up to revision {revision}")
        self.revision = revision


@dataclass(frozen=True)
class WatchSpec:
    """One watch: a key, or a prefix when ``prefix``; deletes only if ``no_put``."""

    key: str
    prefix: bool = False
    no_put: bool = False

    def request(self, start_revision: int) -> etcdrpc.WatchRequest:
        key = self.key.encode()
        create = etcdrpc.WatchCreateRequest(key=key, start_revision=start_revision)
        if self.prefix:
            create.range_end = prefix_range_end(key)
        if self.no_put:
            create.filters.append(etcdrpc.WatchCreateRequest.NOPUT)
        return etcdrpc.WatchRequest(create_request=create)


class Subscription:
    """Some watches on the shared stream, iterated as batches of events. Ends quietly
    on ``cancel``; raises when the stream breaks or etcd cancels one of its watches."""

    def __init__(self, hub: Watches) -> None:
        self._hub = hub
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.ids: list[int] = []
        self.cancelled = False  # by its owner: ends quietly
        self.dropped = False  # its watches are cancelled (or being cancelled) at etcd
        self.ended = False

    def put(self, events: list[Event]) -> None:
        self._queue.put(events)

    def end(self, error: Exception | None) -> None:
        if not self.ended:
            self.ended = True
            self._queue.put((_END, error))

    def cancel(self) -> None:
        self._hub.cancel(self)

    def __iter__(self) -> Iterator[list[Event]]:
        while True:
            item = self._queue.get()
            if isinstance(item, tuple) and item[0] is _END:
                if item[1] is not None and not self.cancelled:
                    raise item[1]
                return
            yield item


class Watches:
    """The shared Watch stream of one client, opened on first use and closed when the
    last subscription goes (no thread is left behind)."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._call: Any = None  # the gRPC stream, or None
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._creating: deque[Subscription] = deque()  # sent creates, oldest first
        self._by_id: dict[int, Subscription] = {}

    def watch(self, specs: list[WatchSpec], start_revision: int) -> Subscription:
        sub = Subscription(self)
        with self._lock:
            if self._call is None:
                self._open()
            for spec in specs:
                self._creating.append(sub)
                self._requests.put(spec.request(start_revision))
        return sub

    def cancel(self, sub: Subscription) -> None:
        with self._lock:
            sub.cancelled = True
            self._drop(sub)
        sub.end(None)

    def _drop(self, sub: Subscription) -> None:
        """Cancel ``sub``'s watches (under the lock); the stream closes with the last."""
        sub.dropped = True
        for watch_id in sub.ids:
            if self._by_id.pop(watch_id, None) is not None and self._call is not None:
                self._requests.put(_cancel_request(watch_id))
        if self._call is not None and not self._by_id and not self._creating:
            self._close()

    def _open(self) -> None:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        call = self._client.stream(
            "open a watch",
            lambda channel: etcdrpc.WatchStub(channel).Watch,
            iter(requests.get, None),
        )
        self._call, self._requests = call, requests
        threading.Thread(target=self._read, args=(call,), name="etcd-watch", daemon=True).start()

    def _close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        self._call = None

    def _read(self, call: Any) -> None:
        error: Exception = EtcdUnavailableError("watch stream ended")
        try:
            for resp in call:
                self._dispatch(call, resp)
        except grpc.RpcError as e:
            error = EtcdUnavailableError(f"etcd watch broke: {e.code().name}: {e.details()}")
        with self._lock:
            if self._call is not call:
                return  # closed on purpose: its subscriptions were cancelled
            subs = {*self._by_id.values(), *self._creating}
            self._by_id.clear()
            self._creating.clear()
            self._close()
        for sub in subs:
            sub.end(error)

    def _dispatch(self, call: Any, resp: Any) -> None:
        with self._lock:
            if self._call is not call:
                return
            if resp.created:
                sub = self._creating.popleft()
                if sub.dropped:
                    if not resp.canceled:
                        self._requests.put(_cancel_request(resp.watch_id))
                    return
                sub.ids.append(resp.watch_id)
                self._by_id[resp.watch_id] = sub
            sub_or_none = self._by_id.get(resp.watch_id)
            if sub_or_none is None:
                return  # a watch cancelled meanwhile
            sub = sub_or_none
            if resp.canceled or resp.compact_revision:
                self._drop(sub)  # the subscription ends: its other watches go too
        if resp.compact_revision:
            sub.end(Compacted(resp.compact_revision))
        elif resp.canceled:
            sub.end(EtcdUnavailableError(f"etcd cancelled the watch: {resp.cancel_reason}"))
        elif resp.events:
            sub.put(
                [
                    Event(
                        ev.kv.key.decode(),
                        None if ev.type == _DELETE else ev.kv.value,
                        ev.kv.create_revision,
                        ev.kv.mod_revision,
                        ev.kv.lease,
                    )
                    for ev in resp.events
                ]
            )


def _cancel_request(watch_id: int) -> etcdrpc.WatchRequest:
    return etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id))


def watch(client: EtcdClient, specs: list[WatchSpec], start_revision: int) -> Subscription:
    """Watch ``specs`` from ``start_revision`` on ``client``'s shared stream."""
    return client.shared(Watches).watch(specs, start_revision)
