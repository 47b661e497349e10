"""The round's split encoding: a header every node reads and buckets of members, each
node reading only its own (see records.py); sizes checked against etcd's limits."""

from __future__ import annotations

import pytest

from rendezvous.errors import MalformedRecordError
from rendezvous.records import (
    MAX_BUCKETS,
    NAMES,
    Member,
    RoundRecord,
    bucket_of,
    decode_bucket,
)

ETCD_REQUEST_LIMIT = 1536 * 1024  # etcd's default --max-request-bytes
ETCD_TXN_OPS = 128  # etcd's default --max-txn-ops


def a_round(n: int, nproc: int = 8) -> RoundRecord:
    members = tuple(
        Member(f"node-{i:05d}", 1000 + i, f"10.0.{i // 250}.{i % 250}", nproc) for i in range(n)
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
        (b'{"members": []}', "missing field 'round'"),
        (b"[1]", "expected a JSON object"),
    ],
)
def test_a_malformed_bucket_names_its_key(raw: bytes, why: str) -> None:
    with pytest.raises(MalformedRecordError, match=f"/j/members/3: {why}"):
        decode_bucket("/j/members/3", raw)


def test_a_malformed_header_names_its_key() -> None:
    good = a_round(3).encode()
    with pytest.raises(MalformedRecordError, match=r"/j/round: .*size 0"):
        RoundRecord.decode("/j/round", good.replace(b'"size":3', b'"size":0'))
    with pytest.raises(MalformedRecordError, match="/j/round: field 'counts'"):
        RoundRecord.decode("/j/round", good.replace(b'"counts":[3,0,0]', b'"counts":[3]'))
