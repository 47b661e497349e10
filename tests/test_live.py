"""Live re-formation under real agents: the survivors keep their processes.

Three agents ("nodes", one worker each) train ``scripts/live_train.py`` on a real etcd;
one node is killed, frozen, stopped or added while they train. In each case the
survivors' worker processes train on at the new world size (same pids, no restart),
every sample of every epoch is trained on, no more than the steps in flight are trained
on twice, and the final model equals one computed without any change (the global batch
is fixed, so the data order does not depend on the world size).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psutil
import pytest
import torch
from agents import TTL, full_speed, gone, start_agent, wait_world, worker_pids
from agents import steps as rows
from etcd_servers import EtcdCluster
from faults import NetNode, isolated_node
from harness import ROOT, Proc, echo_server, queued_to_send, wait_until

from elastic.agent.core import COMING_LIVE_S
from elastic.agent.etcd_server import EtcdServer
from elastic.worker.group import CONNECT_TIMEOUT

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "tests" / "scripts" / "live_train.py"
SAMPLES, EPOCHS, GLOBAL = 240, 3, 24


def start(
    procs: list[Proc], etcd: EtcdServer, run_id: str, out: Path, node: str, *args: str
) -> Proc:
    return start_on(procs, etcd.endpoint, run_id, out, node, *args)


def start_on(
    procs: list[Proc],
    endpoint: str,
    run_id: str,
    out: Path,
    node: str,
    *args: str,
    extra: tuple[str, ...] = (),
    nnodes: str = "2:3",
    net: NetNode | None = None,
    inside: bool = False,
) -> Proc:
    """``net``: placed by that network namespace's link, ``inside`` it or on this side."""
    out.mkdir(exist_ok=True)
    env = {"RESULT_DIR": str(out)}
    where = net.agent(inside, env) if net is not None else {"env": env}
    return start_agent(
        procs,
        endpoint,
        run_id,
        node,
        SCRIPT,
        *args,
        nnodes=nnodes,
        extra=("--max-restarts", "2", *extra),
        **where,
    )


def on_net(
    procs: list[Proc],
    endpoint: str,
    run_id: str,
    out: Path,
    net: NetNode,
    nnodes: str,
    *args: str,
) -> Callable[[str, bool], Proc]:
    """``node(name, inside)``: an agent of the job placed by ``net``'s link, inside the
    namespace or on this side (``start_on``)."""

    def node(name: str, inside: bool) -> Proc:
        return start_on(
            procs, endpoint, run_id, out, name, *args, nnodes=nnodes, net=net, inside=inside
        )

    return node


def reference(epochs: int = EPOCHS) -> dict[str, torch.Tensor]:
    """The model after the same steps with no change at all, in this process."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    from live_train import undisturbed

    return undisturbed(SAMPLES, epochs, GLOBAL)


def check_samples(out: Path, changes: int, epochs: int = EPOCHS) -> dict:
    """No sample lost; at most the steps in flight repeated; every step trained. The
    final model's record."""
    history = rows(out)
    for epoch in range(epochs):
        used = [i for r in history if r["epoch"] == epoch for i in r["indices"]]
        assert sorted(set(used)) == list(range(SAMPLES)), f"epoch {epoch} lost samples"
        assert len(used) - SAMPLES <= changes * GLOBAL, f"epoch {epoch}: repeats beyond a step"
    final: dict = torch.load(out / "final.pt")
    assert final["step"] == epochs * SAMPLES // GLOBAL
    return final


def check_run(out: Path, changes: int, epochs: int = EPOCHS) -> None:
    """``check_samples``, and the undisturbed model."""
    final = check_samples(out, changes, epochs)
    for k, v in reference(epochs).items():
        torch.testing.assert_close(final["model"][k], v, rtol=1e-4, atol=1e-5)


def pids_at(out: Path, world: int, after: float = 0.0) -> set[int]:
    """The workers that trained a step at ``world`` (begun after ``after``)."""
    return {r["pid"] for r in rows(out) if r["world"] == world and r["t"] > after}


def came_back_anew(node: Proc) -> None:
    """``node``, cut off, came back as a new incarnation: fenced once its link was back
    ("lease is gone"), or, when its worker failed while it was cut off (gloo: "Network is
    unreachable"), by stepping out (CI saw both)."""
    said = node.transcript()
    assert said.count(f"registered as {node.name} ") == 2, said
    assert "lease is gone" in said or "leaving the job for now" in said, said


def three(procs: list[Proc], etcd: EtcdServer, run_id: str, out: Path, *args: str) -> list[Proc]:
    agents = [start(procs, etcd, run_id, out, n, *args) for n in "abc"]
    wait_world(out, 3, timeout=90)
    return agents


def survivors_kept(out: Path, before: set[int], after_world: int = 2, since: float = 0.0) -> None:
    """The steps at ``after_world`` since the fault were trained by kept workers, one each
    (a first node may have trained alone before the others joined: not a survivor)."""
    after = pids_at(out, after_world, since)
    assert len(after) == after_world and after <= before, (before, after)


@pytest.mark.parametrize("thawed", ["once-re-formed", "after-the-end"])
def test_sigstop_of_a_node(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path, thawed: str
) -> None:
    """c's agent and worker frozen: a and b re-form without it at its lease's TTL, in
    their own processes. Thawed, c finds its lease gone, fences itself (its stale worker
    killed, never training in a newer round) and joins again as a new node; thawed after
    a and b finished the job, it kills its stale worker at once and exits 0 (the job
    succeeded; it learns first that the job is over, or that its lease went), where it
    once waited ``close_timeout`` (30 s) and failed (chaos seed 106)."""
    agents = three(procs, etcd, run_id, tmp_path)
    before = pids_at(tmp_path, 3)
    frozen = agents[2]
    stale = worker_pids(frozen)
    tree = [frozen.pid, *stale]
    stopped = time.time()
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_world(tmp_path, 2, after=stopped, timeout=60)
        if thawed == "after-the-end":
            for a in agents[:2]:
                assert a.wait(120) == 0, a.transcript()
    finally:
        for pid in tree:
            os.kill(pid, signal.SIGCONT)
    if thawed == "after-the-end":
        assert frozen.wait(15) == 0, frozen.transcript()
        said = frozen.transcript()  # what it learns first once thawed: the job is over, or
        assert "formed without this node" in said or "fenced: " in said, said  # its lease went
        assert gone(stale)
    frozen.wait_output("fenced" if thawed == "once-re-formed" else "killing", timeout=15)
    wait_until(lambda: gone(stale), 5, "the fenced node's stale worker to be killed")
    for a in agents:
        assert a.wait(120) == 0, a.transcript()
    # after the freeze a stale worker logs at most the step it was frozen in (its row is
    # written after the thaw), in its old round
    mine = [r for r in rows(tmp_path) if r["pid"] in stale]
    last = max(r["step"] for r in mine if r["t"] <= stopped)
    late = [r for r in mine if r["t"] > stopped + 0.5]
    assert all(r["world"] == 3 and r["step"] <= last + 1 for r in late), late
    survivors_kept(tmp_path, before - set(tree))
    check_run(tmp_path, changes=2)  # the loss, and c's joining again if training was not over


@pytest.mark.slow
def test_a_worker_killed_while_etcd_is_away_steps_its_node_out_once_etcd_answers(
    run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """A fault during another: etcd frozen past the lease TTL, and 1 s into it one of b's
    workers SIGKILLed. b can tell no one until etcd answers; then every lease is gone, b's
    record with it. b steps out; a and c carry on and re-form without it at once, in their
    own processes, and b comes back with workers started ahead. Before, the leader took b
    for a member the outage may have dropped and waited for it, b read that as its being
    awaited and came straight back in, and a and c waited for its new worker's start."""
    with EtcdServer(name="frozen") as server:
        # training outlasts the outage, and b's new worker's start (slow without b)
        slow = ("--step-time", "0.3", "--slow-below-world", "3", "--epochs", "4")
        agents = [
            start_on(procs, server.endpoint, run_id, tmp_path, n, *slow, nnodes="1:3")
            for n in "abc"
        ]
        wait_world(tmp_path, 3, timeout=90)
        kept = set(worker_pids(agents[0]) + worker_pids(agents[2]))
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(1)
            os.kill(worker_pids(agents[1])[0], signal.SIGKILL)
            time.sleep(2 * TTL)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
            thawed = time.time()
        two = wait_world(tmp_path, 2, after=thawed, timeout=60)
        print(f"a and c train {two - thawed:.2f}s after etcd answered again")
        said = "\n".join(a.transcript() for a in agents)
        assert two - thawed < TTL, said
        survivors_kept(tmp_path, kept, since=thawed)
        wait_world(tmp_path, 3, after=two, timeout=60)
        full_speed(tmp_path)
        for a in agents:
            assert a.wait(120) == 0, a.transcript()
    b = agents[1].transcript()
    assert "leaving the job for now" in b and "starting workers before joining" in b, b
    check_run(tmp_path, changes=2, epochs=4)


@pytest.mark.parametrize(
    ("outage", "mode", "kill"), [("frozen", "live", True), ("quorum-lost", "respawn", False)]
)
def test_etcd_away_past_the_lease_ttl_restarts_no_one(
    run_id: str, procs: list[Proc], tmp_path: Path, outage: str, mode: str, kill: bool
) -> None:
    """etcd SIGSTOPped, or two of a three-member cluster (quorum lost: the leader left
    alone revokes the leases once quorum is back), for more than twice the lease TTL:
    training goes on meanwhile; when etcd answers again the nodes' leases are gone (or
    not, if a new leader renewed them), but no round formed without them, so each node
    carries on as it was, on a new lease: no round ends, the same workers train on, in
    either restart mode (``respawn`` stands for every script without ``State.run``).
    ``kill``: a third node SIGKILLed during the outage as well: it does not come back,
    and the others re-form without it, in their own processes, as soon as they are back
    (its probe port proved it dead: no grace of a TTL after the thaw for it)."""
    with contextlib.ExitStack() as stack:
        if outage == "frozen":
            server = stack.enter_context(EtcdServer(name="frozen"))
            endpoint, members = server.endpoint, [server]
        else:
            cluster = stack.enter_context(EtcdCluster(3))
            endpoint, members = cluster.endpoints, cluster.members[1:]
        slow = ("--step-time", "0.3")  # training outlasts the outage
        names = "abc" if kill else "ab"
        agents = [
            start_on(procs, endpoint, run_id, tmp_path, n, *slow, extra=("--restart-mode", mode))
            for n in names
        ]
        wait_world(tmp_path, len(names), timeout=90)
        before = pids_at(tmp_path, len(names))
        pids = [m.proc.pid for m in members if m.proc is not None]
        frozen = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(TTL)  # the fault itself: an outage longer than the TTL...
            during = [r for r in rows(tmp_path) if frozen + 0.5 < r["t"]]
            if kill:  # ... with a node lost in it
                before -= set(worker_pids(agents[2]))
                agents[2].kill_tree()
            time.sleep(TTL + 1)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            thawed = time.time()
        assert during, "training stopped while etcd was away"
        if kill:
            back = wait_world(tmp_path, 2, after=thawed, timeout=60) - thawed
            print(f"training at world size 2 {back:.2f}s after etcd answered again")
            said = "\n".join(a.transcript() for a in agents[:2])
            assert back < TTL, f"the dead node was given the outage's grace\n{said}"
        for a in agents[:2]:
            assert a.wait(120) == 0, a.transcript()
            said = a.transcript()
            assert "stopping workers" not in said and ("re-form" in said) is kill, said
            if outage == "frozen":  # its leases are gone for sure
                assert "no round has formed without it: it carries on" in said, said
    assert pids_at(tmp_path, 2) == before
    assert {r["world"] for r in rows(tmp_path)} == ({3, 2} if kill else {2})
    check_run(tmp_path, changes=int(kill))
    if not kill:
        times = [r["t"] for r in rows(tmp_path) if r["rank"] == 0 and r["t"] > thawed - 1]
        pause = max(b - a for a, b in itertools.pairwise(times))
        print(f"longest pause after etcd answered again: {pause:.2f}s")


def test_sigterm_leave_then_two_joins_at_once(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """c leaves (its workers save and exit 75), then d and e join at the same moment
    while a and b train: a and b re-form live both times; d's and e's fresh workers get
    the state from them. Their workers start before they join (agent/lobby.py), each
    with the ranks it expects (rank 2 of 3: neither knows of the other); they read none
    before init_process_group (elastic/worker/placed.py), so the round that places them
    otherwise re-forms them in place too, and a and b train on meanwhile."""
    # 24 over 2, 3 or 4 ranks; slow until both newcomers train, however far apart their
    # workers get ready on a busy machine (one at world 3 while the other still starts)
    args = ("--slow-below-world", "4", "--micro-batch", "2", "--epochs", "6")
    epochs = 6
    agents = [
        start_on(procs, etcd.endpoint, run_id, tmp_path, n, *args, nnodes="2:4") for n in "abc"
    ]
    wait_world(tmp_path, 3, timeout=90)
    before = pids_at(tmp_path, 3)
    leaving = set(worker_pids(agents[2]))
    agents[2].signal(signal.SIGTERM)
    assert agents[2].wait(60) == 143, agents[2].transcript()
    wait_world(tmp_path, 2, after=time.time() - 1, timeout=60)
    survivors_kept(tmp_path, before - leaving)
    new = [start_on(procs, etcd.endpoint, run_id, tmp_path, n, *args, nnodes="2:4") for n in "de"]
    for n in new:
        n.wait_output("joining the job with them", timeout=60)  # its worker waits, ready
    ahead = {p for n in new for p in worker_pids(n)}
    started = min(psutil.Process(p).create_time() for p in ahead)
    wait_world(tmp_path, 4, after=time.time() - 1, timeout=90)
    assert ahead <= pids_at(tmp_path, 4), "the workers started ahead train at world size 4"
    meanwhile = [r for r in rows(tmp_path) if r["world"] == 2 and r["t"] > started + 1.0]
    assert meanwhile, "a and b trained on while the newcomers' workers started"
    for n in new:
        said = n.transcript()
        assert said.index("starting workers before joining") < said.index("registered as"), said
        assert "new workers follow" not in said, said
    full_speed(tmp_path)
    for a in (*agents[:2], *new):
        assert a.wait(120) == 0, a.transcript()
    said = "\n".join(a.transcript() for a in agents[:2])
    assert pids_at(tmp_path, 2) <= pids_at(tmp_path, 4), f"a and b kept their processes\n{said}"
    check_run(tmp_path, changes=3, epochs=epochs)


def test_a_standby_takes_a_lost_members_place_with_its_workers_started_ahead(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """--nnodes 1:2 and a third node c, come as the job starts: c registers without
    workers (the job's workers are not in State.run yet: their model builds), then, once
    they are, steps back and waits as a standby, its worker started and waiting in the
    lobby for the place of a member lost. b is SIGKILLed: a keeps its process, and c's
    waiting worker, not a new one, takes b's place (before, c's worker started only once
    c was admitted: a waited 2.5 s for it, benchmarks/faults.py)."""
    epochs, args = 10, ("--epochs", "10", "--step-time", "0.2", "--slow-build")
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "building").touch()  # the workers wait before State.run while it is there
    # forked: a fork server imports elastic for every worker, so a's and b's new workers
    # say they head for State.run only at the script's first use of elastic's API, after
    # its build here (spawned, they would say so as they imported it, and c would start
    # its worker ahead at once: test_a_join_as_the_first_workers...)
    fork = ("--start-method", "forkserver")
    a, b = (
        start_on(procs, etcd.endpoint, run_id, tmp_path, n, *args, nnodes="1:2", extra=fork)
        for n in "ab"
    )
    b.wait_output("node b: group rank", timeout=60)  # round 1: its workers start
    c = start_on(procs, etcd.endpoint, run_id, tmp_path, "c", *args, nnodes="1:2")
    c.wait_output("registered as c", timeout=60)
    assert "starting workers before joining" not in c.transcript(), c.transcript()
    (tmp_path / "building").unlink()
    wait_world(tmp_path, 2, timeout=90)
    kept = set(worker_pids(a))
    c.wait_output("joining the job with them", timeout=60)  # its worker waits, ready
    ahead = set(worker_pids(c))
    said = c.transcript()
    assert "stepping back to start workers ahead" in said and "waits as a standby" in said, said
    killed = time.time()
    b.kill_tree()
    wait_until(lambda: ahead <= pids_at(tmp_path, 2), 60, "c's waiting worker to train")
    full_speed(tmp_path)
    for agent in (a, c):
        assert agent.wait(120) == 0, agent.transcript()
    after = {r["pid"] for r in rows(tmp_path) if r["t"] > killed + 0.5}
    assert after == kept | ahead, (after, kept, ahead)
    assert "new workers follow" not in c.transcript(), c.transcript()
    check_run(tmp_path, changes=1, epochs=epochs)


def test_a_join_as_the_first_workers_build_waits_for_them_to_get_into_state_run(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """a and b start the job; their workers build their model before State.run (held by
    a file here) when c comes. The job's workers were never live, but they imported
    elastic: the leader says that they re-form in place, so c starts its worker ahead,
    and a and b wait for theirs to get into State.run rather than replace them, say why,
    and pause in place for c there: the first workers train the whole job (before, c
    registered without workers, the join stopped a's and b's as they started, and new
    ones imported torch and built the model again: a staggered start of 3 nodes trained
    its first step 27 s after round 1 on this VM; chaos seed 58 had rounds of new
    workers, each replaced by the next change). a's and b's two ranks get into State.run
    1.5 s apart: the wait goes on while the first waits there for the second (before,
    the first one's arrival ended it, and the join replaced both)."""
    lag = ("--slow-build", "--rank-lag", "1.5", "--micro-batch", "2")  # 24 over 4 or 6 ranks
    epochs, args = 4, ("--epochs", "4", "--step-time", "0.1", *lag)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "building").touch()  # the workers wait before State.run while it is there
    two = ("--nproc-per-node", "2")
    a, b = (
        start_on(procs, etcd.endpoint, run_id, tmp_path, n, *args, nnodes="1:3", extra=two)
        for n in "ab"
    )
    building = lambda: len(list(tmp_path.glob("building.*"))) == 4  # noqa: E731
    wait_until(building, 90, "a's and b's workers to build their model")  # elastic imported
    first = set(worker_pids(a)) | set(worker_pids(b))
    c = start_on(procs, etcd.endpoint, run_id, tmp_path, "c", *args, nnodes="1:3", extra=two)
    for n in (a, b):
        n.wait_output("on their way into State.run", timeout=60)  # the join waits
    (tmp_path / "building").unlink()
    wait_world(tmp_path, 6, timeout=90)
    full_speed(tmp_path)
    for n in (a, b, c):
        assert n.wait(120) == 0, n.transcript()
    said = a.transcript() + b.transcript()
    # the leader said that the job's workers re-form in place: c started its own ahead
    assert "starting workers before joining" in c.transcript(), c.transcript()
    assert first <= pids_at(tmp_path, 6) and pids_at(tmp_path, 4) <= first, said
    assert said.count("workers re-form live (pids") == 2 and "stopping workers" not in said, said
    check_run(tmp_path, changes=1, epochs=epochs)


def test_the_only_two_members_hung_at_once_keep_the_jobs_newest_state(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """--nnodes 1:2: a and b train, c waits as a standby. a's and b's workers freeze at
    once (SIGSTOP, their agents alive): each node finds its own hung, reports it and
    steps out for the other to go on. The round that forms next waits for one of them to
    come back with its snapshots (their tombstones say they do) rather than let c begin
    again alone (its leader's record says whom it waits for: they come back at once), so
    the job goes on from their newest step: every sample once, at most the steps in
    flight trained again, the model as undisturbed (chaos seed 24: a fresh node formed a
    round alone from step 0, 284 steps trained again). Each hang is found, and reported,
    by its own node's agent (where one is found first, the other node's worker fails to
    let go of its group: a hang of its own all the same, and that node, alone holding
    the state, restarts in the round instead, from its last snapshot: taken every step,
    so that the bound is the steps in flight early in the run too; CI saw the interval of
    the cadence's first choice, 3 steps, trained again)."""
    epochs, args = 10, ("--epochs", "10", "--step-time", "0.2")
    kw: dict = {"nnodes": "1:2", "extra": ("--snapshot-every", "1")}
    a, b = (start_on(procs, etcd.endpoint, run_id, tmp_path, n, *args, **kw) for n in "ab")
    wait_world(tmp_path, 2, timeout=90)
    c = start_on(procs, etcd.endpoint, run_id, tmp_path, "c", *args, **kw)
    c.wait_output("joining the job with them", timeout=60)  # a standby, its worker waiting
    frozen = [*worker_pids(a), *worker_pids(b)]
    stopped = time.time()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    for agent in (a, b):
        agent.wait_output("hung:", timeout=30)
    wait_world(tmp_path, 2, after=stopped + 1, timeout=90)
    full_speed(tmp_path)
    for agent in (a, b, c):
        assert agent.wait(180) == 0, agent.transcript()
    assert not {r["pid"] for r in rows(tmp_path) if r["t"] > stopped + 1} & set(frozen)
    for agent in (a, b):  # found by its own agent: as its failure, or as the hold's
        said = agent.transcript()
        assert "hung: no progress" in said and "workers failed: rank" in said, said
    assert "workers failed" not in c.transcript(), c.transcript()
    assert "training starts over" not in a.transcript() + b.transcript() + c.transcript()
    check_run(tmp_path, changes=2, epochs=epochs)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["builds", "b-killed"])
def test_a_join_while_a_newcomers_workers_go_into_state_run_waits_for_them(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path, then: str
) -> None:
    """d joins a and b; its worker, started ahead, is placed and forms the group, then
    builds its model before State.run (held by a file here). e joins meanwhile: d's agent
    waits for its worker to reach State.run instead of stopping it (a new worker would cost
    the job a worker start), and all four re-form in place. ``b-killed``: b is SIGKILLed
    during that wait; a loss waits for no one: d's agent acts at once, its worker leaves
    the broken group as soon as it reaches State.run, and a, d and e re-form with it in
    place (a new one would cost everyone a worker start); nothing is lost."""
    args = ("--slow-below-world", "4", "--micro-batch", "2", "--epochs", "6")
    epochs = 6
    a, b = (start_on(procs, etcd.endpoint, run_id, tmp_path, n, *args, nnodes="2:4") for n in "ab")
    wait_world(tmp_path, 2, timeout=90)
    (tmp_path / "building").touch()
    d = start_on(procs, etcd.endpoint, run_id, tmp_path, "d", *args, "--slow-build", nnodes="2:4")
    d.wait_output("workers re-form live", timeout=60)  # placed in round 2, building
    kept = set(worker_pids(d))
    e = start_on(procs, etcd.endpoint, run_id, tmp_path, "e", *args, nnodes="2:4")
    d.wait_output("on their way into State.run", timeout=60)
    if then == "b-killed":
        kept |= set(worker_pids(a))
        killed = time.monotonic()
        b.kill_tree()
        d.wait_output("lost b", timeout=TTL + 2)
        assert time.monotonic() - killed < COMING_LIVE_S, "the loss waited for d's worker"
    (tmp_path / "building").unlink()
    world = 4 if then == "builds" else 3
    wait_world(tmp_path, world, after=time.time() - 1, timeout=60)
    assert kept <= pids_at(tmp_path, world), d.transcript()
    full_speed(tmp_path)
    for n in (a, d, e) if then == "b-killed" else (a, b, d, e):
        assert n.wait(120) == 0, n.transcript()
    said = d.transcript()
    assert "new workers follow" not in said and "stopping workers" not in said, said
    if then == "builds":
        assert "resizing" not in said, said
        assert pids_at(tmp_path, 2) <= pids_at(tmp_path, 4), "a and b kept their processes"
    check_run(tmp_path, changes=2 if then == "builds" else 3, epochs=epochs)


def test_a_kill_the_leaders_kill_during_the_re_formation_and_a_join(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Three changes in quick succession: c is SIGKILLed; as b's workers re-form for it, a
    (the leader, rank 0, the round's store host) is SIGKILLed; d starts at once. b takes
    each change as the next one, in its own process, and ends with d; the restarts
    charged are none (a loss is no failure)."""
    # training outlasts d's start, however slow (10 s on a busy host: 25 slow steps)
    slow = ("--slow-below-world", "2", "--epochs", "6")
    epochs = 6
    a = start_on(procs, etcd.endpoint, run_id, tmp_path, "a", *slow, nnodes="1:3")
    a.wait_output("registered as a", timeout=30)  # a claims the lead as it registers
    c = start_on(procs, etcd.endpoint, run_id, tmp_path, "c", *slow, nnodes="1:3")
    c.wait_output("registered as c", timeout=30)  # c is rank 1, b rank 2: b's store helper
    b = start_on(procs, etcd.endpoint, run_id, tmp_path, "b", *slow, nnodes="1:3")  # starts late
    wait_world(tmp_path, 3, timeout=90)
    kept = worker_pids(b)
    killed = time.time()
    c.kill_tree()
    b.wait_output("workers re-form live", timeout=30)
    a.kill_tree()
    second = time.time()
    d = start_on(procs, etcd.endpoint, run_id, tmp_path, "d", *slow, nnodes="1:3")
    back = wait_world(tmp_path, 2, after=second, timeout=90)  # b with d
    alone = [r["t"] for r in rows(tmp_path) if r["pid"] in kept and r["world"] == 1]
    again = min([t for t in alone if t > second], default=back)  # a's loss, d's join: 1 round?
    print(f"b trains {again - killed:.2f}s after the first kill ({second - killed:.2f}s apart)")
    # a's loss found by its probe port, not its lease's end; b's worker forming round 2's
    # group just then waits out gloo's connect to a, as documented (about 5x its timeout)
    assert "a refuses its probe port" in b.transcript(), b.transcript()
    assert again - second < TTL + 5 * CONNECT_TIMEOUT.total_seconds(), b.transcript()
    # b is rank 0 since a's loss, its store helper started 0.2 s before (it was rank 2):
    # the round after a's loss does not wait for the helper's import, its worker hosts the
    # store; unless that round came late, the helper ready by then (gloo's connect wait)
    after_a = re.search(r"lost a; ([\d.]+)s after lost a", b.transcript())
    if after_a is not None and float(after_a[1]) < 2:
        assert "rank 0's worker hosts the store" in b.transcript(), b.transcript()
    assert worker_pids(b) == kept
    full_speed(tmp_path)
    for n in (b, d):
        assert n.wait(120) == 0, n.transcript()
        assert "no live re-formation" not in n.transcript()
        assert "after a worker failure" not in n.transcript()
    check_run(tmp_path, changes=3, epochs=epochs)


def test_a_newcomer_cut_off_as_the_round_with_it_forms(
    run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """c, in a network namespace, joins a and b; as the round of three forms, its cable is
    pulled (what a and b send it is dropped unanswered: no reset, no refused probe
    port, so nothing proves it dead). a and b leave the dead round within the lease TTL
    and train on in their own processes; c, back, finds its lease gone, joins again, and
    said while away that it may be cut off (it said "is etcd running?")."""
    epochs = 20
    with isolated_node() as net, EtcdServer(host=net.host_ip) as etcd:
        node = on_net(procs, etcd.endpoint, run_id, tmp_path, net, "2:3", "--epochs", str(epochs))

        a, b = node("a", False), node("b", False)
        wait_world(tmp_path, 2, timeout=90)
        kept = set(worker_pids(a)) | set(worker_pids(b))
        c = node("c", True)
        b.wait_output("joined c", timeout=60)
        cut = time.time()
        net.cut()
        a.wait_output("lost c", timeout=TTL + 3)
        back = wait_world(tmp_path, 2, after=time.time(), timeout=30)
        print(f"a and b train {back - cut:.2f}s after the cut")
        assert back - cut < TTL + 3, a.transcript()
        assert "c refuses its probe port" not in a.transcript()  # cut off is not dead
        restored = time.time()
        net.restore()
        wait_world(tmp_path, 3, after=restored, timeout=90)
        full_speed(tmp_path)
        for n in (a, b, c):
            assert n.wait(120) == 0, n.transcript()
        came_back_anew(c)
        assert "this host may be cut off" in c.transcript()
    survivors_kept(tmp_path, kept)
    check_run(tmp_path, changes=3, epochs=epochs)


@pytest.mark.slow
def test_the_leader_cut_off_as_the_round_re_forms_for_a_kill(
    run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """A fault during the recovery from another: c (the leader, rank 0, the store host,
    in a network namespace), a and b train; b is SIGKILLed and, 0.1 s later, as a and c
    re-form without it, c's cable is pulled. a, cut off from both, leaves the dead
    re-formation within the lease TTL, takes the lead and trains alone in its own
    process; c, back, finds its lease gone and joins again. Nothing is lost."""
    epochs = 20
    with isolated_node() as net, EtcdServer(host=net.host_ip) as etcd:
        node = on_net(procs, etcd.endpoint, run_id, tmp_path, net, "1:3", "--epochs", str(epochs))

        c = node("c", True)
        c.wait_output("registered as c", timeout=60)  # first: it leads
        a, b = node("a", False), node("b", False)
        wait_world(tmp_path, 3, timeout=90)
        kept = set(worker_pids(a))
        b.kill_tree()
        time.sleep(0.1)
        cut = time.time()
        net.cut()
        alone = wait_world(tmp_path, 1, after=cut, timeout=TTL + 10)
        print(f"a trains alone {alone - cut:.2f}s after the leader's cut")
        assert alone - cut < TTL + 3, a.transcript()
        assert "c refuses its probe port" not in a.transcript()  # cut off is not dead
        survivors_kept(tmp_path, kept, after_world=1, since=cut)
        restored = time.time()
        net.restore()
        wait_world(tmp_path, 2, after=restored, timeout=90)
        full_speed(tmp_path)
        for n in (a, c):
            assert n.wait(120) == 0, n.transcript()
        came_back_anew(c)
    check_run(tmp_path, changes=3, epochs=epochs)


@pytest.mark.parametrize("newcomer", ["stays", "killed"])
def test_a_node_told_to_leave_while_it_alone_holds_the_state_hands_it_to_a_newcomer_first(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path, newcomer: str
) -> None:
    """a trains alone (no --checkpoint-dir: its state is in memory only); b starts to
    join (its workers start before it registers), and a is told to leave (SIGTERM) at
    once. a trains on until a round with b has trained a step, then leaves: b trains on
    from a's newest state, nothing trained again (before: b began again from step 0).
    Or b is SIGKILLed on its way: a leaves once b's word that it comes is gone with b's
    lease, not at the handover's bound."""
    # a's bound outlasts b's workers' start on a busy host (12 s seen), and the job
    # outlasts the handover (60 steps, 0.4 s each below world size 3)
    slow = ("--slow-below-world", "3", "--epochs", "6")
    wait = ("--handover-timeout", "60")
    a = start_on(procs, etcd.endpoint, run_id, tmp_path, "a", *slow, nnodes="1:3", extra=wait)
    wait_until(lambda: any(r["step"] >= 3 for r in rows(tmp_path)), 90, "a to train")
    b = start_on(procs, etcd.endpoint, run_id, tmp_path, "b", *slow, nnodes="1:3")
    b.wait_output("starting workers before joining", timeout=60)  # on its way
    told = time.monotonic()
    a.signal(signal.SIGTERM)
    if newcomer == "killed":
        a.wait_output("alone holds the job's newest state", timeout=30)
        b.kill_tree()
        told = time.monotonic()
    assert a.wait(60) == 143, a.transcript()
    took = time.monotonic() - told
    print(f"a left {took:.2f}s after its SIGTERM or b's kill")
    said = a.transcript()
    assert "alone holds the job's newest state" in said, said
    if newcomer == "killed":  # no one to hand it to: said, as a leave without a handover
        assert took < 30, said  # TTL (3 s) and the save; not the 60 s
        assert "no node is there to take the newest state: leaving the job now" in said, said
        assert "was in memory only and is lost with it" in said, said
        return
    assert "hold step" in said and "leaving the job now" in said, said
    full_speed(tmp_path)
    assert b.wait(120) == 0, b.transcript()
    assert "trained again" not in b.transcript(), b.transcript()
    check_run(tmp_path, changes=2, epochs=6)


def _c_joins_a_and_b(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path, held: bool
) -> tuple[Proc, Proc, Proc, Path]:
    """a (registered first: rank 0 and the store host) and b train at world 2, then c
    starts to join; ``held``: a, sending c's fresh worker the state, is held in packing
    it until the returned flag file is removed. Training outlasts all of it, however
    slowly c's worker starts (15 s in CI)."""
    slow = ("--slow-below-world", "4", "--slow-send", "--epochs", "6")
    flag = tmp_path / "slow-send"
    a = start(procs, etcd, run_id, tmp_path, "a", *slow)
    a.wait_output("registered as a", timeout=30)
    b = start(procs, etcd, run_id, tmp_path, "b", *slow)
    wait_world(tmp_path, 2, timeout=90)
    if held:
        flag.touch()
    return a, b, start(procs, etcd, run_id, tmp_path, "c", *slow), flag


@pytest.mark.parametrize("phase", ["forming", "resyncing"])
def test_the_store_host_lost_while_a_round_with_a_newcomer_forms(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path, phase: str
) -> None:
    """c joins; a, the round's rank 0 and store host, is SIGKILLed as the round of three
    forms (b waits in it for c's fresh worker), or as it resyncs (a holds c's fresh
    worker in the broadcast of the state, in c's first restore). b and c leave the dead
    round at once and re-form without a, in their own processes (they waited out
    --shutdown-timeout and respawned; c's worker died of its first restore). These are
    the tests of losing the rank-0 node; a node that is not rank 0: the quick-succession
    test."""
    a, b, c, flag = _c_joins_a_and_b(etcd, run_id, procs, tmp_path, held=phase == "resyncing")
    kept = worker_pids(b)
    if phase == "forming":
        b.wait_output("joined c", timeout=60)  # the round of three has formed
    else:
        c.wait_output("rank 2: receiving step", timeout=60)
    newcomer = set(worker_pids(c))
    killed = time.time()
    a.kill_tree()
    flag.unlink(missing_ok=True)  # b sends at once
    back = wait_world(tmp_path, 2, after=killed, timeout=90)
    print(f"training at world 2 {back - killed:.2f}s after the kill")
    assert back - killed < 20, b.transcript()  # not --shutdown-timeout (30 s), then more
    assert worker_pids(b) == kept
    if phase == "resyncing":  # c's worker restored nothing from a; it gets it from b
        said = c.transcript()
        got = said.find("rank 1: receiving step")
        assert -1 < got < said.find("restored step"), said
        after = {r["pid"] for r in rows(tmp_path) if r["world"] == 2 and r["t"] > killed}
        assert after == set(kept) | newcomer, "c's first worker trains"
    full_speed(tmp_path)
    for n in (b, c):
        assert n.wait(120) == 0, n.transcript()
        assert "no live re-formation" not in n.transcript()
        assert "stopping workers" not in n.transcript()
    check_run(tmp_path, changes=2, epochs=6)


@pytest.mark.parametrize("pressed", ["a", "c"])
def test_ctrl_c_of_a_node_as_a_round_with_a_newcomer_resyncs(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path, pressed: str
) -> None:
    """c joins a and b; as the round of three resyncs (a, rank 0 and the store host,
    held in packing the state it sends c's fresh worker), Ctrl-C reaches a node's whole
    process group, agent and workers: a, the sender, or c, the receiver. That node
    leaves at once (128 + SIGINT, within the Ctrl-C bound, nothing left behind): its
    workers give the round up rather than wait for its first step (c waited for a's
    send, trained a step with a and b, then left: 5.4 s; and c's agent, its worker
    still receiving, took itself for the holder of the job's newest state). The others
    leave the round at once and re-form without it, in their own processes, nothing lost
    (a leave during a re-formation is just another change)."""
    a, b, c, flag = _c_joins_a_and_b(etcd, run_id, procs, tmp_path, held=True)
    c.wait_output("rank 2: receiving step", timeout=60)
    leaving, staying = (a, c) if pressed == "a" else (c, a)
    kept = set(worker_pids(b)) | set(worker_pids(staying))
    family = [leaving.pid, *(p.pid for p in psutil.Process(leaving.pid).children(True))]
    pressed_at = time.time()
    os.killpg(leaving.pid, signal.SIGINT)
    if pressed == "a":  # its packing is the script's own code: nothing can cut it short
        flag.unlink()
    code = leaving.wait(10)
    took = time.time() - pressed_at
    flag.unlink(missing_ok=True)  # c left while a still packed: b sends now
    assert code == 128 + signal.SIGINT, leaving.transcript()
    assert "lost with it" not in leaving.transcript()  # b holds a's state; c has none
    assert took < 2.5, f"Ctrl-C took {took:.1f}s\n{leaving.transcript()}"
    wait_until(lambda: not any(psutil.pid_exists(p) for p in family), 5, "no orphans")
    back = wait_world(tmp_path, 2, after=pressed_at, timeout=90)
    print(f"Ctrl-C of {pressed}: left in {took:.2f}s, training at world 2 {back - pressed_at:.2f}s")
    assert back - pressed_at < 10, b.transcript()  # not --shutdown-timeout (30 s)
    assert pids_at(tmp_path, 2, after=pressed_at) == kept, (b.transcript(), staying.transcript())
    full_speed(tmp_path)
    for n in (b, staying):
        assert n.wait(120) == 0, n.transcript()
        said = n.transcript()
        assert "no live re-formation" not in said and "stopping workers" not in said, said
        assert "workers failed" not in said, said
    check_run(tmp_path, changes=2, epochs=6)


def test_ctrl_c_of_the_leader_as_the_round_re_forms_for_a_kill(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """c is SIGKILLed; as the others re-form for it, Ctrl-C reaches a, the leader (rank
    0, the round's store host), agent and workers: a leaves within the Ctrl-C bound, and
    b trains on alone in its own process, nothing lost."""
    slow = ("--slow-below-world", "2", "--epochs", "6")
    a = start_on(procs, etcd.endpoint, run_id, tmp_path, "a", *slow, nnodes="1:3")
    a.wait_output("registered as a", timeout=30)  # a claims the lead as it registers
    b, c = (start_on(procs, etcd.endpoint, run_id, tmp_path, n, *slow, nnodes="1:3") for n in "bc")
    wait_world(tmp_path, 3, timeout=90)
    kept = worker_pids(b)
    c.kill_tree()
    a.wait_output("workers re-form live", timeout=30)
    pressed = time.time()
    os.killpg(a.pid, signal.SIGINT)
    assert a.wait(10) == 128 + signal.SIGINT, a.transcript()
    took = time.time() - pressed
    assert took < 2.5, f"Ctrl-C took {took:.1f}s\n{a.transcript()}"
    back = wait_world(tmp_path, 1, after=pressed, timeout=60)
    print(f"a left in {took:.2f}s; b trains alone {back - pressed:.2f}s after the Ctrl-C")
    assert back - pressed < 5, b.transcript()  # a's leave is no loss: no lease to expire
    assert worker_pids(b) == kept
    full_speed(tmp_path)
    assert b.wait(120) == 0, b.transcript()
    said = b.transcript()
    assert "no live re-formation" not in said and "workers failed" not in said, said
    check_run(tmp_path, changes=3, epochs=6)


def test_a_node_stuck_in_a_send_to_a_lost_newcomer_steps_out_while_the_others_train_on(
    run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """c, in a network namespace whose link brings it 8 Mbit/s, joins a and b; a (rank 0)
    sends it the state (50 MB: a minute at that rate), and with most of it in flight
    c's cable is pulled and c SIGKILLed, so no reset ever reaches a. gloo never fails
    a's send, so a's worker says it is stuck and a's workers cannot be held; b trained
    with a, so a steps out (charged nothing) and b re-forms alone in its own process,
    training while a's new worker starts; then a joins again. Before, b waited in the
    round for a's new worker to start."""
    wide = ("--width", "2048", "--depth", "1", "--epochs", "4", "--slow-below-world", "3")
    with isolated_node() as net, EtcdServer(host=net.host_ip) as etcd:
        node = on_net(procs, etcd.endpoint, run_id, tmp_path, net, "1:3", *wide)
        a = node("a", False)
        a.wait_output("registered as a", timeout=30)  # rank 0: it sends the state
        b = node("b", False)
        wait_world(tmp_path, 2, timeout=90)
        kept = worker_pids(b)
        net.throttle("8mbit")
        c = node("c", True)
        sender = worker_pids(a)[0]
        sending = lambda: queued_to_send(sender, to=net.node_ip) > 1 << 20  # noqa: E731
        wait_until(sending, 90, "a's send of the state to c fills its connection")
        killed = time.time()
        net.cut()
        c.kill_tree()
        after = wait_until(partial(_first_below, tmp_path, 3, killed), 60, "a step without c")
        # b, alone (world 2: a's send was not stuck when c was lost; the logs say where)
        assert isinstance(after, dict) and after["world"] == 1, (after, a.transcript())
        alone = after["t"]
        print(f"b trains alone {alone - killed:.2f}s after the kill")
        back = wait_world(tmp_path, 2, after=alone, timeout=90)
        print(f"a is back {back - killed:.2f}s after the kill")
        assert worker_pids(b) == kept and pids_at(tmp_path, 1, killed) <= set(kept)
        full_speed(tmp_path)
        for n in (a, b):
            assert n.wait(120) == 0, n.transcript()
    said = a.transcript()
    assert "is stuck in a collective" in said and "leaving the job for now" in said, said
    assert "workers failed" not in said and "after a worker failure" not in b.transcript()
    check_samples(tmp_path, changes=4, epochs=4)


def _first_below(out: Path, world: int, t: float) -> dict | None:
    """The first step any rank began after ``t`` at a world size below ``world``."""
    after = (r for r in rows(out) if r["t"] > t and r["world"] < world)
    return min(after, key=lambda r: r["t"], default=None)


def test_a_worker_crash_on_one_node(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Node c's worker dies: c reports it and steps out, so a and b re-form without it at
    once, in their own processes, and train on while c's new worker starts (ahead of
    c's joining again); then the three re-form with it. One restart is charged."""
    # c comes back while a and b train on, however slowly its new worker starts (12 s in CI)
    agents = three(procs, etcd, run_id, tmp_path, "--slow-below-world", "3", "--epochs", "6")
    kept = [worker_pids(a) for a in agents[:2]]
    killed = time.time()
    os.kill(worker_pids(agents[2])[0], signal.SIGKILL)
    wait_until(lambda: len(pids_at(tmp_path, 3)) > 3, 60, "a new worker on c", interval=0.1)
    full_speed(tmp_path)
    assert [worker_pids(a) for a in agents[:2]] == kept
    for a in agents:
        assert a.wait(120) == 0, a.transcript()
    meanwhile = {r["step"] for r in rows(tmp_path) if r["world"] == 2 and r["t"] > killed}
    assert len(meanwhile) >= 2, agents[0].transcript() + agents[2].transcript()
    said = agents[2].transcript()
    assert "leaving the job for now" in said and "starting workers before joining" in said
    assert "restart 1 after a worker failure" in agents[0].transcript()
    check_run(tmp_path, changes=2, epochs=6)


def test_a_join_after_training_ended_closes_the_job(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """b comes while a's worker has left its training loop but not yet exited: asked to
    save for the resize, the worker exits 0, so a closes the job instead of forming a
    round that would train again from the last snapshot."""
    tmp_path.mkdir(exist_ok=True)
    a = start_agent(
        procs,
        etcd.endpoint,
        run_id,
        "a",
        SCRIPT,
        "--linger",
        nnodes="1:2",
        env={"RESULT_DIR": str(tmp_path)},
    )
    wait_until(lambda: (tmp_path / "trained").exists(), 90, "a trained", interval=0.1)
    b = start_agent(procs, etcd.endpoint, run_id, "b", SCRIPT, nnodes="1:2")
    wait_until(lambda: "b waiting to join" in a.transcript(), 60, "a saw b", interval=0.1)
    (tmp_path / "release").touch()
    assert a.wait(60) == 0, a.transcript()
    assert b.wait(60) == 0, b.transcript()
    assert "had finished training before the resize" in a.transcript()
    assert "job finished: all workers succeeded" in a.transcript()
    assert "round 2" not in a.transcript()
    assert len(pids_at(tmp_path, 1)) == 1 and not pids_at(tmp_path, 2), "one worker ever"
    check_run(tmp_path, changes=0)


class Node:
    """The agent's side of the contract for one node of ``n`` workers, played by the test
    (a real agent re-forms only on a real membership change: 30 of those would take
    minutes): control blocks, the round's TCPStore, placements."""

    def __init__(
        self, procs: list[Proc], out: Path, n: int = 2, env: dict[str, str] | None = None
    ) -> None:
        from elastic.contract import CONTROL_ENV, RESTART_MODE_ENV, ControlBlock, control_path

        self.out, self.n = out, n
        self.store: object = None
        self.port = self._host()
        self.blocks = [ControlBlock(control_path(out, lr), create=True) for lr in range(n)]
        self.workers = []
        for lr in range(n):
            worker_env = {**(env or {}), "RESULT_DIR": str(out), CONTROL_ENV: self.blocks[lr].path}
            worker_env.update({RESTART_MODE_ENV: "live", "LOCAL_RANK": str(lr)})
            worker_env.update(self.placement(lr), TORCHELASTIC_USE_AGENT_STORE="True")
            worker_env["LOCAL_WORLD_SIZE"] = str(n)
            cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "live_leak.py")]
            self.workers.append(Proc(cmd, env=worker_env, name=f"worker{lr}"))
            procs.append(self.workers[-1])

    def _host(self) -> int:
        from torch.distributed import TCPStore

        from rendezvous.net import free_port

        port = free_port()
        self.store = TCPStore("127.0.0.1", port, self.n, True, wait_for_workers=False)
        return port

    def placement(self, rank: int) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_RESTART_COUNT": "0",
        }

    def reform(self, k: int, urgent: bool) -> None:
        """Ask every worker to let go, host a fresh store, give them rotated ranks."""
        for b in self.blocks:
            (b.request_abandon if urgent else b.request_pause)()
        try:
            wait_until(lambda: all(b.stranded for b in self.blocks), 30, f"all stranded ({k})")
        except AssertionError as e:
            phases = [(b.phase, b.step, "stuck" if b.stuck else "") for b in self.blocks]
            for w in self.workers:
                w.signal(signal.SIGUSR1)  # its stacks, to its stderr
            time.sleep(1.0)
            logs = "\n".join(w.transcript()[-3000:] for w in self.workers)
            raise AssertionError(f"{e}; (phase, step, stuck) {phases}\n{logs}") from None
        self.port = self._host()
        for lr, b in enumerate(self.blocks):
            b.publish_placement(self.placement((lr + k) % self.n))

    def entries(self) -> dict[int, list[dict]]:
        return {pid: [r for r in rows(self.out) if r["pid"] == pid] for pid in self.pids}

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def run(self, times: int) -> None:
        """``times`` re-formations, pause and abandon in turn, each followed by a step."""
        wait_until(lambda: all(self.entries().values()), 60, "every worker training")
        for k in range(1, times + 1):
            self.reform(k, urgent=k % 2 == 0)
            wait_until(
                lambda k=k: all(len(e) > k for e in self.entries().values()),
                30,
                f"every worker trained after re-formation {k}",
            )
        for w in self.workers:
            w.kill_tree()


def test_thirty_live_re_formations_leak_nothing(procs: list[Proc], tmp_path: Path) -> None:
    """... and never touch a connection of the script's own, opened after its first
    process group formed and before State.run (15 of the 30 re-formations abandon),
    whether elastic saw that group form or not (local rank 1 forms it unwatched)."""
    env = {"ECHO_PORT": str(echo_server()), "LEAK_UNWATCHED_RANK": "1"}
    node = Node(procs, tmp_path, env=env)
    node.run(30)
    for pid, entries in node.entries().items():
        assert [e["entry"] for e in entries] == list(range(1, 32)), f"{pid} re-entered each time"
        assert all(e["own_connection"] for e in entries), f"{pid}: its own connection was cut"
        assert entries[-1]["rank"] == (entries[0]["rank"] + 30) % 2
        warm, last = entries[5], entries[-1]  # after the first rounds' one-time allocations
        grew = (last["rss"] - warm["rss"]) / 2**20
        assert grew < 16, f"{pid}: RSS grew {grew:.1f} MiB over 25 re-formations"
        assert last["fds"] <= warm["fds"] + 2, (warm, last)
        assert last["threads"] == warm["threads"], (warm, last)
        assert last["os_threads"] <= warm["os_threads"] + 2, (warm, last)
        print(
            f"pid {pid}: after 5 and 30 re-formations: RSS {warm['rss'] >> 20} -> "
            f"{last['rss'] >> 20} MiB, fds {warm['fds']} -> {last['fds']}, threads "
            f"{warm['os_threads']} -> {last['os_threads']}"
        )
