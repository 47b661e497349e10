"""The records in etcd: the round's split encoding (a header every node reads and buckets
of members, each node reading only its own; sizes checked against etcd's limits) and the
typed failure reports, validated where they are decoded."""

from __future__ import annotations

import pytest

from elastic.agent.failures import format_report
from rendezvous import records
from rendezvous.errors import MalformedRecordError
from rendezvous.records import (
    MAX_BUCKETS,
    NAMES,
    ClosedRecord,
    FailureRecord,
    FailureReport,
    GoneRecord,
    JobOutcome,
    Member,
    NodeRecord,
    RoundRecord,
    WorkerFailure,
    bucket_of,
    decode_bucket,
)
from rendezvous.view import KV, Decoded

ETCD_REQUEST_LIMIT = 1536 * 1024  # etcd's default --max-request-bytes
ETCD_TXN_OPS = 128  # etcd's default --max-txn-ops


def a_round(n: int, nproc: int = 8) -> RoundRecord:
    members = tuple(
        Member(f"node-{i:05d}", 1000 + i, f"10.0.{i // 250}.{i % 250}", nproc, probe=40000 + i)
        for i in range(n)
    )
    names = tuple(m.id for m in members)
    return RoundRecord(7, members, "10.0.0.0", 29500, 29501, joined=names)


def read_back(r: RoundRecord, me: str) -> RoundRecord:
    """What the node ``me`` holds after reading the header and its bucket."""
    header = RoundRecord.decode("/j/round", r.encode())
    raw = r.encode_buckets()[bucket_of(me, header.buckets)]
    number, members = decode_bucket("/j/members/x", raw)
    assert number == r.number
    return header.with_members(members)


def test_ranks_and_bases_follow_member_order() -> None:
    r = RoundRecord(
        1, (Member("a", 1, "h", 2), Member("b", 2, "h", 3), Member("c", 3, "h", 1)), "h", 1, 2
    )
    assert [(m.rank, m.base) for m in r.members] == [(0, 0), (1, 2), (2, 5)]
    assert (r.size, r.world_size, r.complete) == (3, 6, True)


@pytest.mark.parametrize("n", [1, 3, 64, 65, 1024, 10_000])
def test_every_node_finds_its_place_in_its_bucket_alone(n: int) -> None:
    r = a_round(n)
    for m in (r.members[0], r.members[n // 2], r.members[-1]):
        mine = read_back(r, m.id)
        assert mine.member(m.id) == m
        assert (mine.size, mine.world_size, mine.number) == (n, 8 * n, 7)
        assert mine.complete == (r.buckets == 1)
    header = RoundRecord.decode("/j/round", r.encode())
    everyone = [m for raw in r.encode_buckets().values() for m in decode_bucket("/j/m", raw)[1]]
    assert header.with_members(everyone) == RoundRecord.decode("/j/round", r.encode()).with_members(
        list(r.members)
    )
    assert sorted(everyone, key=lambda m: m.rank) == list(r.members)


def test_10000_members_fit_etcd_limits_and_each_node_reads_a_few_kb() -> None:
    r = a_round(10_000)
    buckets = r.encode_buckets()
    assert len(buckets) == MAX_BUCKETS and len(buckets) + 3 <= ETCD_TXN_OPS
    header = r.encode()
    assert len(header) < 4096  # joined names are capped; the counts are exact
    assert RoundRecord.decode("/j/round", header).counts == (10_000, 0, 0)
    assert len(RoundRecord.decode("/j/round", header).joined) == NAMES
    total = len(header) + sum(len(v) for v in buckets.values())
    assert total < ETCD_REQUEST_LIMIT // 2
    assert max(len(v) for v in buckets.values()) < 12_000  # what one node reads


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b'{"round": 1, "members": [["a", 1, "h", 1, 0]]}', "member 0 is not"),
        (b'{"round": 1, "members": [["a", "1", "h", 1, 0, 0]]}', "member 0 is not"),
        (b'{"round": 1, "members": [["a", 1, "h", 1, 0, 0, "9"]]}', "member 0 is not"),
        (b'{"round": 1, "members": [["a", 1, "h", 1, 0, 0, 9, 2, 1]]}', "member 0 is not"),
        (b'{"members": []}', "missing field 'round'"),
        (b"[1]", "expected a JSON object"),
    ],
)
def test_a_malformed_bucket_names_its_key(raw: bytes, why: str) -> None:
    with pytest.raises(MalformedRecordError, match=f"/j/members/3: {why}"):
        decode_bucket("/j/members/3", raw)


def test_a_member_written_before_members_had_probe_ports_reads_as_unprobeable() -> None:
    raw = b'{"round": 4, "members": [["a", 7, "h", 2, 0, 0]]}'
    assert decode_bucket("/j/members/0", raw) == (4, [Member("a", 7, "h", 2, 0, 0, probe=0)])


def test_a_members_round_of_joining_reads_back_and_an_older_record_says_it_is_unknown() -> None:
    r = RoundRecord(5, (Member("a", 7, "h", 2, probe=9, since=3),), "h", 1, 2)
    assert read_back(r, "a").members == r.members and r.members[0].since == 3
    raw = b'{"round": 4, "members": [["a", 7, "h", 2, 0, 0, 9]]}'
    assert decode_bucket("/j/members/0", raw)[1] == [Member("a", 7, "h", 2, 0, 0, 9, since=-1)]


def test_a_malformed_header_names_its_key() -> None:
    good = a_round(3).encode()
    with pytest.raises(MalformedRecordError, match=r"/j/round: .*size 0"):
        RoundRecord.decode("/j/round", good.replace(b'"size":3', b'"size":0'))
    with pytest.raises(MalformedRecordError, match="/j/round: field 'counts'"):
        RoundRecord.decode("/j/round", good.replace(b'"counts":[3,0,0]', b'"counts":[3]'))


# -- failure reports: one typed record, validated where it is decoded ---------------------------
CRASH = WorkerFailure(3, 1, 77, 1, 1700000000.5, "boom", "Traceback...\nboom", "/e.json")
REPORT = FailureReport("rank 3 (local_rank 1) on b: exit code 1: boom", "gpu-2", (CRASH,))


def test_a_failure_report_goes_through_etcd_unchanged() -> None:
    rec = FailureRecord("b", 4, 1700000001.0, REPORT)
    back = FailureRecord.decode("/j/job/failures/4/b", rec.encode())
    assert back == rec and back.report.failures[0].how == "exit code 1"
    root = back.root_cause()
    assert (root.node, root.time, root.summary) == ("b", 1700000001.0, REPORT.summary)
    closed = ClosedRecord(JobOutcome.FAILED, "budget spent", root_cause=root)
    assert ClosedRecord.decode("/j/job/closed", closed.encode()) == closed
    r = RoundRecord(2, (Member("a", 1, "h", 1),), "h", 1, 2, root_cause=root)
    assert RoundRecord.decode("/j/job/round", r.encode()).root_cause == root
    assert WorkerFailure(0, 0, 1, -9, 0.0).how == "signal SIGKILL"


@pytest.mark.parametrize(
    ("detail", "why"),
    [
        ('{"summary": 5}', "field 'summary' has the wrong type"),
        ('{"summary": "x", "failures": {}}', "field 'failures' is not a list"),
        ('{"summary": "x", "failures": [{"rank": "3"}]}', "field 'rank' has the wrong type"),
        ('{"summary": "x", "failures": [7]}', "a failure is not a JSON object"),
        ('{"summary": "x", "time": "noon"}', "field 'time' is not a number"),
    ],
)
def test_a_malformed_failure_report_names_its_key(detail: str, why: str) -> None:
    raw = f'{{"node": "b", "round": 4, "time": 1.0, "detail": {detail}}}'.encode()
    with pytest.raises(MalformedRecordError, match=f"/j/job/failures/4/b: {why}"):
        FailureRecord.decode("/j/job/failures/4/b", raw)


def test_a_forged_root_cause_leaves_the_closed_job_readable() -> None:
    """A closed record whose root cause has the wrong types still says the job is over;
    the report says the root cause is unreadable instead of crashing the agent."""
    raw = b'{"state": "failed", "reason": "x", "at": "noon", "root_cause": {"failures": [1]}}'
    closed = ClosedRecord.decode("/j/job/closed", raw)
    assert closed.state is JobOutcome.FAILED and closed.at == 0.0
    assert closed.root_cause is not None and "unreadable" in closed.root_cause.summary
    text = format_report("job j FAILED: x", closed.root_cause)
    assert "the root cause is unreadable" in text and "node      : ?" in text


@pytest.mark.parametrize(
    ("value", "lease", "live"),
    [
        (b'{"id": "a", "rev": 3, "addr": "h", "probe": 9}', 77, True),
        (b'{"id": "a", "rev": 3, "addr": "h", "probe": 9}', 0, False),  # on no lease
        (b'{"id": 7}', 77, False),
        (b"\x80", 77, False),
    ],
)
def test_the_lead_key_holds_a_live_leader_only_on_a_lease(
    value: bytes, lease: int, live: bool
) -> None:
    """What is no live leader's leaves the post vacant, and the view keeps its revision
    for the claim that replaces it."""
    decoded = Decoded()
    kv = KV("/j/job/leader", value, 5, 6, lease)
    decoded.put(records.LEADER, kv)
    view = decoded.view(6, 0.0)
    assert (view.leader is not None) is live and view.leader_kv == kv
    assert bool(view.problems) is not live


@pytest.mark.parametrize(
    ("raw", "lease", "why"),
    [
        (NodeRecord(id="a", addr="h", nproc=1).encode(), 1, None),
        (NodeRecord(id="a", addr="h", nproc=1).encode(), 0, "on no lease"),
        (b"\x80junk", 1, "not JSON"),
        (NodeRecord(id="b", addr="h", nproc=1).encode(), 1, "does not match the key"),
    ],
)
def test_a_value_at_a_nodes_key_is_an_agents_only_as_its_record_on_a_lease(
    raw: bytes, lease: int, why: str | None
) -> None:
    """What no agent wrote is no member (the view names it) and is removed by the node
    whose key it holds (``Session``); a value on no lease never goes by itself."""
    found = NodeRecord.foreign("/j/nodes/a", raw, lease)
    assert found is None if why is None else why in str(found)
    decoded = Decoded()
    decoded.put(records.NODES + "a", KV("/j/nodes/a", raw, 7, 7, lease))
    view = decoded.view(7, 0.0)
    assert ("a" in view.nodes) is (why is None)
    assert not view.problems if why is None else why in view.problems[0]


@pytest.mark.parametrize(
    ("resumes", "rev", "ok"), [(0, 7, True), (3, 3, True), (7, 7, False), (9, 9, False)]
)
def test_a_record_that_resumes_is_that_incarnation_and_never_a_later_one(
    resumes: int, rev: int, ok: bool
) -> None:
    """A node back from a lapse (``Session.resume``) is the incarnation it names, which
    must be older than its own record: a value naming another is ignored, by name."""
    decoded = Decoded()
    rec = NodeRecord(id="a", addr="h", nproc=1, resumes=resumes)
    decoded.put(records.NODES + "a", KV("/j/nodes/a", rec.encode(), 7, 7, 1))
    view = decoded.view(7, 0.0)
    if ok:
        assert view.nodes["a"].rev == rev and not view.problems
    else:
        assert "a" not in view.nodes and "resumes incarnation" in view.problems[0]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (b'{"step": 292, "node": "a", "round": 2, "at": 1.5}', ""),
        (b'{"step": 292, "node": "a", "round": 2, "at": 1.5, "final": 1}', ""),  # not True
        (b'{"step": -3, "node": "a", "round": 2}', "negative"),
        (b'{"step": "292", "node": "a", "round": 2}', "wrong type"),
        (b'{"node": "a", "round": 2}', "missing field 'step'"),
        (b"[292]", "expected a JSON object"),
    ],
)
def test_the_jobs_progress_is_read_or_named_as_malformed(value: bytes, why: str) -> None:
    """Any value at ``job/progress`` is survivable: what is not a progress record is
    ignored by name, and the job counts as having recorded nothing."""
    decoded = Decoded()
    decoded.put(records.PROGRESS, KV("/j/job/progress", value, 5, 6, 0))
    view = decoded.view(6, 0.0)
    if not why:
        assert view.progress == records.ProgressRecord(step=292, node="a", round=2, at=1.5)
        assert not view.problems
        return
    assert (
        view.progress is None and why in view.problems[0] and "/j/job/progress" in view.problems[0]
    )
    decoded.delete(records.PROGRESS)
    assert not decoded.view(7, 0.0).problems


def test_a_tombstone_says_whether_its_node_comes_back() -> None:
    """A node that steps out leaves a tombstone that says it comes back (rules.plan waits
    for it where it may hold the job's newest state); one written before says it does not."""
    back = GoneRecord(7, "host-a", 1.5, back=True)
    assert GoneRecord.decode("/j/gone/a", back.encode()) == back
    assert not GoneRecord.decode("/j/gone/a", b'{"rev": 7, "host": "h", "at": 1}').back
    assert not GoneRecord.decode("/j/gone/a", b'{"rev": 7, "back": "yes"}').back


def test_the_leaders_record_says_whom_the_next_round_waits_for() -> None:
    """``awaits``: names, in order; what is not a list of them reads as none (an older
    agent's record has no such field)."""
    rec = NodeRecord(id="a", addr="h", nproc=1, awaits=("c", "d"))
    assert NodeRecord.decode("/j/nodes/a", rec.encode()).awaits == ("c", "d")
    assert NodeRecord.decode("/j/nodes/a", NodeRecord(id="a", addr="h", nproc=1).encode()) == (
        NodeRecord(id="a", addr="h", nproc=1)
    )
    older = b'{"id": "a", "addr": "h", "nproc": 1, "done": 0}'
    assert NodeRecord.decode("/j/nodes/a", older).awaits == ()
    odd = b'{"id": "a", "addr": "h", "nproc": 1, "done": 0, "awaits": "c"}'
    assert NodeRecord.decode("/j/nodes/a", odd).awaits == ()
