"""The etcd v3 rendezvous against a real etcd, each participant its own OS process."""

from __future__ import annotations

import contextlib
import signal
import time

import pytest
from harness import ROOT, Proc, python, wait_until
from test_lapse import stop, unstarted

from elastic.agent.etcd_server import EtcdServer
from rendezvous import records
from rendezvous.client import EtcdClient
from rendezvous.config import RdzvConf, build_options
from rendezvous.rules import plan

PARTICIPANT = ROOT / "tests" / "participant.py"
TTL = 3


def join(
    procs: list[Proc],
    endpoint: str,
    run_id: str,
    node: str,
    nnodes: str = "1:4",
    conf: str = "",
    max_restarts: int = 0,
    arrive: bool = False,
) -> Proc:
    conf = ",".join(filter(None, [f"lease_ttl={TTL}", "last_call_timeout=0.5", conf]))
    p = Proc(
        python(
            PARTICIPANT,
            "--endpoint",
            endpoint,
            "--run-id",
            run_id,
            "--id",
            node,
            "--nnodes",
            nnodes,
            "--conf",
            conf,
            "--max-restarts",
            str(max_restarts),
            *(["--arrive"] if arrive else []),
        ),
        name=node,
    )
    procs.append(p)
    return p


def join_in_order(
    procs: list[Proc], endpoint: str, run_id: str, names: str, **kw: object
) -> list[Proc]:
    """Start nodes one after another, so join order (and rank order) is ``names``."""
    started = []
    for name in names:
        started.append(join(procs, endpoint, run_id, name, **kw))
        started[-1].expect("ready")
    return started


def start_round(nodes: list[Proc], timeout: float = 15.0, **match: object) -> list[dict]:
    for n in nodes:
        if not n.has_seen("ready"):
            n.expect("ready")
    for n in nodes:
        n.send("next")
    return [n.expect("round", timeout, **match) for n in nodes]


def test_round_forms_with_join_order_ranks(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    nodes = []
    for name in ("a", "b", "c"):
        nodes.append(join(procs, etcd.endpoint, run_id, name, nnodes="3"))
        nodes[-1].expect("ready")  # registration order is join order
    rounds = start_round(nodes)
    assert [r["rank"] for r in rounds] == [0, 1, 2]
    assert {tuple(r["members"]) for r in rounds} == {("a", "b", "c")}
    assert {r["master_port"] for r in rounds} == {rounds[0]["master_port"]}
    assert rounds[0]["cause"] == "start" and rounds[0]["world_size"] == 3
    # rank 0 leads (reads the whole job); the others read their share of it
    assert [r["leads"] for r in rounds] == [True, False, False]


def test_min_max_last_call(etcd: EtcdServer, run_id: str, procs: list[Proc]) -> None:
    a = join(procs, etcd.endpoint, run_id, "a", nnodes="2:3", conf="last_call_timeout=2")
    a.expect("ready")
    a.send("next")
    time.sleep(0.5)
    assert a.events.empty(), "a round formed below MIN"
    b = join(procs, etcd.endpoint, run_id, "b", nnodes="2:3", conf="last_call_timeout=2")
    b.expect("ready")
    started = time.monotonic()
    b.send("next")
    a.expect("round", members=["a", "b"])
    b.expect("round", members=["a", "b"])
    # below MAX the round waits out the last call after the latest arrival
    assert 1.5 <= time.monotonic() - started < 5


def test_sigkill_noticed_within_ttl(etcd: EtcdServer, run_id: str, procs: list[Proc]) -> None:
    a, b, c = join_in_order(procs, etcd.endpoint, run_id, "abc", nnodes="2:3")
    before = start_round([a, b, c])[0]
    killed = time.monotonic()
    c.signal(signal.SIGKILL)
    ev = a.expect("change", end="LOST", timeout=TTL + 3)
    assert time.monotonic() - killed <= TTL + 1
    assert ev["nodes"] == ["c"]
    b.expect("change", end="LOST")
    # survivors keep their relative order, no restart is charged, a fresh port is used
    after = start_round([a, b])
    survivors = [m for m in before["members"] if m != "c"]
    assert [r["members"] for r in after] == [survivors, survivors]
    assert after[0]["cause"] == "lost" and after[0]["lost"] == ["c"]
    assert after[0]["restarts"] == 0
    assert after[0]["master_port"] != before["master_port"]


def test_sigstop_noticed_and_frozen_node_fences_itself(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    a, b, c = join_in_order(procs, etcd.endpoint, run_id, "abc", nnodes="2:3")
    rounds = start_round([a, b, c])
    old_port = rounds[0]["master_port"]
    stopped = time.monotonic()
    b.signal(signal.SIGSTOP)
    a.expect("change", end="LOST", nodes=["b"], timeout=TTL + 3)
    assert time.monotonic() - stopped <= TTL + 1
    c.expect("change", end="LOST", nodes=["b"])
    a.send("next")
    c.send("next")
    r = a.expect("round", members=["a", "c"])
    assert r["master_port"] != old_port
    c.expect("round", members=["a", "c"])
    b.signal(signal.SIGCONT)
    b.expect("change", end="FENCED", timeout=10)
    # it comes back as a new node: the others see a newcomer waiting, drain, and admit it
    b.send("next")
    a.expect("change", end="WAITING", nodes=["b"], timeout=10)
    a.send("next")
    c.send("next")
    back = b.expect("round", timeout=15)
    assert back["members"] == ["a", "c", "b"] and back["cause"] == "resize"
    assert back["rev"] > 0


def test_graceful_leave_noticed_at_once(etcd: EtcdServer, run_id: str, procs: list[Proc]) -> None:
    a, b = join_in_order(procs, etcd.endpoint, run_id, "ab", nnodes="1:2")
    start_round([a, b])
    left = time.monotonic()
    b.send("leave")
    a.expect("change", end="LEFT", nodes=["b"], timeout=5)
    assert time.monotonic() - left < 1.0
    b.expect("left")
    a.send("next")
    r = a.expect("round")
    assert r["members"] == ["a"] and r["cause"] == "left" and r["left"] == ["b"]


def test_standby_admitted_when_member_dies(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    a, b = join_in_order(procs, etcd.endpoint, run_id, "ab", nnodes="1:2")
    start_round([a, b])
    s = join(procs, etcd.endpoint, run_id, "s", nnodes="1:2")
    s.expect("ready")
    s.send("next")
    time.sleep(1.0)
    assert a.events.empty() and s.events.empty(), "no room: the standby must only wait"
    a.signal(signal.SIGKILL)  # the rank-0 node dies: b becomes rank 0, s is admitted
    b.expect("change", end="LOST", nodes=["a"], timeout=TTL + 3)
    b.send("next")
    rb = b.expect("round")
    rs = s.expect("round")
    assert rb["members"] == rs["members"] == ["b", "s"]
    assert (rb["rank"], rs["rank"]) == (0, 1)
    assert rs["joined"] == ["s"]


def test_rank0_stays_rank0_while_alive(etcd: EtcdServer, run_id: str, procs: list[Proc]) -> None:
    a, b, c = join_in_order(procs, etcd.endpoint, run_id, "abc", nnodes="1:3")
    start_round([a, b, c])
    b.signal(signal.SIGKILL)
    a.expect("change", end="LOST", timeout=TTL + 3)
    c.expect("change", end="LOST", timeout=TTL + 3)
    ra, rc = start_round([a, c])
    assert (ra["rank"], rc["rank"]) == (0, 1)
    d = join(procs, etcd.endpoint, run_id, "d", nnodes="1:3")
    d.expect("ready")
    d.send("next")
    a.expect("change", end="WAITING", nodes=["d"], timeout=5)
    c.expect("change", end="WAITING", nodes=["d"], timeout=5)
    a.send("next")
    c.send("next")
    assert a.expect("round")["members"] == ["a", "c", "d"]
    assert d.expect("round")["rank"] == 2


def test_worker_failure_charges_one_restart_then_closes(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    a, b = join_in_order(procs, etcd.endpoint, run_id, "ab", nnodes="2", max_restarts=1)
    start_round([a, b])
    b.send("fail")
    a.expect("change", end="PEER_FAILED", nodes=["b"])
    a.send("fail")  # the cascade on the other node is the same failure: charged once
    b.send("next")
    a.send("next")
    r = a.expect("round")
    assert r["cause"] == "failure" and r["restarts"] == 1
    b.expect("round")
    a.send("fail")
    b.expect("change", end="PEER_FAILED")
    b.send("next")
    a.send("next")
    err = a.expect("error", kind="RendezvousClosedError")
    assert "restart budget spent" in err["message"] and "worker failed on a" in err["message"]
    b.expect("error", kind="RendezvousClosedError")


def test_closed_job_refuses_late_joiners(etcd: EtcdServer, run_id: str, procs: list[Proc]) -> None:
    a = join(procs, etcd.endpoint, run_id, "a", nnodes="1")
    start_round([a])
    a.send("close")
    assert a.expect("closed")["wrote"] is True
    late = join(procs, etcd.endpoint, run_id, "late", nnodes="1")
    err = late.expect("error")
    assert err["kind"] == "RendezvousClosedError" and "has finished" in err["message"]
    assert late.wait(10) == 3


def test_run_ids_are_isolated(etcd: EtcdServer, run_id: str, procs: list[Proc]) -> None:
    x = join_in_order(procs, etcd.endpoint, run_id + "-x", "pq", nnodes="2")
    y = join_in_order(procs, etcd.endpoint, run_id + "-y", "pq", nnodes="2")
    rx, ry = start_round(x), start_round(y)
    assert rx[0]["members"] == ry[0]["members"] == ["p", "q"]  # same node ids, two jobs
    x[1].signal(signal.SIGKILL)
    x[0].expect("change", end="LOST", timeout=TTL + 3)
    time.sleep(0.5)
    assert all(ev["event"] != "change" for ev in list(y[0].events.queue))


def test_custom_prefix(etcd: EtcdServer, run_id: str, procs: list[Proc]) -> None:
    a = join(procs, etcd.endpoint, run_id, "a", nnodes="1", conf="prefix=/teams/ml")
    start_round([a])
    e, _ = build_options(etcd.endpoint, run_id, 1, 1)
    client = EtcdClient(e)
    try:
        _, kvs = client.get_prefix(f"/teams/ml/{run_id}/")
        assert {kv.key.rsplit("/", 1)[-1] for kv in kvs} >= {"a", "round"}
        assert client.get_prefix(f"/elastic-run/{run_id}/")[1] == []
    finally:
        client.close()


@pytest.mark.parametrize("value", [b"\x80\x04\x95pickle", b"[1, 2]", b'{"number": "one"}'])
def test_a_value_at_the_round_key_that_no_leader_wrote_is_named_and_written_over(
    etcd: EtcdServer, run_id: str, procs: list[Proc], client: EtcdClient, value: bytes
) -> None:
    """Before the job: the first round is written over it. Mid-job: the round goes on
    (the last good header stands), and the next change's round is written over it.
    Before, every agent exited with MalformedRecordError, and no node could join."""
    key = f"/elastic-run/{run_id}/{records.ROUND}"
    client.put(key, value)
    a, b = join_in_order(procs, etcd.endpoint, run_id, "ab", nnodes="1:3")
    assert [r["number"] for r in start_round([a, b])] == [1, 1]
    a.wait_output(key, stream="err")  # named in the log
    client.put(key, value)
    c = join(procs, etcd.endpoint, run_id, "c", nnodes="1:3")
    rounds = start_round([a, b, c])
    assert [r["members"] for r in rounds] == [["a", "b", "c"]] * 3
    assert [r["number"] for r in rounds] == [2, 2, 2]
    assert "Traceback" not in "\n".join(a.err + b.err + c.err)


def test_a_leader_that_never_saw_the_rounds_header_numbers_the_next_above_it(
    etcd: EtcdServer, run_id: str, procs: list[Proc], client: EtcdClient
) -> None:
    """Round 1's header hidden by a value no leader wrote; c joins (it never saw the
    header) and leads once a and b are killed: its round is 2, read from the members'
    bucket and the nodes' records, not 1 again (chaos seed 8: a survivor of the old
    round 3 took a new "round 3" for no news)."""
    a, b = join_in_order(procs, etcd.endpoint, run_id, "ab", nnodes="1:3")
    assert [r["number"] for r in start_round([a, b])] == [1, 1]
    client.put(f"/elastic-run/{run_id}/{records.ROUND}", b"\x80junk")
    c = join(procs, etcd.endpoint, run_id, "c", nnodes="1:3")
    c.expect("ready")
    for n in (a, b):
        n.signal(signal.SIGKILL)
    (r,) = start_round([c], timeout=30)
    assert r["number"] == 2 and r["members"] == ["c"]


@pytest.mark.parametrize("value", [b"\x80junk", b'{"state": 3, "reason": []}'])
def test_a_value_at_the_closed_key_that_no_agent_wrote_closes_nothing(
    etcd: EtcdServer, run_id: str, procs: list[Proc], client: EtcdClient, value: bytes
) -> None:
    """Before the job: the first node removes it and joins (it exited with
    MalformedRecordError). Mid-job: named, removed, and the next round forms (every
    agent exited, and no round could have been written over it)."""
    key = f"/elastic-run/{run_id}/{records.CLOSED}"
    client.put(key, value)
    a, b = join_in_order(procs, etcd.endpoint, run_id, "ab", nnodes="1:3")
    assert [r["number"] for r in start_round([a, b])] == [1, 1]
    client.put(key, value)
    a.wait_output(key, stream="err")  # named
    wait_until(lambda: client.get(key) is None, 10, "the leader to remove it")
    c = join(procs, etcd.endpoint, run_id, "c", nnodes="1:3")
    rounds = start_round([a, b, c])
    assert [r["members"] for r in rounds] == [["a", "b", "c"]] * 3
    assert "Traceback" not in "\n".join(a.err + b.err + c.err)


def test_malformed_node_record_is_ignored_by_name(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    e, _ = build_options(etcd.endpoint, run_id, 1, 1)
    client = EtcdClient(e)
    try:
        client.put(f"/elastic-run/{run_id}/nodes/evil", b"cos\nsystem\n(S'touch /tmp/x'\ntR.")
        client.put(f"/elastic-run/{run_id}/something-else", b"not ours")
        a = join(procs, etcd.endpoint, run_id, "a", nnodes="1")
        r = start_round([a])[0]
        assert r["members"] == ["a"]
        a.wait_output(f"/elastic-run/{run_id}/nodes/evil", stream="err")
    finally:
        client.close()


@pytest.mark.parametrize(
    "value",
    [b"\x80junk", b'{"id": 7}', b'{"id": "a", "rev": 1, "addr": "10.9.9.9", "probe": 1}'],
    ids=["not-json", "wrong-types", "on-no-lease"],
)
def test_a_value_at_the_lead_key_that_is_no_leaders_is_claimed_over(
    etcd: EtcdServer, run_id: str, procs: list[Proc], value: bytes
) -> None:
    """Before the job and over the live leader's record mid-job: named once, and the
    next loss is noticed and re-formed around as without it (a claim only created an
    absent key, so the job hung until join_timeout)."""
    e, _ = build_options(etcd.endpoint, run_id, 1, 1)
    client = EtcdClient(e)
    key = f"/elastic-run/{run_id}/{records.LEADER}"
    try:
        client.put(key, value)
        a, b, c = join_in_order(procs, etcd.endpoint, run_id, "abc", nnodes="2:3")
        assert start_round([a, b, c])[0]["members"] == ["a", "b", "c"]
        client.put(key, value)
        time.sleep(0.5)  # the members see it (no event to wait on: nothing happens)
        killed = time.monotonic()
        c.signal(signal.SIGKILL)
        a.expect("change", end="LOST", timeout=TTL + 3)
        assert time.monotonic() - killed <= TTL + 1.5
        assert [r["members"] for r in start_round([a, b])] == [["a", "b"], ["a", "b"]]
        a.wait_output(key, stream="err")  # named in the log
        assert "Traceback" not in "\n".join(a.err + b.err)
    finally:
        client.close()


def test_etcd_restart_mid_job_is_survived(
    fresh_etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    a, b = join_in_order(procs, fresh_etcd.endpoint, run_id, "ab", nnodes="1:2")
    start_round([a, b])
    fresh_etcd.stop(signal.SIGKILL)
    time.sleep(TTL + 1)  # away longer than the lease TTL: nothing may be declared lost
    fresh_etcd.start()
    time.sleep(TTL + 1)
    for n in (a, b):
        assert all(ev["event"] != "change" for ev in list(n.events.queue)), n.transcript()
    # and the job can still re-form afterwards
    b.send("leave")
    a.expect("change", end="LEFT", timeout=5)
    a.send("next")
    assert a.expect("round")["members"] == ["a"]


def test_duplicate_node_id_is_refused(etcd: EtcdServer, run_id: str, procs: list[Proc]) -> None:
    """A live holder of the id (its probe port answers) is refused at once; a dead one's
    (a restarted node: its probe port refuses) is taken over at once, not after its
    lease's TTL (30 s here)."""
    a = join(procs, etcd.endpoint, run_id, "same", conf="lease_ttl=30")
    a.expect("ready")
    dup = join(procs, etcd.endpoint, run_id, "same", conf="lease_ttl=30")
    err = dup.expect("error", timeout=5)
    assert "already taken" in err["message"]
    a.signal(signal.SIGKILL)
    a.p.wait(10)
    again = join(procs, etcd.endpoint, run_id, "same", conf="lease_ttl=30")
    again.expect("ready", timeout=10)


def test_unreachable_etcd_is_a_clear_error_in_bounded_time(run_id: str, procs: list[Proc]) -> None:
    from rendezvous.net import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    a = join(procs, endpoint, run_id, "a", conf="connect_timeout=2")
    err = a.expect("error", timeout=10)
    assert time.monotonic() - started < 8
    assert err["kind"] == "EtcdUnavailableError" and endpoint in err["message"]


def test_a_killed_member_is_revoked_by_probe_before_its_ttl(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    # a long TTL: only the probe can explain a fast re-form
    a, b, c = join_in_order(procs, etcd.endpoint, run_id, "abc", nnodes="1:3", conf="lease_ttl=30")
    start_round([a, b, c])
    c.signal(signal.SIGKILL)
    killed = time.monotonic()
    a.send("next")  # as if their workers had failed on the dead peer
    b.send("next")
    r = a.expect("round", timeout=10)
    assert time.monotonic() - killed < 5
    assert r["members"] == ["a", "b"] and r["lost"] == ["c"] and r["restarts"] == 0


def test_a_leader_killed_while_the_next_round_forms_is_found_by_its_successor(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    """b and c wait for a, the leader, to form round 2, and a dies: its successor b finds
    it gone through its probe port at once, where it used to wait for a's lease TTL. Its
    record says its workers re-form in place once it leads (a newcomer reads the leader's
    record alone), not before."""
    a, b, c = join_in_order(procs, etcd.endpoint, run_id, "abc", nnodes="1:3", conf="lease_ttl=30")
    start_round([a, b, c])
    b.send("in_place")
    b.expect("in_place")
    e, _ = build_options(etcd.endpoint, run_id, 1, 3)
    client = EtcdClient(e)

    def says_in_place() -> bool:
        kv = client.get(f"/elastic-run/{run_id}/{records.NODES}b")
        assert kv is not None
        return records.NodeRecord.decode(kv.key, kv.value).in_place

    assert not says_in_place()  # a follower's is read by no one
    b.send("next")  # a change: b and c wait for a to write round 2
    c.send("next")
    time.sleep(0.3)  # both wait on a now
    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    r = b.expect("round", timeout=10)
    assert time.monotonic() - killed < 4, "found by the probe, not after a wait of 5 s"
    assert r["members"] == ["b", "c"] and r["lost"] == ["a"] and r["restarts"] == 0
    assert says_in_place()
    client.close()


def test_a_round_never_leaves_out_a_node_that_registered_before_it_was_written(
    etcd: EtcdServer, run_id: str
) -> None:
    """The leader's view lags behind b's registration (a watch under load): the round it
    planned without b is refused in etcd itself, and the next plan, from a view that has
    caught up, takes b in (b used to wait a whole round more)."""
    a, b = unstarted(etcd.endpoint, run_id, "ab", RdzvConf(last_call_timeout=0.1), (1, 2))
    try:
        a.start()
        a.mirror.set_full(True)  # as the leader's
        assert a.mirror.complete
        stale = a.mirror.view()
        b.start()
        wait_until(lambda: "b" in a.mirror.view().nodes, 10, "a's view to show b")
        for view, written in ((stale, False), (a.mirror.view(), True)):
            p = plan(view, 1, 2, 0.0, 0, time.monotonic())
            assert p.form, p.reason
            assert a._write_round(view, p) is written
        wait_until(lambda: a.mirror.view().round, 10, "a's view to show the round")
        assert [m.id for m in a.mirror.view().round.members] == ["a", "b"]
    finally:
        stop([a, b])


def seen_by(p: Proc, step: int) -> None:
    """``p``'s watch brings it the job's progress at ``step`` (within 5 s)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        p.send("progress")
        if p.expect("progress")["step"] == step:
            return
        time.sleep(0.05)
    raise AssertionError(f"{p.name} never saw step {step}")


def test_the_jobs_progress_is_recorded_by_rank_0_and_outlives_it(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    """Only the round's rank 0 records the job's progress; every node sees it through its
    watch; it has no lease, so a round that forms after rank 0 died still knows it (and
    its rank 0, in a round it has not written in, records its own step at once)."""
    a, b = join_in_order(procs, etcd.endpoint, run_id, "ab", nnodes="1:2")
    start_round([a, b])
    b.send("progress 5")
    assert b.expect("progress")["step"] == -1  # rank 1 writes nothing

    a.send("progress 7")
    a.expect("progress")
    seen_by(b, 7)
    a.signal(signal.SIGKILL)
    b.send("next")
    assert b.expect("round", timeout=15)["lost"] == ["a"]
    b.send("progress")
    assert b.expect("progress") == {"event": "progress", "step": 7, "node": "a"}
    b.send("progress 3")  # resumed from an older step: its round's first write
    b.expect("progress")
    seen_by(b, 3)


def test_a_node_whose_group_broke_proves_its_dead_neighbour_gone_but_not_its_successor(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    """a leads; c is SIGKILLed. b, which does not lead, its workers' group broken,
    probes its neighbours: c refuses its probe port, so b revokes c's lease at once
    (the leader, whose own workers may be held where they report nothing, would hear of
    it at the lease's end). A c started again under the same name, a new incarnation, is
    not touched by a probe of the old one's port."""
    a, b, c = join_in_order(procs, etcd.endpoint, run_id, "abc", nnodes="1:3")
    start_round([a, b, c])
    c.signal(signal.SIGKILL)
    c.wait()
    b.send("broken")
    # not at the lease's end: revoked (the change may be printed before "probed")
    _, change = b.expect_each(TTL, ("probed", {}), ("change", {"end": "LOST"}))
    b.wait_output("c refuses its probe port: its agent is gone; revoking its lease", 5)
    assert change["nodes"] == ["c"]
    again = join(procs, etcd.endpoint, run_id, "c", nnodes="1:3")
    again.expect("ready")
    b.err.clear()
    b.send("broken")
    b.expect("probed")
    client = EtcdClient(build_options(etcd.endpoint, run_id, 1, 3)[0])
    try:
        assert client.get(f"/elastic-run/{run_id}/{records.NODES}c") is not None
    finally:
        client.close()
    assert not any("revoking" in line for line in b.err), b.err


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_a_newcomer_waits_for_the_lost_member_that_alone_holds_the_jobs_newest_state(
    etcd: EtcdServer, run_id: str, procs: list[Proc], fault: str
) -> None:
    """a trains alone and commits step 40; b comes to join as a is lost. Frozen past its
    lease's end, a may come back: a round of b alone would lose a's steps, so b waits for
    a, which carries on in its round as it wakes, and the two form round 2 with a as rank
    0. Killed, a refuses its probe port: b forms a round of its own once a is lost."""
    (a,) = join_in_order(procs, etcd.endpoint, run_id, "a", nnodes="1:2")
    start_round([a])
    a.send("progress 40")
    a.expect("progress")
    seen_by(a, 40)
    client = EtcdClient(build_options(etcd.endpoint, run_id, 1, 2)[0])
    try:
        a.signal(signal.SIGSTOP if fault == "frozen" else signal.SIGKILL)
        lost = time.monotonic()
        b = join(procs, etcd.endpoint, run_id, "b", nnodes="1:2")
        b.expect("ready")
        b.send("next")
        if fault == "killed":
            r = b.expect("round", timeout=3 * TTL + 3)
            assert r["members"] == ["b"] and r["lost"] == ["a"]
            # lost at its lease's end (a newcomer probes the leader only now and then),
            # then proven dead at once: a hold would make it three TTLs at least
            assert time.monotonic() - lost < 2 * TTL + 1
            return
        key = f"/elastic-run/{run_id}/{records.NODES}a"
        wait_until(lambda: client.get(key) is None, TTL + 3, "a's lease to run out")
        time.sleep(1.0)  # the fault: a stays frozen past its lease's end
        a.signal(signal.SIGCONT)
        a.expect("change", end="LAPSED", timeout=TTL + 3)

        def resumed() -> bool:  # False until its view is one read since it woke
            a.send("resume")
            return bool(a.expect("resumed")["ok"])

        wait_until(resumed, 10, "a to carry on in its round")
        # a's watch may say so before its resume answers (expect passes over it): read
        # everything a printed
        a.wait_output('"detail": "b waiting to join"')
        a.send("next")
        rounds = [n.expect("round", timeout=TTL + 5) for n in (a, b)]
        assert [r["members"] for r in rounds] == [["a", "b"]] * 2
        assert rounds[0]["number"] == 2 and rounds[0]["rank"] == 0 and rounds[0]["lost"] == []
        seen_by(b, 40)
    finally:
        client.close()


def test_a_member_that_joined_a_round_that_trained_nothing_waits_for_the_frozen_holder(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    """a trains alone to step 40; b joins, and round 2 of a and b forms, but a freezes
    before it trains a step: b received none of the state (chaos seed 112: a round of b
    alone started over from step 0). b's next round waits for a as a newcomer's would,
    and a, woken, carries on into it."""
    (a,) = join_in_order(procs, etcd.endpoint, run_id, "a", nnodes="1:2")
    start_round([a])
    a.send("progress 40")
    a.expect("progress")
    b = join(procs, etcd.endpoint, run_id, "b", nnodes="1:2")
    b.expect("ready")
    b.send("next")
    a.expect("change", end="WAITING", timeout=10)
    a.send("next")
    assert [n.expect("round", timeout=10)["members"] for n in (a, b)] == [["a", "b"]] * 2
    a.signal(signal.SIGSTOP)
    b.expect("change", end="LOST", timeout=TTL + 3)
    b.send("next")
    time.sleep(1.0)  # the fault: a stays frozen past its lease's end
    a.signal(signal.SIGCONT)
    # without the hold, b formed round 3 alone at once: a could not carry on in its round
    a.expect("change", end="LAPSED", timeout=TTL + 3)

    def resumed() -> bool:
        a.send("resume")
        return bool(a.expect("resumed")["ok"])

    wait_until(resumed, 10, "a to carry on in its round")
    a.send("next")
    rounds = [n.expect("round", timeout=2 * TTL + 5) for n in (a, b)]
    assert [r["members"] for r in rounds] == [["a", "b"]] * 2 and rounds[0]["lost"] == []


def test_a_frozen_member_is_not_mistaken_for_dead_and_wakes_up_without_a_say(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    """A frozen rank 0 is lost only at its lease's end (it still holds its probe port);
    woken up in a round that is over, it records no progress over the new round's, but
    raises the record to its workers' step, which may be in no other (chaos seed 108:
    etcd was frozen while they trained): never lowering it."""
    a, b = join_in_order(procs, etcd.endpoint, run_id, "ab", nnodes="1:2")
    start_round([a, b])
    a.signal(signal.SIGSTOP)
    frozen = time.monotonic()
    b.send("next")
    r = b.expect("round", timeout=TTL + 5)
    # its lease ends TTL after its last keep-alive, which came up to TTL/3 before the freeze
    # (a probe would have found it at once)
    assert time.monotonic() - frozen >= TTL * 2 / 3 - 0.3, "a stopped process holds its port"
    assert r["lost"] == ["a"] and r["rank"] == 0
    b.send("progress 3")
    b.expect("progress")
    seen_by(b, 3)
    a.signal(signal.SIGCONT)
    a.send("progress 9")  # still rank 0 of round 1 as far as it knows
    a.expect("progress")
    first = recorded(etcd, run_id)
    assert first.step == 3
    a.send("raise 9")
    a.expect("raised")
    seen_by(b, 9)
    b.send("progress")
    assert b.expect("progress")["node"] == "a"
    a.send("raise 5")
    a.expect("raised")
    raised = recorded(etcd, run_id)
    assert raised.step == 9 and raised.job == first.job  # the run's token is kept


def recorded(etcd: EtcdServer, run_id: str) -> records.ProgressRecord:
    """The job's progress record, read from etcd."""
    client = EtcdClient(build_options(etcd.endpoint, run_id, 1, 2)[0])
    try:
        kv = client.get(f"/elastic-run/{run_id}/{records.PROGRESS}")
    finally:
        client.close()
    assert kv is not None
    return records.ProgressRecord.decode(kv.key, kv.value)


def test_a_newcomer_on_its_way_counts_as_another_node_until_it_registers_or_dies(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    """What a node told to leave reads to know whether anyone can take the newest state
    (``Rendezvous.others``): registered nodes and newcomers whose workers start before
    they register (``arriving/``, withdrawn as they register, gone with their lease),
    never a value there that no agent wrote."""
    etcd_opts, opts = build_options(etcd.endpoint, run_id, 1, 4, RdzvConf())
    with contextlib.closing(EtcdClient(etcd_opts)) as client:
        _on_its_way(client, opts.job_prefix, etcd, run_id, procs)


def _on_its_way(
    client: EtcdClient, prefix: str, etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    a = join(procs, etcd.endpoint, run_id, "a")
    a.expect("ready")

    def others() -> int:
        a.send("others")
        return int(a.expect("others")["n"])

    def arriving() -> list[str]:
        kvs = client.get_prefix(prefix + records.ARRIVING)[1]
        return [kv.key.rsplit("/", 1)[1] for kv in kvs]

    assert others() == 0
    b = join(procs, etcd.endpoint, run_id, "b", arrive=True)
    b.expect("arriving")
    assert others() == 1 and arriving() == ["b"]
    b.send("register")
    b.expect("ready")
    assert others() == 1 and arriving() == []  # withdrawn: its record says the rest
    c = join(procs, etcd.endpoint, run_id, "c", arrive=True)
    c.expect("arriving")
    assert others() == 2
    c.signal(signal.SIGKILL)
    wait_until(lambda: others() == 1, TTL + 3, "c's word to go with its lease")
    client.put(prefix + records.ARRIVING + "x", b"junk")  # no agent's: on no lease
    client.put(prefix + records.NODES + "y", b"junk")
    assert others() == 1  # it would never go: a node leaving would wait for it in vain
