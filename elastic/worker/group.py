"""The process group of a live worker: one owner that forms it, aborts it, leaves it and
forms the next one, in the same process, when the job's membership changes.

As torchft's ``ProcessGroup`` (``configure``/``abort``) is one object its manager
reconfigures, ``Group`` is the one object that ``State.run`` reconfigures. The agent asks
through the control block (``pause``: stop at the next step; ``abandon``: the round is
broken, leave now) and then publishes the next placement; the steps of a re-formation
are ``leave`` (abort, destroy, forget the control group), ``wait_placement``, ``form``
(the torchrun variables into ``os.environ``, then ``init_process_group`` over the round's
store as ``roundstore`` connects it, so that an abandon ends the forming too) and the
caller's resync; ``reform`` runs them, again while the group breaks under it. When to
re-form is the agent's decision, never the worker's.

Aborting is a list of policies per backend (as NVIDIA Resiliency Extension composes its
``Abort`` classes). A collective blocked on a frozen peer never returns by itself, and
gloo's ``abort()`` does not wake it (torch 2.13, measured). Shutting down the reading
side of the group's TCP connections does, at once: gloo reads the end of the stream and
fails every operation pending on the connection (not the writing side too: gloo's
asynchronous writes ignore EPIPE and leave the operation queued, so an operation posted
just then would wait for its timeout; measured as a hang in about 1 of 10 abandons).
NCCL has its own abort (``_abort_process_group``), and its store connection is cut the
same way. Only the group's connections are cut: those that appeared while it formed (the
script's own first group is seen forming through ``watch_first_group``; unseen, every
connection of the process), narrowed once the ranks said theirs in the group's store to
those a peer holds the other end of (``ends``): a connection another thread of the
script opened meanwhile, or one a script made before an unseen first group, is spared.

gloo never fails a send whose bytes it could not all write at once (the socket was full,
or the peer's end was closed: EPIPE) when the connection then breaks: the send stays
queued, and the rank waits for it until the group's timeout (30 minutes by default), cut
or not. So each rank keeps its end of the group's connections open (a duplicate) for
``KEEP`` seconds after it cut them, or until its next placement, when every rank of the
old group has let go of it: a rank that left first does not reset a connection under a
peer's small send while the peer's own abandon, which comes with the same change, is on
its way (a rank of the leak test hung in about 1 abandon in 60 on a busy host). A peer
that nobody abandons (its node leaves: a drain waits for a step) is woken by the close
that follows (chaos seed 127: without the bound, it waited out --shutdown-timeout). A
large send to a peer that died under it stays stuck all the same: the watcher says so
after the cut (``stuck``), and the agent replaces the node's workers at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

from elastic.contract import (
    COMING,
    CONTROL_ENV,
    LIVE,
    LOBBY_ENV,
    RESTART_MODE_ENV,
    STUCK,
    UNPLACED,
    ControlBlock,
    Phase,
    RestartMode,
    peer_gone,
    read_placement,
)
from elastic.worker import comm, ends, placed, progress, stuck

log = logging.getLogger("elastic.live")

POLL = 0.005  # seconds between looks at the control block while waiting or watching
LOOK = 0.1  # seconds between looks at the main thread after a cut (``stuck``)
KEEP = 2.0  # seconds a rank keeps its end of the group's connections open after the cut
SETTLE = 60.0  # seconds a rank waits for its peers to say their ends (``ends``)
# gloo's wait for a peer's connection while a group forms (it waits about five times
# this): every peer wrote its address by then, so one that does not connect is dead or
# frozen, and no abort wakes the wait (it takes no socket, and the round's store waits
# are ours: roundstore). The group then gets the script's own timeout.
CONNECT_TIMEOUT = datetime.timedelta(seconds=1)


class Reformation(BaseException):
    """Leaves the training function for a re-formation (``State.commit`` raises it when
    the ranks agree to pause). A BaseException, so a script's ``except Exception`` does
    not swallow it; ``State.run`` catches it."""


Conn = ends.Conn  # (fd, local address, remote address)


class Placement(NamedTuple):
    """A round the agent placed this worker in."""

    generation: int
    env: dict[str, str]  # the torchrun variables
    asked: tuple[int, int]  # the (abandon, pause) asks it answers


def _connections() -> set[Conn]:
    """This process's connected TCP sockets, in any state but listening (one the peer
    already closed, CLOSE_WAIT, must still be shut on our side to wake a reader blocked on
    it), read from its own descriptors. Not from the machine's ``/proc/net/tcp`` (as
    psutil does): with thousands of connections lingering on a busy host (TIME_WAIT) one
    reading takes a share of a second, and this runs three times a re-formation."""
    out: set[Conn] = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
        except OSError:
            continue  # closed meanwhile
        fd = int(name)
        if _option(fd, socket.SO_TYPE) != socket.SOCK_STREAM or _option(fd, socket.SO_ACCEPTCONN):
            continue
        local, peer = _address(_libc.getsockname, fd), _address(_libc.getpeername, fd)
        if local is not None and peer is not None:  # TCP, and connected
            out.add((fd, local, peer))
    return out


# The socket calls on bare descriptors: a Python socket made over one would set it
# non-blocking where the script set a default timeout (socket.setdefaulttimeout).
_libc = ctypes.CDLL(None, use_errno=True)


def _option(fd: int, name: int) -> int | None:
    value, size = ctypes.c_int(), ctypes.c_uint32(ctypes.sizeof(ctypes.c_int))
    if _libc.getsockopt(fd, socket.SOL_SOCKET, name, ctypes.byref(value), ctypes.byref(size)):
        return None
    return value.value


def _address(call: Any, fd: int) -> tuple[str, int] | None:
    """(host, port) of an IPv4 or IPv6 socket's end (``getsockname``/``getpeername``)."""
    raw = ctypes.create_string_buffer(128)
    size = ctypes.c_uint32(len(raw))
    if call(fd, raw, ctypes.byref(size)):
        return None
    family, port = struct.unpack_from("=H", raw, 0)[0], struct.unpack_from("!H", raw, 2)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(family, raw.raw[4:8]), port
    if family == socket.AF_INET6:
        return socket.inet_ntop(family, raw.raw[8:24]), port
    return None


def _shut_reads(fd: int) -> None:
    _libc.shutdown(fd, socket.SHUT_RD)


class _Ask(NamedTuple):
    """A settling of the candidates of one group (``GroupSockets.settle``)."""

    epoch: int
    store: Any  # the group's store, under torch's prefix
    rank: int
    world: int
    store_at: tuple[str, int]  # where the store listens, as the workers were told
    mine: frozenset[Conn]
    given_up: Callable[[], bool]


class GroupSockets:
    """The TCP connections a process group made, so that another thread can cut them.
    First the candidates: those that appeared while it formed (or, for a group formed
    unwatched, every connection of the process); then, once the ranks said theirs in
    the group's store, those a peer holds the other end of (``ends``, off the
    training thread: ``settle``). Matched by descriptor *and* both addresses, so a
    descriptor number reused later by the script's own socket is never touched. Each is
    kept open by a duplicate until ``release``, or ``KEEP`` seconds after the cut
    (``expire``; see the module doc)."""

    def __init__(self) -> None:
        self._conns: set[Conn] = set()
        self._before: set[Conn] | None = None  # while forming: what was there already
        self._kept: list[tuple[Conn, int]] = []  # duplicates of the groups' connections
        self._cut_at: float | None = None  # when they were cut, until released
        self._epoch = 0  # which candidates a settling is for: a later one wins
        self._asks: queue.SimpleQueue[_Ask | None] = queue.SimpleQueue()
        self._settler: threading.Thread | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def forming(self) -> Iterator[None]:
        with self._lock:
            self._epoch += 1
            self._before = _connections()
        try:
            yield
        finally:
            with self._lock:
                before, self._before = self._before, None
                self._conns = _connections() - (before or set())
                self._keep()

    def _keep(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                self._kept.append((conn, os.dup(conn[0])))

    def release(self) -> None:
        """Close the duplicates: every rank of the groups formed so far has let go of
        them (the next placement came, or this worker no longer re-forms in place)."""
        with self._lock:
            kept, self._kept, self._cut_at = self._kept, [], None
        for _, fd in kept:
            with contextlib.suppress(OSError):
                os.close(fd)

    def expire(self, now: float) -> None:
        """Release the duplicates ``KEEP`` seconds after the cut (``now``: monotonic)."""
        if self._cut_at is not None and now - self._cut_at >= KEEP:
            self.release()

    @property
    def formed(self) -> set[Conn]:
        """The connections of the group as it formed (or was adopted)."""
        with self._lock:
            return set(self._conns)

    def adopt(self, formed: set[Conn] | None) -> None:
        """Take over a group formed before this object watched (the script's own, before
        ``State.run``): the connections it was seen to make (``formed``; see
        ``watch_first_group``), else every TCP connection of the process (none kept
        open then: a connection the script closes must close)."""
        with self._lock:
            self._epoch += 1
            self._conns = _connections() if formed is None else set(formed)
            if formed is not None:
                self._keep()

    def settle(
        self,
        store: Any,
        rank: int,
        world: int,
        store_at: tuple[str, int],
        given_up: Callable[[], bool],
    ) -> None:
        """Narrow the candidates to the group's (``ends``) through the group's
        ``store``, in the background: until then, or where the ranks cannot tell (a peer
        never says, the store goes, ``given_up()``), every candidate counts."""
        with self._lock:
            ask = _Ask(self._epoch, store, rank, world, store_at, frozenset(self._conns), given_up)
            if self._settler is None:
                self._settler = threading.Thread(
                    target=self._settle_each, name="elastic-settle", daemon=True
                )
                self._settler.start()
        self._asks.put(ask)

    def _settle_each(self) -> None:
        while (ask := self._asks.get()) is not None:
            narrowed = self._exchange(ask)
            if narrowed is None:
                continue
            with self._lock:
                if ask.epoch != self._epoch or self._before is not None:
                    continue  # cut, or another group formed meanwhile
                spared = self._conns - narrowed.group
                self._conns = set(narrowed.group)
                dropped = [fd for conn, fd in self._kept if conn in spared]
                self._kept = [(conn, fd) for conn, fd in self._kept if conn not in spared]
            for fd in dropped:
                with contextlib.suppress(OSError):
                    os.close(fd)
            level = logging.INFO if spared else logging.DEBUG
            log.log(level, "rank %s: its group's connections: %s", ask.rank, narrowed.why)

    def _exchange(self, ask: _Ask) -> ends.Narrowed | None:
        """Say this rank's ends, wait for every peer's (``SETTLE`` seconds at most) and
        read them; None where that cannot be done."""
        others = [r for r in range(ask.world) if r != ask.rank]
        keys = [ends.key(r) for r in others]
        deadline, pause = time.monotonic() + SETTLE, POLL
        try:
            ask.store.set(ends.key(ask.rank), ends.encode(ask.mine))
            while keys and not ask.store.check(keys):
                if ask.epoch != self._epoch or ask.given_up() or time.monotonic() > deadline:
                    return None
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
            said = ask.store.multi_get(keys) if keys else []
            host, port = ask.store_at
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            at = {(str(i[4][0]), port) for i in found}
        except Exception as e:  # the store went (the round broke): the candidates stand
            log.debug("rank %s: the group's connections stay its candidates: %s", ask.rank, e)
            return None
        peers = {r: ends.decode(v) for r, v in zip(others, said, strict=True)}
        return ends.narrow(ask.mine, peers, ask.rank, ask.world, at)

    def close(self) -> None:
        """No more groups: close the duplicates, and end the settling (waited for: a
        thread still in a store call as the interpreter ends aborts the process)."""
        self.release()
        with self._lock:
            self._epoch += 1  # a settling under way gives up at its next look
            settler = self._settler
        self._asks.put(None)
        if settler is not None and settler is not threading.current_thread():
            settler.join(timeout=1.0)

    def cut(self) -> int:
        """Shut the reading side of the group's connections; how many were cut. Every
        operation pending on them fails at once (see the module doc)."""
        with self._lock:
            now = _connections()
            mine = now - self._before if self._before is not None else now & self._conns
            self._conns = set()
            self._epoch += 1
            if self._cut_at is None:  # what is kept now, or once a forming group is
                self._cut_at = time.monotonic()
        for fd, _, _ in mine:
            _shut_reads(fd)
        return len(mine)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


_first_formed: set[Conn] | None = None  # what the script's own first group connected


def watch_first_group() -> None:
    """See the script's own ``init_process_group`` form the first group, so that a later
    abandon cuts that group's connections and no connection of the script's own (a
    logging client, a data service): ``torch.distributed.init_process_group`` is wrapped,
    once, to note the connections that appear while it runs. A script that took the
    function before importing elastic is not seen: all its connections count as the
    group's then."""
    dist = _dist()
    original = dist.init_process_group
    if getattr(original, "elastic_watched", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        global _first_formed
        if os.environ.get(LOBBY_ENV) and _first_formed is None:
            _first_formed = form_from_lobby(args, kwargs)
            return None
        first = _group is None and _first_formed is None
        before = _connections() if first else set()
        try:
            return original(*args, **kwargs)
        finally:
            if first:
                _first_formed = _connections() - before

    init_process_group.elastic_watched = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str) -> Any:
    """``init_process_group``'s argument ``name`` (position ``at``) as the script gave it."""
    return kwargs.get(name, args[at] if len(args) > at else None)


def form_from_lobby(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[Conn]:
    """The script's first ``init_process_group`` in a worker started before its node
    joined the job (``agent/lobby.py``): wait, live and stranded for the agent to see,
    for the placement it publishes once the round forms, and form the group as a
    re-forming worker does (``Group.form``: over the round's store, abortable, with the
    script's backend and timeout; a ``store`` or ``init_method`` of the script's, built
    from the address it was started with, is not the round's). A change while it forms
    (a member lost) sends it back to wait for the next placement, as any live worker.
    Returns the connections the group made (the script's first group, for ``adopt``)."""
    read = placed.stop()  # the script waits here: what it read, it read before
    # DDP's constructor imports torch._dynamo (1.5-2.5 s): here, while the others train,
    # not once placed, while they wait for this worker
    import torch._dynamo  # noqa: F401

    block = ControlBlock(os.environ[CONTROL_ENV])
    if read is None and placed.watched():
        block.mark(UNPLACED)  # any placement will do: it takes the round's in place
    elif read is not None:
        log.info("the script read %s before its placement: it takes only the one expected", read)
    global _group
    g = Group(block)  # live: the agent may hold it
    g.backend = str(_argument(args, kwargs, 0, "backend") or "")
    g.timeout = _argument(args, kwargs, 2, "timeout")
    try:
        g.leave()  # no group yet: it waits for its placement
        while True:
            placement = g.wait_placement(lambda: False)
            assert placement is not None
            try:
                g.form(placement)
                break
            except Exception as e:
                if not g.breaks(e):
                    raise
                g.leave()
        del os.environ[LOBBY_ENV]
    except BaseException:
        g.close()
        raise
    g.head_for_run()  # State.run takes it over (``attach``)
    _group = g
    return set(g.sockets.formed)


# -- aborting: policies per backend ------------------------------------------------------------
class Abort(Protocol):
    """One way of waking what the main thread has blocked on the group."""

    def __call__(self, group: Group) -> None: ...


class CutReads:
    """Shut the reading side of the group's TCP connections (see the module doc)."""

    def __call__(self, group: Group) -> None:
        group.sockets.cut()


class AbortNccl:
    """NCCL's communicator abort: its pending collectives return with an error."""

    def __call__(self, group: Group) -> None:
        with contextlib.suppress(Exception):
            _dist().distributed_c10d._abort_process_group()


ABORTS: dict[str, tuple[Abort, ...]] = {
    "gloo": (CutReads(),),
    "nccl": (AbortNccl(), CutReads()),  # the communicator, then the store's connection
}


def aborts_for(backend: str) -> tuple[Abort, ...]:
    """The policies that abort a group of ``backend`` (``cpu:gloo,cuda:nccl`` takes
    each one's, in order); an unknown backend gets the socket cut, which any TCP-based
    one obeys."""
    policies: list[Abort] = []
    for part in backend.lower().split(","):
        name = part.rpartition(":")[2].strip()
        for policy in ABORTS.get(name, (CutReads(),)):
            if not any(type(p) is type(policy) for p in policies):
                policies.append(policy)
    return tuple(policies) or (CutReads(),)


class Group:
    """One live worker's default process group and its link to the agent: a watcher
    thread that aborts the group when the agent asks, and the steps of a re-formation."""

    def __init__(self, block: ControlBlock) -> None:
        self.block = block
        self.sockets = GroupSockets()
        self.abandoned = threading.Event()  # the agent asked to leave the group now
        self._seen_abandon = block.abandon_generation
        self._seen_pause = block.pause_generation
        self.generation = block.placement_generation  # the placement it runs
        self.reformations = 0
        self.backend = ""
        self.timeout: datetime.timedelta | None = None  # the script's group's, if known
        self._store: Any = None  # the round's store, while its group lives
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._coming = False  # on its way into State.run (``head_for_run``)
        self._trainer = threading.get_ident()  # the thread that trains (and forms)
        self._blocked: stuck.Blocked | None = None  # after a cut, until it lets go
        self._looked = 0.0
        block.running(self.generation)
        block.mark(LIVE)
        self._thread = threading.Thread(target=self._watch, name="elastic-live", daemon=True)
        self._thread.start()

    @staticmethod
    def wanted(block: ControlBlock | None) -> bool:
        """Under elastic-run with ``--restart-mode live`` (the default)."""
        mode = os.environ.get(RESTART_MODE_ENV, RestartMode.LIVE.value)
        return block is not None and mode == RestartMode.LIVE.value

    def adopt(self) -> None:
        """Take over the default group the script formed before ``State.run``: its backend,
        and its connections (``watch_first_group``)."""
        dist = _dist()
        self.backend = str(dist.get_backend())
        self.sockets.adopt(_first_formed)
        with contextlib.suppress(Exception):  # private in torch: without it, the defaults
            store = dist.distributed_c10d._get_default_store()
            self.timeout = store.timeout
            at = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            rank, world = dist.get_rank(), dist.get_world_size()
            self.sockets.settle(store, rank, world, at, self.abandoned.is_set)

    # -- asks from the agent ------------------------------------------------------------------
    @property
    def pause_asked(self) -> bool:
        return self.block.pause_generation != self._seen_pause

    def head_for_run(self) -> None:
        """Its group formed in place (a worker started ahead): the script goes on to
        ``State.run``, building its model meanwhile. Until it gets there (``arrive``) an
        abandon still cuts the group, and it lets go once there; a script that reports
        first (a step, a heartbeat) trains outside State.run: the group is its own then."""
        with self._lock:
            self._coming = True
            self.block.unmark(LIVE)
            self.block.mark(COMING)

    def arrive(self) -> None:
        """The script is in ``State.run``: it re-forms in place from here on."""
        with self._lock:
            self._coming = False
            self.block.unmark(COMING)
            self.block.mark(LIVE)

    def _watch(self) -> None:
        while not self._closed.wait(POLL):
            with self._lock:
                if self._coming and not self.block.coming:  # it reported: it trains
                    self.block.unmark(COMING)  # outside State.run
                    self._coming = False
                    self._closed.set()
                    return
                self.sockets.expire(time.monotonic())
                self._look()
                generation = self.block.abandon_generation
                if generation == self._seen_abandon:
                    continue
                self._seen_abandon = generation
                self.abandoned.set()
                # its main thread must now let go: watched where gloo alone aborts it (NCCL's
                # abort may take seconds, and fails what it aborts)
                formed = self.block.phase is Phase.RUNNING and self.sockets.formed
                cut = all(isinstance(p, CutReads) for p in aborts_for(self.backend))
                if formed and cut and self._blocked is None:
                    self._blocked, self._looked = stuck.observe(None, *self._where()), 0.0
            self.abort()

    def _where(self) -> tuple[float, float, str]:
        """(now, the training thread's CPU time, "file:function" of its innermost frame;
        "" where it has none, or has ended)."""
        frame = sys._current_frames().get(self._trainer)
        where = f"{frame.f_code.co_filename}:{frame.f_code.co_name}" if frame else ""
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(self._trainer))
        except OSError:  # the thread ended (the interpreter exits)
            cpu, where = 0.0, ""
        return time.monotonic(), cpu, where

    def _look(self) -> None:
        """After a cut, until the training thread lets go: is it stuck (``stuck``)? Then
        say so to the agent, which replaces this node's workers."""
        if self._blocked is None or time.monotonic() - self._looked < LOOK:
            return
        if self.block.phase is not Phase.RUNNING:  # it let go
            self._blocked = None
            return
        now, cpu, where = self._where()
        self._looked = now
        self._blocked = stuck.observe(self._blocked, now, cpu, where)
        why = stuck.stuck(self._blocked, now)
        if why is not None:
            log.warning("rank %s: %s: its agent replaces it", os.environ.get("RANK", "?"), why)
            self.block.mark(STUCK)
            self._blocked = None

    def abort(self) -> None:
        """Wake whatever the main thread has blocked on the group (``aborts_for``)."""
        for policy in aborts_for(self.backend):
            policy(self)

    def breaks(self, e: BaseException) -> bool:
        """``e`` ends this round rather than the job: a pause the ranks agreed on, or a
        collective that failed because the group broke (a peer went, or we were asked to
        leave it). Never once closed: the workers no longer re-form in place."""
        if self._closed.is_set():
            return False
        if isinstance(e, Reformation):
            return True
        if not isinstance(e, Exception):
            return False  # KeyboardInterrupt, SystemExit: the script's own
        return self.abandoned.is_set() or peer_gone(f"{type(e).__name__}: {e}")

    # -- the steps of a re-formation ----------------------------------------------------------
    def leave(self) -> None:
        """Leave the process group and tell the agent this worker waits for a placement."""
        self.block.waiting(self.generation)
        self.abort()
        comm.control().forget()  # the next collective is on the next group
        dist = _dist()
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group may complain; it goes
                dist.destroy_process_group()
        else:  # a round given up while forming: torch counted the group it did not form
            # and names groups by that count; fresh workers name their first group "0",
            # and only groups of one name share their keys in the store
            dist.distributed_c10d._world.group_count = 0
        self._store = None

    def wait_placement(self, stopping: Callable[[], bool]) -> Placement | None:
        """The agent's next placement: its generation and the torchrun variables of the
        new round; None once ``stopping()`` says this worker is to save and exit instead."""
        while self.block.placement_generation == self.generation:
            if stopping():
                return None
            self.block.beat()  # waiting for the agent is not hanging (--worker-hang-timeout)
            time.sleep(POLL)
        generation = self.block.placement_generation  # first: the file is at least as new
        env, asked = read_placement(self.block.path)
        return Placement(generation, env, asked)

    def form(self, placement: Placement) -> None:
        """Take the placement into ``os.environ`` and form the new default group (a
        collective that fails here breaks the group again: see ``reform``)."""
        generation, env, asked = placement
        self.generation = generation  # consumed, formed or not: a given-up round is not retried
        self.sockets.release()  # placed: every rank of the old group has let go of it
        os.environ.update(env)
        with self._lock:  # asks made before this placement are answered by it: not later ones
            self._seen_abandon, self._seen_pause = asked
            if asked[0] == self.block.abandon_generation:
                self.abandoned.clear()
            else:  # asked after the agent published it: this round is given up already
                self.abandoned.set()
        dist = _dist()
        init = getattr(dist.init_process_group, "__wrapped__", dist.init_process_group)
        with self.sockets.forming():  # the group's connections: no need for the script's wrap
            store, rank, world = self._meet()
            init(
                backend=self.backend or None,
                timeout=CONNECT_TIMEOUT,
                store=store,
                rank=rank,
                world_size=world,
            )
        c10d = dist.distributed_c10d
        c10d._set_pg_timeout(self.timeout or c10d._get_default_timeout(dist.get_backend()))
        at = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        prefixed = dist.PrefixStore("default_pg", self._store.inner)  # as the group's keys
        self.sockets.settle(prefixed, rank, world, at, self.abandoned.is_set)
        self.reformations += 1
        self.block.running(generation)
        progress.relabel()

    def _meet(self) -> tuple[Any, int, int]:
        """The round's store (see ``roundstore``), its waits ended by an abandon: (store,
        rank, world size). It is kept as long as the group: the group's store calls
        reach back into it."""
        from elastic.worker import roundstore

        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

        def check_abandoned() -> None:
            if self.abandoned.is_set():
                raise roundstore.Abandoned("the round was given up while it formed")

        self._store = roundstore.connect(
            addr,
            port,
            rank,
            world,
            hosted_by_agent=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            check_abandoned=check_abandoned,
            timeout=self.timeout or datetime.timedelta(minutes=30),  # torch's gloo default
        )
        return _dist().PrefixStore("default_pg", self._store), rank, world

    def reform(
        self,
        prepare: Callable[[], None],
        resync: Callable[[], int],
        stopping: Callable[[], bool],
    ) -> int | None:
        """Leave the broken group, ``prepare`` (drop the step in flight), wait for the
        placement, form, ``resync`` (agree on the state: returns the step); again while
        the group breaks under it (a second change during the first). The step, or None
        when the agent asks this worker to stop instead (this node leaves)."""
        while True:
            self.leave()
            prepare()
            placement = self.wait_placement(stopping)
            if placement is None:
                return None
            try:
                self.form(placement)
                return resync()
            except Exception as e:
                if not self.breaks(e):
                    raise

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """The training function returned: stop watching, and tell the agent this worker
        no longer re-forms in place (a change now stops it, as any script)."""
        self.block.unmark(LIVE | COMING)
        self._closed.set()
        self._thread.join(timeout=1.0)
        self.sockets.close()


_group: Group | None = None


def attach(block: ControlBlock | None) -> Group | None:
    """This process's ``Group`` (one per process, whatever the number of States), or None
    where the agent will not re-form workers in place."""
    global _group
    if _group is not None and _group.closed:  # a lobby's group the script trained outside
        _group = None
    if _group is None and Group.wanted(block):
        assert block is not None
        _group = Group(block)
    elif _group is not None:
        _group.arrive()  # formed in the lobby
    return _group


def detach() -> None:
    global _group
    if _group is not None:
        _group.close()
        _group = None
