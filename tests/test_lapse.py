"""An etcd outage longer than the lease TTL is not a node going away, against a real etcd
frozen for real: each node finds its lease dropped, sees that no round formed without
it, and carries on as the same incarnation on a new lease; the others do not count it
lost meanwhile. A node the job did move on without is fenced as before."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

import etcd3
import psutil
import pytest
from harness import wait_until

from elastic.agent.etcd_server import EtcdServer
from rendezvous import records
from rendezvous.client import EtcdClient
from rendezvous.config import RdzvConf, build_options
from rendezvous.errors import (
    EtcdUnavailableError,
    RendezvousCancelled,
    RendezvousError,
    RendezvousTimeoutError,
)
from rendezvous.lease import LeaseKeeper
from rendezvous.protocol import NodeSpec, Rendezvous
from rendezvous.records import NodeRecord, RoundRecord
from rendezvous.rules import RoundEnd

TTL = 2


@pytest.fixture
def pair(fresh_etcd: EtcdServer, run_id: str) -> Iterator[list[Rendezvous]]:
    """Nodes a and b of a two-node job, in round 1, on an etcd of the test's own."""
    with in_round(fresh_etcd, run_id, TTL) as nodes:
        yield nodes


def unstarted(
    endpoint: str, run_id: str, names: str, conf: RdzvConf, nnodes: tuple[int, int] = (2, 2)
) -> list[Rendezvous]:
    """Nodes ``names`` of a job of ``nnodes`` (min, max), each with a client of its own,
    not yet registered (``stop`` them)."""
    nodes = []
    for name in names:
        e, opts = build_options(endpoint, run_id, *nnodes, conf)
        nodes.append(Rendezvous(EtcdClient(e), opts, NodeSpec(id=name, addr="127.0.0.1", nproc=1)))
    return nodes


def stop(nodes: list[Rendezvous]) -> None:
    """End ``nodes`` as a dead agent would (no leaving), and close their clients."""
    for n in nodes:
        n.shutdown(leave=False)
    for n in nodes:
        n.client.close()


@contextlib.contextmanager
def in_round(
    fresh_etcd: EtcdServer,
    run_id: str,
    ttl: int,
    names: str = "ab",
    nnodes: tuple[int, int] = (2, 2),
) -> Iterator[list[Rendezvous]]:
    """Nodes ``names`` (a and b) of a job of ``nnodes`` on ``fresh_etcd``, in round 1."""
    conf = RdzvConf(connect_timeout=2, lease_ttl=ttl, last_call_timeout=0.1)
    nodes = unstarted(fresh_etcd.endpoint, run_id, names, conf, nnodes)
    for n in nodes:
        n.start()
    threads = [threading.Thread(target=n.next_round, kwargs={"timeout": 10}) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    try:
        assert [n.round.number if n.round else 0 for n in nodes] == [1] * len(nodes)
        yield nodes
    finally:
        stop(nodes)


def freeze(server: EtcdServer, seconds: float, during: Callable[[], None]) -> None:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        stopped = psutil.Process(server.proc.pid)  # the signal lands a moment later
        wait_until(lambda: stopped.status() == psutil.STATUS_STOPPED, 5, "etcd to stop")
        left = time.monotonic() + seconds
        during()
        time.sleep(max(left - time.monotonic(), 0))  # the fault: etcd away past the TTL
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def check(n: Rendezvous) -> RoundEnd | None:
    n.upkeep()
    change = n.check()
    return None if change is None else change.end


def record(n: Rendezvous) -> NodeRecord | None:
    kv = n.client.get(n.session.node_key)
    return None if kv is None else NodeRecord.decode(kv.key, kv.value)


def test_after_an_outage_past_the_ttl_each_node_carries_on_in_its_round(
    pair: list[Rendezvous], fresh_etcd: EtcdServer
) -> None:
    """etcd away again while a resumes fails that try, and the next one carries it on.
    Also: a call during the outage is not told "is this etcd's client port?" (what a
    port that never answered as etcd is told: test_first_hour), and the leases'
    keep-alive thread lives through it (it died on python3-etcd3's "no endpoint
    available", and no lease of the process was kept alive again)."""
    a, b = pair
    revs = [a.rev, b.rev]

    def call() -> None:
        with pytest.raises(EtcdUnavailableError, match="answered there before: it may be frozen"):
            a.client.get(a.session.node_key, timeout=1)

    def resume_fails() -> None:
        with pytest.raises(RendezvousError):
            a.resume()

    freeze(fresh_etcd, TTL + 1, call)  # every lease expires: none renewed for a TTL
    wait_until(lambda: check(a) is RoundEnd.LAPSED, 10, "a to find its lease dropped")
    wait_until(lambda: a.mirror.connected, 10, "a's view to be read again")
    freeze(fresh_etcd, 0, resume_fails)  # a second outage, during the recovery: tried again
    # still lapsed, once its view is read again (a moment after the thaw: None till then)
    seen: list[object] = []

    def lapsed() -> bool:
        seen[:] = [check(a), a.mirror.complete, a.mirror.connected, record(a)]
        return seen[0] is RoundEnd.LAPSED

    try:
        wait_until(lapsed, 10, "a to find its lease still dropped")
    except AssertionError as e:  # flaky under load, cause not yet known: what a saw
        raise AssertionError(f"{e}; a saw last (check, complete, connected, record): {seen}") from e
    wait_until(a.resume, 10, "a to carry on")
    # b has not come back yet: a, just out of the outage itself, does not count it lost
    assert record(b) is None and check(a) is None
    wait_until(lambda: check(b) is RoundEnd.LAPSED, 10, "b to find its lease dropped")
    wait_until(b.resume, 10, "b to carry on")
    for n, rev in zip(pair, revs, strict=True):
        rec = record(n)
        assert rec is not None and rec.resumes == rev and n.rev == rev
        assert check(n) is None  # the same round goes on, for both
    assert a.client.get(a.key(records.ROUND)) is not None
    granted = [n.session.lease.last_ok for n in pair]  # the new leases, kept alive:
    wait_until(
        lambda: all(n.session.lease.last_ok > t for n, t in zip(pair, granted, strict=True)),
        10,
        "a keep-alive of each new lease answered",
    )
    assert a.mirror.view().round is not None and a.mirror.view().round.number == 1


FOREIGN = [
    b"\x80junk",
    b'{"id": "a", "addr": "10.9.9.9", "nproc": 1, "done": 0}',  # a record, on no lease
]


@pytest.mark.parametrize("value", FOREIGN, ids=["not-json", "on-no-lease"])
def test_a_value_no_agent_wrote_over_a_nodes_record_is_replaced_by_that_node(
    pair: list[Rendezvous], value: bytes
) -> None:
    """Put over a's record mid-job, off its lease: a finds its record gone, as in an
    outage, and carries on over the value: removed, and a's record written again. Before,
    each try was refused ("changed meanwhile"), since a value on no lease never goes by
    itself: a was fenced, and its id stayed "taken", so it could not join again."""
    a, _ = pair
    rev = a.rev
    a.client.put(a.session.node_key, value)
    wait_until(lambda: check(a) is RoundEnd.LAPSED, 10, "a to find its record gone")
    wait_until(a.resume, 10, "a to carry on")
    rec = record(a)
    assert rec is not None and rec.resumes == rev and rec.addr == "127.0.0.1"
    assert check(a) is None


@pytest.mark.parametrize("value", FOREIGN, ids=["not-json", "on-no-lease"])
def test_a_node_registers_over_a_value_at_its_key_that_no_agent_wrote(
    fresh_etcd: EtcdServer, run_id: str, value: bytes
) -> None:
    """... and so does a node that finds one there as it joins, or joins again (it was
    refused: "node id 'a' is already taken")."""
    conf = RdzvConf(connect_timeout=2, lease_ttl=TTL, last_call_timeout=0.1)
    (a,) = unstarted(fresh_etcd.endpoint, run_id, "a", conf, (1, 1))
    client = a.client
    try:
        client.put(a.key(f"{records.NODES}a"), value)
        a.start()
        assert (rec := record(a)) is not None and rec.addr == "127.0.0.1"
        client.put(a.session.node_key, value)
        a.session.register_again()
        assert (rec := record(a)) is not None and rec.addr == "127.0.0.1"
    finally:
        stop([a])


def test_a_node_does_not_resume_into_a_job_that_moved_on(pair: list[Rendezvous]) -> None:
    """The round changed between the view and the resumption: refused in etcd itself.
    (etcd drops a's lease here as an outage would: revoked by another client.)"""
    a, b = pair
    b.client.revoke(a.session.lease_id)
    wait_until(lambda: check(a) is RoundEnd.LAPSED, 10, "a to find its lease dropped")
    view = a.mirror.view()
    header = a.client.get(a.key(records.ROUND))
    assert header is not None
    a.client.put(a.key(records.ROUND), header.value)  # as a leader writing a round would
    with pytest.raises(RendezvousError, match="changed meanwhile"):
        a.session.resume(view.round_mod_revision)
    assert record(a) is None


def test_a_vanished_member_is_lost_at_once_when_etcd_was_not_away() -> None:
    """No outage, no grace: a member whose lease expired while etcd answered froze or
    was cut off, and the others re-form without it at the TTL, as ever."""
    keeper = LeaseKeeper(cast(EtcdClient, None), ttl=4, interval=4 / 3)
    keeper.answered(0, 4, now=100.0)  # heard, for whatever lease
    assert keeper.outage_until(101.0) == 0.0
    keeper.answered(0, 4, now=101.3)
    assert keeper.outage_until(101.5) == 0.0
    # quiet for longer than a late keep-alive: etcd is away, the grace runs from now
    assert keeper.outage_until(104.0) == 108.0
    keeper.answered(0, -1, now=106.0)  # etcd is back (the lease gone or not)
    assert keeper.outage_until(107.0) == 110.0
    for t in (107.2, 108.5, 109.8):
        keeper.answered(0, 4, now=t)
    assert keeper.outage_until(110.5) == 110.0  # over: Session.outage() says None


def test_a_write_said_again_later_never_holds_the_loop_while_etcd_is_frozen(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    """The leader is told its workers re-form in place just as etcd freezes: saying it,
    and each upkeep after, return within the short bound of a write that is said again
    later (each used to wait out the 5 s request timeout, and the agent's loop with
    it: a SIGTERM then waited 22 s), and once etcd answers, the next upkeep says it.
    (A TTL that outlasts the freeze: this is not the lapse of the tests above.)"""
    with in_round(fresh_etcd, run_id, ttl=30) as pair:
        leader = next(n for n in pair if n.lead.holds(n.mirror.view()))
        took: list[float] = []
        errors: list[Exception] = []

        def during() -> None:
            for call in (lambda: leader.announce_in_place(True), leader.upkeep, leader.upkeep):
                started = time.monotonic()
                call()
                took.append(time.monotonic() - started)
            started = time.monotonic()
            try:  # the request's own deadline, not only its retries, is the bound
                leader.client.put(leader.key("probe"), b"x", timeout=0.5)
            except EtcdUnavailableError as e:
                errors.append(e)
            took.append(time.monotonic() - started)

        freeze(fresh_etcd, 0, during)
        assert max(took) < 2.0 and errors, (took, errors)

        def said() -> bool:
            leader.upkeep()
            rec = record(leader)
            return rec is not None and rec.in_place

        wait_until(said, 15, "the leader's record to say its workers re-form in place")


def test_the_jobs_progress_is_written_off_the_loop_while_etcd_is_frozen(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    """Rank 0 hands its step over as etcd freezes: the call returns at once (a loop held
    for a second by each write read as a paused agent and restarted the hang clock),
    the steps handed over while a write waits are not queued behind it, and once etcd
    answers the newest step is the job's."""
    with in_round(fresh_etcd, run_id, ttl=30) as pair:
        rank0 = next(n for n in pair if n.round is not None and n.round.rank_of(n.me.id) == 0)
        took: list[float] = []

        def during() -> None:
            for step in (5, 6, 7):
                started = time.monotonic()
                rank0.report_progress(step)
                took.append(time.monotonic() - started)
            assert not rank0.flush_progress(0.2), "etcd is frozen: the write waits"

        freeze(fresh_etcd, 0, during)
        assert max(took) < 0.1, took

        def recorded(step: int) -> bool:
            rank0.report_progress(step)
            rank0.flush_progress()
            kv = rank0.client.get(rank0.key(records.PROGRESS))
            return kv is not None and records.ProgressRecord.decode(kv.key, kv.value).step == step

        wait_until(lambda: recorded(8), 15, "step 8 to be the job's progress")
        rank0.report_progress(9, final=True)  # as it leaves: flushed, and its last word
        kv = rank0.client.get(rank0.key(records.PROGRESS))
        assert kv is not None
        last = records.ProgressRecord.decode(kv.key, kv.value)
        assert last.step == 9 and last.final


def test_a_node_whose_new_lease_etcd_drops_before_its_registration_registers_anew(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    """etcd frozen past the TTL just after it granted a joining node's lease: on the thaw
    it drops the lease, and the registration that names it is refused ("requested lease
    not found"). The node grants another and joins (it exited with that error)."""
    conf = RdzvConf(connect_timeout=10, lease_ttl=TTL, last_call_timeout=0.1)
    [node] = unstarted(fresh_etcd.endpoint, run_id, "a", conf, (1, 2))
    keeper = node.session.lease
    grant = keeper.grant
    granted: list[int] = []

    raw = etcd3.client(fresh_etcd.host, fresh_etcd.client_port)

    def grant_then_freeze(timeout: float | None = None) -> int:
        lease_id = grant(timeout=timeout)
        granted.append(lease_id)
        if len(granted) == 1:  # the fault, at its moment: etcd away past the TTL
            freeze(fresh_etcd, TTL + 1.5, lambda: None)
            # etcd revokes a lease that expired while it was stopped at its lessor's next
            # tick: a registration in between is still taken (on a lease then revoked: the
            # lapse path), and the case here is the refused one (a full suite's load let
            # the registration in first once)
            wait_until(lambda: raw.get_lease_info(lease_id).TTL == -1, 10, "the revocation")
        return lease_id

    keeper.grant = grant_then_freeze  # type: ignore[method-assign]
    try:
        node.start()
        rec = record(node)
        assert len(granted) == 2 and rec is not None and rec.id == "a"
        kv = node.client.get(node.session.node_key)
        assert kv is not None and kv.lease == granted[1]
    finally:
        raw.close()
        stop([node])


def test_a_node_joining_while_etcd_is_away_waits_for_it_and_hears_a_signal(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    """etcd answered (the node read the job), then froze for longer than connect_timeout
    as the node registered: an outage, not a wrong endpoint, so it tries again until
    etcd answers and joins (it exited with "etcd unreachable"); a signal meanwhile (the
    agent's cancel) ends the wait at once."""
    conf = RdzvConf(connect_timeout=2, lease_ttl=TTL, last_call_timeout=0.1)
    nodes = unstarted(fresh_etcd.endpoint, run_id, "ab", conf, (1, 2))
    for n in nodes:
        n.glance()  # etcd answers this process
    cancel = threading.Event()
    outcome: dict[str, object] = {}

    def join(n: Rendezvous, stop: threading.Event | None) -> None:
        try:
            n.start(cancel=stop)
            outcome[n.node_id] = "joined"
        except RendezvousError as e:
            outcome[n.node_id] = e

    def during() -> None:
        threads = [
            threading.Thread(target=join, args=(nodes[0], cancel)),
            threading.Thread(target=join, args=(nodes[1], None)),
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)
        cancel.set()
        threads[0].join(3.0)
        assert isinstance(outcome.get("a"), RendezvousCancelled), outcome

    try:
        freeze(fresh_etcd, conf.connect_timeout + 2, during)
        wait_until(lambda: "b" in outcome, 15, "b to register once etcd answers")
        assert outcome["b"] == "joined", outcome
        assert record(nodes[1]) is not None
    finally:
        stop(nodes)


def test_a_node_waiting_for_a_round_while_etcd_stays_away_gives_up_at_its_join_timeout(
    pair: list[Rendezvous], fresh_etcd: EtcdServer
) -> None:
    """b waits for round 2, which a (the leader) would form; etcd goes away for good. The
    leader enforces join_timeout, but no leader can act without etcd: b gives up at its
    own deadline instead of waiting forever (an agent was found so, 20 minutes on)."""
    b = pair[1]
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            b.next_round(timeout=3)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)  # b waits for a to form round 2

    def during() -> None:
        began = time.monotonic()
        waiter.join(8)
        assert outcome, "b still waits, etcd away past its join_timeout"
        assert isinstance(outcome[0], RendezvousTimeoutError), outcome
        assert "etcd does not answer" in str(outcome[0]) and time.monotonic() - began < 6

    freeze(fresh_etcd, 9, during)


def test_a_registration_etcd_applied_after_its_try_gave_up_is_the_nodes_own(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    """etcd frozen (for less than the TTL) just after granting the joining node's lease:
    the registration's try gives up unanswered (2 s), and etcd applies it on the thaw.
    The next try finds the node id held on this node's own lease: registered (it read
    "node id already taken" and exited)."""
    conf = RdzvConf(connect_timeout=10, lease_ttl=6, last_call_timeout=0.1)
    [node] = unstarted(fresh_etcd.endpoint, run_id, "a", conf, (1, 2))
    node.glance()  # etcd answers this process: tries of 2 s
    keeper = node.session.lease
    grant = keeper.grant
    frozen = threading.Thread(target=freeze, args=(fresh_etcd, 3.5, lambda: None))

    def grant_then_freeze(timeout: float | None = None) -> int:
        lease_id = grant(timeout=timeout)
        if not frozen.is_alive() and frozen.ident is None:
            frozen.start()  # the fault, at its moment, while the registration goes on
            assert fresh_etcd.proc is not None
            server = psutil.Process(fresh_etcd.proc.pid)
            wait_until(lambda: server.status() == psutil.STATUS_STOPPED, 5, "etcd to stop")
        return lease_id

    keeper.grant = grant_then_freeze  # type: ignore[method-assign]
    try:
        node.start()
        frozen.join(10)
        kv = node.client.get(node.session.node_key)
        assert kv is not None and kv.lease == node.session.lease_id
    finally:
        stop([node])


def test_a_fenced_node_joins_again_through_an_etcd_outage_that_comes_as_it_does(
    fresh_etcd: EtcdServer, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two faults: a's lease is gone and b re-forms without it (a is fenced); as a joins
    again as a new node, etcd freezes for longer than a try (it exited with "etcd
    unreachable"). a tries again until etcd answers, and b takes it into a round. (b's
    lease outlives the freeze: a TTL of 9 s leaves it 2.5 s after the thaw, at its
    keep-alive's worst, for the client to reach etcd again; at 6 s, 0.5 s was once too
    little in the whole suite, and b had its own outage to recover from.)"""
    conf = RdzvConf(connect_timeout=2, lease_ttl=9, last_call_timeout=0.1)
    nodes = unstarted(fresh_etcd.endpoint, run_id, "ab", conf, (1, 2))
    a, b = nodes
    rounds: dict[str, object] = {}

    def next_round(n: Rendezvous) -> None:
        try:
            rounds[n.node_id] = n.next_round(timeout=30)
        except RendezvousError as e:
            rounds[n.node_id] = e

    try:
        for n in nodes:
            n.start()
        both = [threading.Thread(target=next_round, args=(n,)) for n in nodes]
        for t in both:
            t.start()
        for t in both:
            t.join(15)
        first = rounds.pop("a")
        assert isinstance(first, RoundRecord) and first.size == 2, first
        b.client.revoke(a.session.lease_id)
        wait_until(lambda: check(b) is RoundEnd.LOST, 10, "b to find a lost")
        next_round(b)  # round 2, b alone: a is fenced
        grant = a.session.lease.grant
        frozen = threading.Thread(target=freeze, args=(fresh_etcd, 3.5, lambda: None))

        def grant_then_freeze(timeout: float | None = None) -> int:
            lease_id = grant(timeout=timeout)
            if frozen.ident is None:
                frozen.start()  # the second fault, as a registers again
                assert fresh_etcd.proc is not None
                server = psutil.Process(fresh_etcd.proc.pid)
                wait_until(lambda: server.status() == psutil.STATUS_STOPPED, 5, "etcd to stop")
            return lease_id

        a.session.lease.grant = grant_then_freeze  # type: ignore[method-assign]
        joining = threading.Thread(target=next_round, args=(a,))
        joining.start()
        wait_until(lambda: frozen.ident is not None, 10, "a to register again")
        frozen.join(10)
        wait_until(lambda: check(b) is RoundEnd.WAITING, 15, "b to see a waiting")
        next_round(b)
        joining.join(15)
        assert "could not join again yet" in caplog.text  # the fault did hit a's try
        assert isinstance(rounds["a"], RoundRecord), rounds
        assert rounds["a"].number == 3 and rounds["a"].size == 2, rounds["a"]
    finally:
        stop(nodes)


def test_a_member_that_died_in_the_outage_is_proven_dead_by_whoever_leads_after_it(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    """c's agent dies while etcd is frozen past the TTL; nobody probes it meanwhile. The
    lead went with its holder's lease, and the node that claims it after the outage
    never read c's record (gone now): it proves c dead from the probe port the round
    recorded, and ends the round at once, not after the outage's grace (a and b are
    back; c is not on its way)."""
    with in_round(fresh_etcd, run_id, 3, "abc", (2, 3)) as nodes:
        a, b, c = nodes
        dead = c.rev
        freeze(fresh_etcd, 4, lambda: c.shutdown(leave=False))
        for n in (a, b):
            wait_until(lambda n=n: check(n) is RoundEnd.LAPSED, 10, "its lease found dropped")
            wait_until(n.resume, 10, "it to carry on")
        wait_until(
            lambda: [check(n) for n in (a, b)] == [None, None] and (a.leads or b.leads),
            10,
            "a or b to claim the lead",
        )
        lead = a if a.leads else b
        wait_until(
            lambda: lead.mirror.complete and {"a", "b"} <= set(lead.mirror.view().nodes),
            10,
            "the leader to read the whole job, a and b back in it",
        )  # else c is not alone in being gone, and no proof of c ends the round
        assert lead.session.outage() is not None and check(lead) is None, "c has a grace"
        lead.probe_members()
        assert lead.lead.proven == {"c": dead}
        assert lead.session.outage() is not None, "still in the grace: the proof ended it"
        change = lead.check()
        assert change is not None and change.end is RoundEnd.LOST and change.nodes == ("c",)


def test_a_newcomer_that_registers_as_etcd_answers_again_waits_for_the_members_it_dropped(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    """a and b train through an outage past the TTL; c, which read the job before it,
    registers during it and gets through as etcd answers again, before a and b carry on
    (their agents are slow to look). c claims the vacant lead and plans the next round: a
    round of c alone (one node is enough) would fence a and b though no node died; it
    waits out the outage's grace for them instead, and the three form round 2."""
    with in_round(fresh_etcd, run_id, TTL, "ab", (1, 3)) as (a, b):
        conf = RdzvConf(connect_timeout=2, lease_ttl=TTL, last_call_timeout=0.1)
        (c,) = unstarted(fresh_etcd.endpoint, run_id, "c", conf, (1, 3))
        c.glance()  # etcd answered c before: a registration that fails is an outage
        rounds: dict[str, object] = {}

        def next_round(n: Rendezvous, register: bool = False) -> None:
            try:
                if register:
                    n.start()
                rounds[n.node_id] = n.next_round(timeout=30)
            except RendezvousError as e:
                rounds[n.node_id] = e

        joining = threading.Thread(target=next_round, args=(c, True))
        try:
            freeze(fresh_etcd, TTL + 1, joining.start)
            wait_until(lambda: c.leads, 10, "c to register and claim the vacant lead")
            time.sleep(0.5)  # c plans at once: a round of its own would be written by now
            header = a.client.get(a.key(records.ROUND))
            assert header is not None and RoundRecord.decode(header.key, header.value).number == 1
            for n in (a, b):
                wait_until(lambda n=n: check(n) is RoundEnd.LAPSED, 10, "its lease dropped")
                assert n.resume(), "a round formed without it"
            both = [threading.Thread(target=next_round, args=(n,)) for n in (a, b)]
            for n, t in zip((a, b), both, strict=True):
                wait_until(lambda n=n: check(n) is RoundEnd.WAITING, 10, "c waiting to join")
                t.start()
            for t in (*both, joining):
                t.join(30)
            assert {n: getattr(r, "number", r) for n, r in rounds.items()} == dict.fromkeys(
                "abc", 2
            )
        finally:
            stop([c])


def test_a_claim_of_the_lead_on_a_lease_etcd_dropped_is_no_error(
    pair: list[Rendezvous], caplog: pytest.LogCaptureFixture
) -> None:
    """A node whose lease etcd dropped after its view was read (an outage past the TTL)
    may try to claim a vacant lead with it: etcd refuses ("requested lease not found").
    That ended a standby's agent with exit 1 (chaos seed 27); now the claim is given up,
    and the session finds its lease gone as before."""
    a, _ = pair
    lead = a.client.get(a.lead._key)
    assert lead is not None
    assert a.client.delete_if(lead.key, lead.mod_revision)  # the post is vacant
    a.client.revoke(a.session.lease_id)
    with caplog.at_level(logging.INFO, logger="rendezvous"):
        a.lead._claim(None)  # raised LeaseNotFoundError
    assert "not claiming the lead" in caplog.text
    assert a.client.get(a.lead._key) is None
    wait_until(lambda: check(a) in (RoundEnd.LAPSED, RoundEnd.FENCED), 10, "a to see it")


def test_a_look_at_the_job_with_a_short_timeout_is_short_while_etcd_is_frozen(
    fresh_etcd: EtcdServer, run_id: str
) -> None:
    """A node out of the job (``lobby.step_out``) and a standby's warm-up look at the job
    again and again: etcd frozen must not hold each look for the connect timeout, three
    reads long (chaos seed 36: two nodes out of the job came back 14 s after stepping
    out, past OUT_MAX), but only for the timeout they pass."""
    conf = RdzvConf(connect_timeout=6, lease_ttl=TTL, last_call_timeout=0.1)
    [node] = unstarted(fresh_etcd.endpoint, run_id, "a", conf)
    node.glance()  # etcd answers this process
    took: list[float] = []

    def look() -> None:
        began = time.monotonic()
        with pytest.raises(RendezvousError):
            node.glance(timeout=0.5)
        took.append(time.monotonic() - began)

    try:
        freeze(fresh_etcd, 0.0, look)
    finally:
        stop([node])
    assert took and took[0] < 3.0, took  # the connect timeout would be 6 s, three times
