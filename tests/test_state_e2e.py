"""Checkpoint and resume under real agents: bitwise resume, exactly-once data, no shared FS."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from agents import full_speed, samples_once, start_agent, steps, wait_world, worker_pids
from harness import ROOT, Proc, wait_until

from elastic.agent.etcd_server import EtcdServer
from elastic.stored import CheckpointDir

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"


def start(
    procs: list[Proc],
    etcd: EtcdServer,
    run_id: str,
    out: Path,
    nodes: str,
    *args: str,
    extra: tuple[str, ...] = (),
) -> list[Proc]:
    """One agent per name in ``nodes`` (a two-node job), results under ``out``."""
    out.mkdir()
    return [
        start_agent(
            procs,
            etcd.endpoint,
            run_id,
            n,
            SCRIPT,
            *args,
            nnodes="2",
            extra=extra,
            env={"RESULT_DIR": str(out)},
        )
        for n in nodes
    ]


def train(
    procs: list[Proc],
    etcd: EtcdServer,
    run_id: str,
    out: Path,
    nodes: str,
    *args: str,
    extra: tuple[str, ...] = (),
) -> list[Proc]:
    agents = start(procs, etcd, run_id, out, nodes, *args, extra=extra)
    for a in agents:
        assert a.wait(120) == 0, a.transcript()
    return agents


def test_sigkill_of_a_worker_resumes_bitwise_equal(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    args = ("--samples", "96", "--epochs", "2", "--micro-batch", "4")
    extra = ("--snapshot-every", "3", "--max-restarts", "1")
    train(procs, etcd, run_id + "-ref", tmp_path / "ref", "ab", *args, extra=extra)
    agents = train(
        procs,
        etcd,
        run_id + "-kill",
        tmp_path / "kill",
        "cd",
        *args,
        "--kill-rank",
        "1",
        "--kill-step",
        "7",
        extra=extra,
    )
    assert any("signal SIGKILL" in line for a in agents for line in a.err)
    resumed = [r for r in steps(tmp_path / "kill") if r["step"] == 7]
    assert len({r["pid"] for r in resumed}) == 4, "step 7 ran twice: snapshot at 6, redone"
    ref = torch.load(tmp_path / "ref" / "final.pt")
    got = torch.load(tmp_path / "kill" / "final.pt")
    assert ref["step"] == got["step"] == 24
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    for p, s in ref["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, got["optimizer"]["state"][p][k]), (p, k)


@pytest.mark.slow
def test_three_two_three_nodes_every_sample_exactly_once(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    out = tmp_path / "steps"
    out.mkdir()
    # numpy is not a dependency of torch or of ours: the workers must restore without it
    shim = tmp_path / "no-numpy" / "numpy"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    env = {"RESULT_DIR": str(out), "PYTHONPATH": str(shim.parent)}
    args = (
        "--samples",
        "480",
        "--epochs",
        "3",
        "--micro-batch",
        "4",
        "--global-batch",
        "24",
        "--step-time",
        "0.1",
    )

    def node(name: str) -> Proc:
        ckpt = tmp_path / f"ckpt-{name}"  # a directory per node: no shared filesystem
        return start_agent(
            procs,
            etcd.endpoint,
            run_id,
            name,
            SCRIPT,
            *args,
            nnodes="2:3",
            # at interval 1 the step count below is exact
            extra=(
                "--checkpoint-dir",
                str(ckpt),
                "--checkpoint-every",
                "5",
                "--snapshot-every",
                "1",
            ),
            env=env,
        )

    def registered(name: str) -> Proc:  # join in name order, so a is rank 0, c is rank 2
        p = node(name)
        p.wait_output(f"registered as {name}", timeout=30)
        return p

    a, b, c = registered("a"), registered("b"), registered("c")
    wait_world(out, 3, timeout=60)
    time.sleep(1.5)
    killed = time.time()
    c.signal(signal.SIGKILL)
    wait_world(out, 2, after=killed, timeout=30)
    time.sleep(1.5)
    joined = time.time()
    d = node("d")
    wait_world(out, 3, after=joined, timeout=60)
    a.wait_output("joined d", timeout=5)
    full_speed(out)
    for n in (a, b, d):
        assert n.wait(120) == 0, n.transcript()

    history = steps(out)
    rounds = sorted(
        {r["port"] for r in history}, key=lambda p: min(r["t"] for r in history if r["port"] == p)
    )
    for r in history:
        r["round"] = rounds.index(r["port"])
    assert [
        sorted({r["world"] for r in history if r["round"] == i}) for i in range(len(rounds))
    ] == [[3], [2], [3]]
    samples_once(history, 480, 3, steps(out, tried=True))  # every sample, exactly once
    # torchrun's count, per agent: a node loss counts (under torchrun the survivors' workers
    # fail), though it charges no restart of the budget; a join does not, and the newcomer's
    # first round is 0
    counts = [sorted({r["restart_count"] for r in history if r["round"] == i}) for i in range(3)]
    assert counts == [[0], [1], [0, 1]]
    # the step counter: back by at most the snapshot interval (1) after the crash,
    # not at all after the graceful resize
    last = [max(r["step"] for r in history if r["round"] == i) for i in range(3)]
    first = [min(r["step"] for r in history if r["round"] == i) for i in range(3)]
    assert last[0] + 1 - first[1] <= 1, (last, first)
    assert first[2] == last[1] + 1, (last, first)
    # the newcomer had no checkpoint of its own: it got the survivors' state
    d_rows = [r for r in history if r["round"] == 2 and r["rank"] == 2]
    assert d_rows and d_rows[0]["step"] == first[2] > 1
    # global rank 0 (node a throughout) wrote durable checkpoints, the newest three kept
    assert len(list((tmp_path / "ckpt-a").glob("step-*.elr"))) == 3


def test_a_kill_right_after_a_resize_loses_nothing_it_was_sent(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Respawn path, default snapshot cadence: a trains alone, b and c join and receive
    a's state over the process group, then a is killed. What b and c received is in
    their nodes' shared memory: the next round resumes there, not from step 0."""
    out = tmp_path / "steps"
    out.mkdir()
    args = ("--samples", "4800", "--epochs", "1", "--global-batch", "24", "--step-time", "0.05")

    def node(name: str) -> Proc:
        return start_agent(
            procs, etcd.endpoint, run_id, name, SCRIPT, *args, nnodes="1:3",
            extra=("--restart-mode", "respawn"), env={"RESULT_DIR": str(out)},
        )  # fmt: skip

    a = node("a")
    wait_until(lambda: any(r["step"] >= 15 for r in steps(out)), 60, "a to train alone")
    b = node("b")
    node("c")
    three = wait_world(out, 3, timeout=60)
    first3 = min(r["step"] for r in steps(out) if r["world"] == 3)
    wait_until(
        lambda: any(r["world"] == 3 and r["step"] >= first3 + 2 for r in steps(out)), 30, "steps"
    )
    b_workers = {c.pid for c in psutil.Process(b.pid).children(recursive=True)}
    killed = time.time()
    a.signal(signal.SIGKILL)
    wait_world(out, 2, after=killed, timeout=40)
    first2 = min(r["step"] for r in steps(out) if r["world"] == 2 and r["t"] > killed)
    assert first2 >= first3 > 15, (first3, first2, three)
    # the steps of round 2 trained again (no snapshot since) are said, never silent: b's
    # workers committed each step they wrote a row for (a's loss can cut a step short on
    # b, so b's own rows count, not the others')
    committed = max(r["step"] for r in steps(out) if r["world"] == 3 and r["pid"] in b_workers)
    if first2 <= committed:
        pattern = (r"resumes from step (\d+), \d+ step\(s\) behind the newest this "
                   r"node's workers committed \((\d+)\)")  # fmt: skip
        said = wait_until(lambda: re.findall(pattern, b.transcript()), 10, "b to say so")
        assert isinstance(said, list) and int(said[-1][0]) == first2 - 1, said
        assert committed - 1 <= int(said[-1][1]) <= committed, (said, committed)


def test_fsdp_state_is_resharded_live_through_a_join_and_a_kill(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """FSDP2 with ``State.run(train, reshard=...)``: c joins a and b, and the survivors
    keep their processes while the shards move in memory to three ranks; then b is
    SIGKILLed and a and c keep theirs again, rebuilding the snapshot's step from their
    own copies and the copy of b's rows its buddy (c) kept: no disk read. Then a new job
    on one node resumes from the DCP checkpoint, resharded from two ranks to one."""
    out, shared = tmp_path / "steps", tmp_path / "shared-ckpt"
    out.mkdir()
    script = ROOT / "tests" / "scripts" / "fsdp_train.py"

    def node(name: str) -> Proc:
        return start_agent(
            procs,
            etcd.endpoint,
            run_id,
            name,
            script,
            "--steps",
            "40",
            "--live",
            "--slow-until-world",
            "3",
            nnodes="2:3",
            extra=(
                "--checkpoint-dir",
                str(shared),
                "--snapshot-every",
                "5",
                "--start-method",
                "forkserver",
            ),
            env={"RESULT_DIR": str(out)},
        )

    a, b = node("a"), node("b")
    wait_world(out, 2, timeout=60)
    kept = {p for n in (a, b) for p in worker_pids(n)}
    c = node("c")

    def trained(world: int, after: float) -> list[dict]:
        return [
            r for r in steps(out) if r["event"] == "step" and r["world"] == world and r["t"] > after
        ]

    def past_a_snapshot_at_3() -> bool:
        """Every rank trains past the first snapshot at world 3 (--snapshot-every 5; a
        sharded snapshot, with its copy to the next node, is done when commit returns):
        only then does c hold a copy of b's rows. (A node lost during that snapshot leaves
        no step whole in memory: the copy it replaces goes first; the DCP checkpoint then.)"""
        at3 = trained(3, 0)
        if not at3:
            return False
        snap = -(-min(r["step"] for r in at3) // 5) * 5
        return len({r["rank"] for r in at3 if r["step"] > snap}) == 3

    wait_until(past_a_snapshot_at_3, 90, "training at world 3 past a snapshot")
    gone = set(worker_pids(b))
    killed = time.time()
    b.kill_tree()
    wait_until(lambda: trained(2, killed), 60, "training at world 2 after the kill")
    for n in (a, c):
        assert n.wait(120) == 0, n.transcript()
    history = steps(out)
    rows = [r for r in history if r["event"] == "step"]
    restored = [r for r in history if r["event"] == "restored"]
    # the join: a's and b's workers kept their processes, c's new worker got its shard of
    # the newest step, and every rank holds the state the job had
    at3 = [r for r in restored if r["world"] == 3]
    assert {r["rank"] for r in at3} == {0, 1, 2} and kept <= {r["pid"] for r in at3}, at3
    joined_at = min(r["t"] for r in at3)
    last2 = max(
        (r for r in rows if r["world"] == 2 and r["t"] < joined_at), key=lambda r: r["step"]
    )
    assert {r["step"] for r in at3} == {last2["step"]}
    assert all(r["checksum"] == pytest.approx(last2["checksum"], rel=1e-12) for r in at3)
    assert min(r["step"] for r in rows if r["world"] == 3) == last2["step"] + 1
    # the kill: a and c kept their processes again and resumed from a step the job had
    # trained (the checksum logged for it), no further back than the snapshot interval
    after = [r for r in restored if r["t"] > killed]
    assert {r["pid"] for r in after} == {r["pid"] for r in at3} - gone, after
    assert len({r["step"] for r in after}) == 1, after
    back = after[0]["step"]
    was = [r for r in rows if r["step"] == back and r["t"] < killed]
    assert was and all(
        r["checksum"] == pytest.approx(was[-1]["checksum"], rel=1e-12) for r in after
    )
    reached = max(r["step"] for r in rows if r["t"] < killed)
    assert reached - 5 <= back <= reached, (back, reached)
    said = a.transcript() + c.transcript()
    # the row of the step in flight is written before its commit(): beyond it, the agents
    # say what is trained again
    assert back >= reached - 1 or f"resumes from step {back}, " in said, said
    assert "held whole in memory" not in said, said  # b's rows came from its buddy, c
    assert max(r["step"] for r in rows) == 40
    # a new job on one fresh node, not live, resumes from the DCP checkpoint of step 40
    done = time.time()
    d = start_agent(
        procs,
        etcd.endpoint,
        run_id + "-again",
        "d",
        script,
        "--steps",
        "42",
        nnodes="1",
        extra=("--checkpoint-dir", str(shared)),
        env={"RESULT_DIR": str(out)},
    )
    assert d.wait(120) == 0, d.transcript()
    resumed = [r for r in steps(out) if r["t"] > done]
    assert resumed[0]["event"] == "restored" and resumed[0]["step"] == 40, resumed[:2]
    last = [r for r in rows if r["step"] == 40]
    assert resumed[0]["checksum"] == pytest.approx(last[0]["checksum"], rel=1e-12)
    assert [r["step"] for r in resumed[1:]] == [41, 42]


def test_save_at_breakdown_and_resume_on_fresh_nodes(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """A worker crash with the restart budget spent: the job goes down, and each agent
    writes its node's newest snapshot to the checkpoint dir (no periodic checkpoint was
    due). A new run, with no shared memory left, resumes from it."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "run1"
    args = ("--samples", "320", "--epochs", "1", "--step-time", "0.02")  # 40 steps
    extra = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "100000", "--snapshot-every", "1")
    out.mkdir()
    env = {"RESULT_DIR": str(out)}
    crash = ("--kill-rank", "1", "--kill-step", "30")
    nodes = [
        start_agent(
            procs, etcd.endpoint, run_id, n, SCRIPT, *args, *crash, nnodes="2", extra=extra, env=env
        )
        for n in "ab"
    ]
    for n in nodes:
        assert n.wait(120) == 1, n.transcript()
    said = [line for n in nodes for line in n.err if "saved the newest state" in line]
    assert said, [n.transcript() for n in nodes]
    saved = max(int(p.name[5:17]) for p in ckpt.glob("step-*.elr"))
    # the newest step both nodes hold: the killed rank's copy of step 30 runs in the
    # background after its commit, so the kill may cut it short, leaving step 29
    assert saved in (29, 30)
    assert not list(ckpt.glob("*.tmp"))
    again = tmp_path / "run2"
    train(procs, etcd, run_id + "-again", again, "cd", *args, extra=("--checkpoint-dir", str(ckpt)))
    assert min(r["step"] for r in steps(again)) == saved + 1


def test_sigterm_of_the_whole_job_saves_the_newest_state(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Every node told to stop: the workers save at their next commit and exit, and the
    checkpoint dir holds that step (no periodic checkpoint was due)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    extra = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "100000")
    args = ("--samples", "100000", "--epochs", "1", "--step-time", "0.05")
    nodes = start(procs, etcd, run_id, out, "ab", *args, extra=extra)
    wait_world(out, 2, timeout=60)
    wait_until(lambda: max(r["step"] for r in steps(out)) >= 8, 60, "some steps")
    for n in nodes:
        n.signal(signal.SIGTERM)
    for n in nodes:
        assert n.wait(60) != 0, n.transcript()
    # rank 0 checkpoints the snapshot it takes before stopping; the other agent finds
    # that state already there, or saves its own copy if it gets there first
    said = [
        line
        for n in nodes
        for line in n.err
        if "saved the newest state" in line or "is already in" in line
    ]
    assert said, [n.transcript() for n in nodes]
    last = max(r["step"] for r in steps(out))
    assert CheckpointDir(ckpt).newest_valid()[0] == last  # the step committed last


def test_a_snapshot_left_by_another_run_of_a_job_with_the_same_id_is_not_restored(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """Node a of a job is SIGKILLed: its snapshot stays in shared memory. A new run of a
    job with the same id starts on another etcd (an embedded one starts empty): b trains
    and records progress, then a joins it under its old name. a's old snapshot is that
    other run's (its progress record's token differs): a removes it, and the round
    resumes from b's state, not from a's old step."""
    out = tmp_path / "run"
    out.mkdir()
    env, every = {"RESULT_DIR": str(out)}, ("--snapshot-every", "1")
    slow = ("--samples", "2000", "--epochs", "1", "--step-time", "0.03")

    def node(endpoint: str, name: str, *args: str) -> Proc:
        return start_agent(
            procs, endpoint, run_id, name, SCRIPT, *args, nnodes="1:2", env=env, extra=every
        )

    first = node(etcd.endpoint, "a", *slow)
    wait_until(lambda: max((r["step"] for r in steps(out)), default=0) >= 40, 60, "a to train")
    first.kill_tree()
    old = max(r["step"] for r in steps(out))
    again = ("--samples", "200", "--epochs", "1", "--step-time", "0.3")  # 25-50 steps
    with EtcdServer(name="again") as other:
        b = node(other.endpoint, "b", *again)
        started = time.time()
        wait_until(lambda: any(r["t"] > started for r in steps(out)), 60, "b to train")
        bs = {r["pid"] for r in steps(out) if r["t"] > started}
        a = node(other.endpoint, "a", *again)
        for n in (a, b):
            assert n.wait(120) == 0, n.transcript()
    said = [line for line in a.err if "the snapshot of step" in line]
    assert len(said) == 1 and "removed" in said[0] and "another run" in said[0], a.transcript()
    new = [r for r in steps(out) if r["t"] > started]
    at_a = min(r["t"] for r in new if r["pid"] not in bs)  # a's worker, in the round with b
    b_then = max(r["step"] for r in new if r["pid"] in bs and r["t"] < at_a)
    resumed = min(r["step"] for r in new if r["t"] >= at_a)
    assert resumed <= b_then + 1 < old, (resumed, b_then, old)  # b's state, not a's old one


def test_a_node_restarted_after_every_holder_died_resumes_from_its_own_snapshot(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """The job's only node SIGKILLed, no checkpoint dir: the newest state is in no
    process any more, but in the node's shared memory. Started again under its name (a
    restarted pod keeps its /dev/shm), the agent takes its dead predecessor's id at once
    (its probe port refuses) and keeps the snapshot it left, since the job in etcd goes
    on: the job resumes there, not from step 0."""
    out = tmp_path / "run"
    out.mkdir()
    args = ("--samples", "400", "--epochs", "1", "--step-time", "0.03")  # 100 steps
    env, every = {"RESULT_DIR": str(out)}, ("--snapshot-every", "1")
    # a lease that outlives the restart however slow (CI: the agent took more than the 3 s
    # TTL to start, its predecessor's record was gone, and nothing was left to take over)
    conf = "lease_ttl=60,last_call_timeout=1"

    def node() -> Proc:
        return start_agent(
            procs, etcd.endpoint, run_id, "a", SCRIPT, *args, nnodes="1", conf=conf, env=env,
            extra=every,
        )  # fmt: skip

    first = node()
    wait_until(lambda: max((r["step"] for r in steps(out)), default=0) >= 20, 60, "some steps")
    first.kill_tree()
    killed = steps(out)
    last, gone = max(r["step"] for r in killed), {r["pid"] for r in killed}
    again = node()
    assert again.wait(120) == 0, again.transcript()
    said = [line for line in again.err if "kept the snapshot of step" in line]
    assert len(said) == 1 and "the job goes on" in said[0], again.transcript()
    assert any("previous agent" in line and "gone" in line for line in again.err)
    resumed = min(r["step"] for r in steps(out) if r["pid"] not in gone)
    assert last - 2 <= resumed - 1 <= last, (last, resumed)  # the snapshot of the last commit
