"""etcd v3 access for the rendezvous: python3-etcd3 plus retries, failover and clear errors.

python3-etcd3 fails a request at the first error and leaves retrying to the caller;
here every call is retried across the configured endpoints until a deadline, an expired
auth token (etcd forgets simple tokens when it restarts) is renewed, and what finally
reaches the caller names the endpoints and the last error.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import etcd3
import etcd3.exceptions
import grpc
from etcd3 import etcdrpc
from etcd3.client import EtcdTokenCallCredentials, KVMetadata
from etcd3.etcdrpc import kv_pb2
from etcd3.utils import prefix_range_end

from rendezvous import tlsprobe
from rendezvous.config import EtcdOptions
from rendezvous.errors import EtcdUnavailableError, LeaseNotFoundError, RendezvousError
from rendezvous.net import Reach, reach, unreached
from rendezvous.view import KV

log = logging.getLogger(__name__)
T = TypeVar("T")
_DELETE = kv_pb2.Event.DELETE

# Reconnect fast after an etcd restart (gRPC's default backoff grows to two minutes), notice
# a dead connection within seconds, and never route loopback etcd through an HTTP proxy.
GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.enable_http_proxy", 0),
]

_RETRYABLE = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.NoServerAvailableError,
    etcd3.exceptions.InternalServerError,
)
_RETRYABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}
# said as python-etcd3 says them, not in gRPC's own words ("failed to connect to all
# addresses; last error: ..."): the hint that follows says what to check
_SAID = {
    grpc.StatusCode.UNAVAILABLE: "etcd connection failed",
    grpc.StatusCode.DEADLINE_EXCEEDED: "etcd connection timeout",
}


def _kv(kv: Any) -> KV:
    return KV(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


class _Etcd3Client(etcd3.MultiEndpointEtcd3Client):
    """python3-etcd3's client, with the deadline of each request (its ``timeout``, which
    its every call reads) the calling thread's: ``EtcdClient.call`` bounds each request
    by the time its caller has left, so a frozen etcd holds no caller past its timeout
    (each request waited the whole ``request_timeout`` before)."""

    _limit = threading.local()
    _default: float | None = None

    @property
    def timeout(self) -> float | None:
        limit: float | None = getattr(self._limit, "value", None)
        return limit if limit is not None else self._default

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._default = value


class EtcdClient:
    """A connection to one etcd cluster, shared by everything in one process."""

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._client: etcd3.MultiEndpointEtcd3Client | None = None
        self._token: str | None = None  # from the last login, until etcd refuses it
        self._logging_in: concurrent.futures.Future[str] | None = None
        self._closed = False
        self._shared: dict[object, Any] = {}
        self.answered = False  # some call was answered: the endpoint is etcd

    def shared(self, kind: Callable[[EtcdClient], T]) -> T:
        """The one ``kind(self)`` of this client: its shared watch and keep-alive streams
        (made on first use; ``kind``'s constructor must not touch the network)."""
        with self._lock:
            obj = self._shared.get(kind)
            if obj is None:
                obj = self._shared[kind] = kind(self)
            return cast(T, obj)

    # -- connection ---------------------------------------------------------------------
    def _make(self, token: str | None) -> etcd3.MultiEndpointEtcd3Client:
        """A client on fresh channels (no request yet), sending ``token`` if given."""
        o = self.options
        creds = None
        if o.secure:
            creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(o.ca_cert, o.key, o.cert)
        endpoints = []
        for ep in o.endpoints:
            host, _, port = ep.rpartition(":")
            endpoints.append(
                etcd3.Endpoint(
                    host, int(port), secure=o.secure, creds=creds, time_retry=1.0, opts=GRPC_OPTIONS
                )
            )
        client = _Etcd3Client(endpoints=endpoints, timeout=o.request_timeout, failover=True)
        if token is not None:
            client.metadata = (("token", token),)
            # gRPC refuses call credentials on a plaintext channel; the token still travels
            # as request metadata, which python3-etcd3 sends alongside
            client.call_credentials = (
                grpc.metadata_call_credentials(EtcdTokenCallCredentials(token))
                if o.secure
                else None
            )
        return client

    def raw(self) -> etcd3.MultiEndpointEtcd3Client:
        token = self._login() if self.options.user is not None else None
        with self._lock:
            if self._client is None:  # a token etcd refused went with the client (_reset)
                self._client = self._make(token)
            return self._client

    def _login(self) -> str:
        """This client's auth token: etcd's Authenticate (a bcrypt check and a raft write,
        slow on a loaded etcd) runs once for every caller, in a thread of its own bounded
        by ``connect_timeout``; each caller waits for it only as long as its own deadline.
        (Each retry used to log in anew within its caller's deadline, on new channels: an
        etcd slower than that deadline never finished one, and after its restart the
        nodes' leases lapsed unrenewed.)"""
        with self._lock:
            if self._token is not None:
                return self._token
            login = self._logging_in
            if login is None:
                login = self._logging_in = concurrent.futures.Future()
                threading.Thread(
                    target=self._log_in, args=(login,), name="etcd-login", daemon=True
                ).start()
        wait = getattr(_Etcd3Client._limit, "value", None) or self.options.request_timeout
        try:
            return login.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            raise etcd3.exceptions.ConnectionTimeoutError(
                f"logging in as {self.options.user!r} takes etcd longer than {wait:.2g}s"
            ) from None

    def _log_in(self, login: concurrent.futures.Future[str]) -> None:
        o = self.options
        try:
            client = self._make(None)
            try:
                request = etcdrpc.AuthenticateRequest(name=o.user, password=o.password)
                token = str(client.authstub.Authenticate(request, o.connect_timeout).token)
            finally:
                _close(client)
        except BaseException as e:
            with self._lock:
                self._logging_in = None
            login.set_exception(e)
            return
        with self._lock:
            self._logging_in = None
            self._token = None if self._closed else token
        login.set_result(token)

    def _reset(self, token_expired: bool = False) -> None:
        """New channels at the next request; the token goes only when etcd refused it (a
        new channel to the same etcd takes it: no new login for a slow answer)."""
        with self._lock:
            stale, self._client = self._client, None
            if token_expired:
                self._token = None
        _close(stale)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._reset(token_expired=True)

    def stream(self, what: str, method: Callable[[Any], Any], requests: Iterator[Any]) -> Any:
        """A streaming call, ``method(channel)``, fed by ``requests``, on the current
        channel and with the auth token python3-etcd3 sends with its own calls."""
        # the channel, too, is taken in the retrying call: with every endpoint marked
        # failed (etcd away), python3-etcd3 raises for it until the client is made anew
        raw, channel = self.call(what, lambda c: (c, c.channel), timeout=2.0)
        return method(channel)(requests, credentials=raw.call_credentials, metadata=raw.metadata)

    def _hint(self) -> str:
        """What the user can check, from what answers at the endpoints at the TCP level."""
        reaches = {e: reach(*_split(e), timeout=0.5) for e in self.options.endpoints}
        live = [e for e, r in reaches.items() if r is Reach.ANSWERS]
        if not live:
            return f"; {unreached(reaches, self.answered)}"
        if self.answered:
            return (
                f"; {', '.join(live)} accepts connections, and etcd answered there before: "
                "it may be frozen, overloaded or without quorum"
            )
        o = self.options
        if o.secure:
            why = tlsprobe.diagnose(*_split(live[0]), o.ca_cert, o.cert, o.key)
            if why:
                return f"; {why}"
        return (
            f"; {', '.join(live)} accepts connections but does not answer as etcd: is this "
            f"etcd's client port (2379 by default)?"
            + (" Does it need https (cacert=)?" if not self.options.secure else "")
        )

    def call(
        self,
        what: str,
        fn: Callable[[etcd3.MultiEndpointEtcd3Client], T],
        timeout: float | None = None,
    ) -> T:
        """Run ``fn(client)``, retrying across endpoints until ``timeout`` (connect_timeout)."""
        deadline = time.monotonic() + (self.options.connect_timeout if timeout is None else timeout)
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            _Etcd3Client._limit.value = max(min(self.options.request_timeout, left), 0.05)
            try:
                result = fn(self.raw())
                self.answered = True
                return result
            except _RETRYABLE as e:
                last = str(e) or type(e).__name__
                if isinstance(e, etcd3.exceptions.NoServerAvailableError):
                    # python3-etcd3's "No endpoint available and not failed": every endpoint
                    # was marked failed. Said as etcd's own unavailable; fresh channels next
                    last = _SAID[grpc.StatusCode.UNAVAILABLE]
                    self._reset()
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                if code == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in details:
                    last = f"auth token expired ({details})"
                    self._reset(token_expired=True)
                elif code in _RETRYABLE_CODES:
                    last = _SAID.get(code) or details or code.name
                    self._reset()
                elif code == grpc.StatusCode.CANCELLED:
                    last = details or code.name  # another thread replaced the channel
                elif code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
                    raise LeaseNotFoundError(
                        f"etcd at {self.options.describe()} refused {what}: {details}"
                    ) from None
                elif "authentication failed" in details:
                    raise EtcdUnavailableError(
                        f"etcd at {self.options.describe()} rejected user "
                        f"{self.options.user!r}: {details}"
                    ) from None
                else:
                    raise RendezvousError(
                        f"etcd at {self.options.describe()} refused {what}: {code.name}: {details}"
                    ) from None
            except ValueError as e:  # python3-etcd3 raises this for unusable TLS settings
                raise RendezvousError(f"etcd client setup failed: {e}") from None
            finally:
                _Etcd3Client._limit.value = None
            if time.monotonic() + delay > deadline:
                raise EtcdUnavailableError(
                    f"etcd unreachable at {self.options.describe()} ({what}): {last}{self._hint()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    # -- key-value ------------------------------------------------------------------------
    def get_prefix(self, prefix: str, timeout: float | None = None) -> tuple[int, list[KV]]:
        """All keys under ``prefix`` and the revision they were read at."""

        def run(c: etcd3.MultiEndpointEtcd3Client) -> tuple[int, list[KV]]:
            resp = c.get_prefix_response(prefix)
            return resp.header.revision, [_kv(kv) for kv in resp.kvs]

        return self.call(f"read {prefix}", run, timeout)

    def count(self, prefix: str, timeout: float | None = None) -> int:
        """How many keys are under ``prefix`` (etcd counts; no values travel)."""

        def run(c: etcd3.MultiEndpointEtcd3Client) -> int:
            return int(c.get_prefix_response(prefix, count_only=True).count)

        return int(self.call(f"count {prefix}", run, timeout))

    def get(self, key: str, timeout: float | None = None, revision: int = 0) -> KV | None:
        """``key`` now, or as of ``revision``."""

        def run(c: etcd3.MultiEndpointEtcd3Client) -> KV | None:
            resp = c.get_response(key, revision=revision or None)
            return _kv(resp.kvs[0]) if resp.kvs else None

        return self.call(f"read {key}", run, timeout)

    def read(
        self, keys: list[str], prefixes: list[str], timeout: float | None = None
    ) -> tuple[int, list[KV]]:
        """``keys`` and everything under ``prefixes``, at one revision (one transaction)."""

        def run(c: etcd3.MultiEndpointEtcd3Client) -> tuple[int, list[KV]]:
            _, resp, revision = _txn(c, [], _gets(c.transactions, keys, prefixes), [])
            return revision, _found(resp)

        return self.call(f"read {len(keys) + len(prefixes)} keys", run, timeout)

    def put(self, key: str, value: bytes, lease: int = 0, timeout: float | None = None) -> int:
        """Write ``key``; returns the revision of the write. ``timeout`` bounds each request
        too (not only the retries), so a frozen etcd holds the caller no longer."""
        limit = self.options.request_timeout
        limit = limit if timeout is None else min(limit, timeout)

        def run(c: etcd3.MultiEndpointEtcd3Client) -> int:
            request = c._build_put_request(key, value, lease=lease)
            response = c.kvstub.Put(
                request, limit, credentials=c.call_credentials, metadata=c.metadata
            )
            return int(response.header.revision)

        return int(self.call(f"write {key}", run, timeout))

    def txn(
        self,
        compare: list[Any],
        success: list[Any],
        failure: list[Any] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """An etcd transaction; True when every comparison held and ``success`` ran."""
        return bool(
            self.call(
                "transaction", lambda c: c.transaction(compare, success, failure or [])[0], timeout
            )
        )

    def put_if(
        self,
        key: str,
        value: bytes,
        mod_revision: int,
        lease: int = 0,
        timeout: float | None = None,
    ) -> int:
        """Write ``key`` only if it was last written at ``mod_revision``: the revision of
        the write, or 0."""

        def run(c: etcd3.MultiEndpointEtcd3Client) -> int:
            t = c.transactions
            put = t.put(key, value, lease=lease)
            ok, _, revision = _txn(c, [t.mod(key) == mod_revision], [put], [])
            return revision if ok else 0

        return int(self.call(f"write {key}", run, timeout))

    def delete_if(self, key: str, mod_revision: int, timeout: float | None = None) -> bool:
        """Delete ``key`` only if it was last written at ``mod_revision``."""
        ops = self.ops
        return self.txn([ops.mod(key) == mod_revision], [ops.delete(key)], timeout=timeout)

    def create_and_read(
        self,
        key: str,
        value: bytes,
        lease: int,
        reads: tuple[list[str], list[str]],
        unless: str,
        claim: tuple[str, bytes] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, list[KV], bool]:
        """In one transaction: unless ``key`` or ``unless`` exists, write ``key`` and, if
        absent, ``claim`` (a key and value, on the same lease); either way read ``reads``
        (keys, prefixes), which sees those writes. Returns (revision of the write or 0,
        what was read, whether the claim was written)."""

        def run(c: etcd3.MultiEndpointEtcd3Client) -> tuple[int, list[KV], bool]:
            t = c.transactions
            gets = _gets(t, *reads)
            nested = []
            if claim is not None:
                ck, cv = claim
                nested = [etcd3.transactions.Txn([t.create(ck) == 0], [t.put(ck, cv, lease)], [])]
            ok, resp, revision = _txn(
                c,
                [t.create(key) == 0, t.create(unless) == 0],
                [t.put(key, value, lease=lease), *nested, *gets],
                gets,
            )
            if not ok:
                return 0, _found(resp), False
            claimed = bool(nested) and resp[1].response_txn.succeeded
            return revision, _found(resp[1 + len(nested) :]), claimed

        return self.call(f"join as {key}", run, timeout)

    def create(
        self,
        key: str,
        value: bytes,
        lease: int = 0,
        timeout: float | None = None,
        unchanged: tuple[str, int] | None = None,
    ) -> tuple[int, KV | None]:
        """Write ``key`` only if absent (and ``unchanged``'s key last written at its
        revision), in one round trip: (revision, None) when written, (0, the existing KV
        or None) when not."""

        def run(c: etcd3.MultiEndpointEtcd3Client) -> tuple[int, KV | None]:
            t = c.transactions
            guard = [t.mod(unchanged[0]) == unchanged[1]] if unchanged else []
            ok, resp = c.transaction(
                [t.create(key) == 0, *guard], [t.put(key, value, lease=lease)], [t.get(key)]
            )
            if ok:
                return resp[0].response_put.header.revision, None
            found = resp[0] if resp and resp[0] else []
            if not found:
                return 0, None
            raw, meta = found[0]
            return 0, KV(key, raw, meta.create_revision, meta.mod_revision, meta.lease_id)

        return self.call(f"create {key}", run, timeout)

    @property
    def ops(self) -> etcd3.Transactions:
        """Builders for ``txn``: ``ops.mod(key) == rev``, ``ops.put(key, value)``..."""
        return etcd3.Transactions()

    # -- leases ---------------------------------------------------------------------------
    def grant(self, ttl: int, timeout: float | None = None) -> int:
        return int(self.call("grant lease", lambda c: c.lease(ttl).id, timeout))

    def refresh(self, lease_id: int, timeout: float | None = None) -> int:
        """Keep the lease alive once, on a stream of its own, retried (and broken channels
        replaced) as every call here: its remaining TTL (<= 0: it is gone)."""

        def run(c: etcd3.MultiEndpointEtcd3Client) -> int:
            for resp in c.refresh_lease(lease_id):
                return int(resp.TTL)
            return 0

        return int(self.call("keep lease alive", run, timeout))

    def keep_alive(self, inbox: queue.Queue) -> KeepAliveStream:
        """A stream to keep leases alive on (see ``KeepAliveStream``)."""
        return KeepAliveStream(self, inbox)

    def revoke(self, lease_id: int, timeout: float | None = None) -> None:
        def run(c: etcd3.MultiEndpointEtcd3Client) -> None:
            try:
                c.revoke_lease(lease_id)
            except grpc.RpcError as e:
                if "lease not found" not in (e.details() or ""):
                    raise

        self.call("revoke lease", run, timeout)


class KeepAliveStream:
    """One LeaseKeepAlive stream, kept open: each keep-alive is one message on it, and
    each answer names its lease. (A new stream for each, as python3-etcd3's
    ``refresh_lease`` opens, costs etcd about 0.6 ms of CPU and the client a thread.)
    What the stream brings, answers and finally the error or ``None`` that ends it, goes
    to ``inbox`` as ``(stream, item)``."""

    def __init__(self, client: EtcdClient, inbox: queue.Queue) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._inbox = inbox
        self._call = client.stream(
            "open a keep-alive stream",
            lambda channel: etcdrpc.LeaseStub(channel).LeaseKeepAlive,
            iter(self._requests.get, None),
        )
        self._closed = False
        threading.Thread(target=self._read, name="etcd-keepalive", daemon=True).start()

    def _read(self) -> None:
        try:
            for resp in self._call:
                self._inbox.put((self, resp))
        except grpc.RpcError as e:
            self._inbox.put((self, e))
        finally:
            self._inbox.put((self, None))

    def send(self, lease_id: int) -> None:
        """Ask etcd to keep ``lease_id`` alive; its answer comes to the inbox."""
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._requests.put(None)
            self._call.cancel()


def _gets(t: etcd3.Transactions, keys: list[str], prefixes: list[str]) -> list[Any]:
    ranges = [t.get(p, prefix_range_end(p.encode())) for p in prefixes]
    return [t.get(k) for k in keys] + ranges


def _found(resp: list[Any]) -> list[KV]:
    """The key-values of a transaction's get responses."""
    return [
        KV(m.key.decode(), raw, m.create_revision, m.mod_revision, m.lease_id)
        for found in resp
        for raw, m in found
    ]


def _txn(
    c: etcd3.MultiEndpointEtcd3Client, compare: list[Any], success: list[Any], failure: list[Any]
) -> tuple[bool, list[Any], int]:
    """``c.transaction`` that also says the revision the transaction ran at."""
    request = etcdrpc.TxnRequest(
        compare=[x.build_message() for x in compare],
        success=c._ops_to_requests(success),
        failure=c._ops_to_requests(failure),
    )
    response = c.kvstub.Txn(request, c.timeout, credentials=c.call_credentials, metadata=c.metadata)
    out: list[Any] = []
    for r in response.responses:
        kind = r.WhichOneof("response")
        if kind == "response_range":
            out.append([(kv.value, KVMetadata(kv, response.header)) for kv in r.response_range.kvs])
        else:
            out.append(r)
    return response.succeeded, out, response.header.revision


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _close(client: etcd3.MultiEndpointEtcd3Client | None) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:
            log.debug("closing old etcd client failed", exc_info=True)
