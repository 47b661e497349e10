"""When the ranks of a State agree (elastic/worker/agreement.py): the rule on synthetic
figures, and two real ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import ROOT
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic import State
from elastic.contract import NODE_DIR_ENV, SnapshotPolicy
from elastic.worker import comm, doorbell
from elastic.worker.agreement import (
    HOOK_S,
    LATENCY,
    LIMIT,
    SETTLED,
    SHARE,
    Agreement,
    bell_pays,
    choose,
)
from elastic.worker.doorbell import Doorbell, Rung
from rendezvous.net import free_port


@pytest.mark.parametrize(
    ("step_s", "cost_s", "gap"),
    [
        (None, 0.001, 1),  # the step not measured yet
        (0.002, None, 1),  # no agreement timed yet
        (0.100, 0.001, 1),  # 1% of a long step: every step
        (0.002, 0.001, 25),  # 1 ms beside 2 ms: 2% of step time every 25 steps
        (0.010, 0.001, 5),  # 1 ms beside 10 ms: every 5
        (0.004, 0.004, 12),  # wants 50, but 12 steps are 48 ms: the latency bound
        (0.0001, 0.001, LIMIT),  # wants 500, the bound says 500: the limit
        (0.2, 0.5, 1),  # a step longer than the latency bound: every step, whatever it costs
    ],
)
def test_the_smallest_gap_within_the_share_and_the_latency_bound(
    step_s: float | None, cost_s: float | None, gap: int
) -> None:
    assert choose(step_s, cost_s).steps == gap


def test_the_gap_keeps_agreements_within_their_share() -> None:
    for step_ms in (0.5, 1, 2, 3, 7, 20):
        for cost_ms in (0.05, 0.3, 1, 2.5):
            step, cost = step_ms / 1e3, cost_ms / 1e3
            g = choose(step, cost).steps
            assert g * step <= LATENCY + 1e-12 or g == 1
            if g < min(LIMIT, int(LATENCY / step)):  # not cut by a bound: within the share
                assert cost / (g * step) <= SHARE + 1e-12
                assert g == 1 or cost / ((g - 1) * step) > SHARE  # and the smallest such


def test_the_reason_names_the_figures_and_the_bound() -> None:
    assert "2.0% of step time every 25 step(s)" in choose(0.002, 0.001).reason
    assert "at most 50 ms of steps" in choose(0.004, 0.004).reason


def test_agreements_come_every_agreed_gap_and_start_over_on_a_new_group() -> None:
    a = Agreement()
    assert a.due(1, group=1)  # the first commit on a group: always
    assert not a.agreed(1, 1)
    assert a.due(2, group=1)
    assert a.agreed(2, 4)  # the gap moved: the next agreement is at the next multiple
    assert [s for s in range(3, 12) if a.due(s, group=1)] == [4, 5, 6, 7, 8, 9, 10, 11]
    a.agreed(4, 4)
    assert [s for s in range(5, 15) if a.due(s, group=1)] == [8, 9, 10, 11, 12, 13, 14]
    a.agreed(9, 4)  # late (a step skipped): back on the multiples
    assert [s for s in range(10, 15) if a.due(s, group=1)] == [12, 13, 14]
    # a re-formation: the new group's ranks (a newcomer among them) agree at once, at 1
    assert a.due(7, group=2)
    assert a.gap == 1
    assert a.agreed(7, 3) and a.gap == 3


def test_a_gap_below_one_is_one() -> None:
    a = Agreement()
    a.due(5, group=1)
    a.agreed(5, 0)
    assert a.gap == 1 and a.due(6, group=1)


def test_the_proposal_uses_the_median_step_and_agreement_times() -> None:
    a = Agreement()
    assert a.proposal() == 1  # nothing timed
    for seconds in (0.001, 0.001, 0.5, 0.001, 0.001):  # one stray slow agreement
        a.timed(seconds)
    assert a.proposal() == 1  # no step timed
    for seconds in (0.002, 0.002, 3.0, 0.002):  # and one stray slow step
        a.stepped(seconds)
    assert a.proposal() == 25
    # a fixed snapshot interval: the largest divisor of it up to 25
    assert [a.proposal(every) for every in (3, 7, 10, 100, 1000)] == [3, 7, 10, 25, 25]


def test_slow_spells_of_a_few_steps_move_no_gap() -> None:
    """1 ms steps with a spell of 9 at 4 ms every 50, agreements of 1 ms: the gap stays
    at the 50 steps the latency bound allows (a median of the last 9 steps went to 12 in
    each spell, and the least of the ranks' proposals with it)."""
    a = Agreement()
    a.timed(0.001)
    gaps = set()
    for step in range(1, 3001):
        a.stepped(0.004 if step % 50 < 9 else 0.001)
        if step > 500:
            gaps.add(a.proposal())
    assert gaps == {50}, gaps


def ranks(script: str, world: int, *args: str) -> list[list[str]]:
    """``tests/scripts/<script>`` run as ``world`` gloo ranks: each one's words printed."""
    port = free_port()
    path = str(ROOT / "tests" / "scripts" / script)

    def env(rank: int) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank),
                "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}  # fmt: skip

    procs = [
        subprocess.Popen(
            [sys.executable, path, *args], env=env(r), stdout=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=60)[0].split() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * world, outs
    return outs


def test_two_ranks_agree_at_the_same_steps_and_stop_together() -> None:
    """Real ranks (two processes, gloo) committing steps that take no time: they agree
    every LIMIT steps, not every step, and a stop asked of one rank only (at step 1500)
    stops both at the same step, at most a gap later."""
    outs = ranks("commit_pair.py", 2)
    # "rank R stopped S gap G agreements N", the same on both ranks but for R
    assert all(o[2:] == outs[0][2:] and len(o) == 8 for o in outs), outs
    stopped, gap, agreements = (int(outs[0][i]) for i in (3, 5, 7))
    assert gap == LIMIT, outs
    assert 1500 <= stopped < 1500 + gap, outs
    assert agreements < stopped / 20, outs


def test_with_a_fixed_interval_snapshots_land_exactly_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real State (one rank) with ``--snapshot-every 3``, timed by an injected clock:
    10 ms steps and 5 ms agreements would make the gap 5 (the latency bound); with the
    fixed interval it is 3, a divisor, so every third step is an agreement and each
    snapshot is taken exactly on it, none skipped, none late."""
    monkeypatch.setenv(NODE_DIR_ENV, str(tmp_path))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = State(snapshot_policy=SnapshotPolicy(every=3), model=model, optimizer=opt)
    now = [0.0]
    state._core.cadence.clock = lambda: now[0]
    control = comm.control()
    real = control.all_reduce

    def agree(values: list[int], op: str) -> list[int]:
        now[0] += 0.005
        agreements.append(state.step)
        return real(values, op)

    agreements: list[int] = []
    monkeypatch.setattr(control, "all_reduce", agree)
    snapshots = []
    for _ in range(60):
        now[0] += 0.010
        opt.step()
        state.commit()
        if state._core.cadence.last == state.step:
            snapshots.append(state.step)
    state.flush()
    state.close()
    assert state._core.agreement.gap == 3
    assert [s for s in agreements if s > 20] == list(range(21, 61, 3))  # not every step
    assert snapshots == list(range(3, 61, 3)), snapshots


@pytest.mark.parametrize("mode", ["fold", "fold-view"])
def test_the_bell_in_ddps_reduction_stops_every_rank_the_next_step_and_changes_no_weight(
    mode: str,
) -> None:
    """Three real ranks under DDP (a division by 3 is inexact): once every rank's DDP
    carries the hook, a stop asked of rank 1 alone after step 200 reaches all of them in
    step 201's gradient all-reduce, and they stop there together (the schedule stops at
    the first multiple of its gap from 200 on; at 200 if an agreement of the snapshot
    cadence falls there), with few agreements of their own; the weights are bitwise those
    of DDP without State (its gradients copied out of the bucket, or views of it)."""
    folded = ranks("doorbell_ranks.py", 3, mode)
    # "rank R stopped S active A agreements N SAME calls C agreed-at STEPS" (the last 4)
    assert {tuple(o[2:]) for o in folded} == {tuple(folded[0][2:])}, folded
    # an agreement of the snapshot cadence's own in step 200's commit, where rank 1 asks
    # already, stops them there; else the bell rings it in step 201's reduction
    expected = "200" if "200" in folded[0][12].split(",") else "201"
    assert folded[0][3] == expected and folded[0][5] == "True", folded
    # not every step: the first on the group, the stop, and the snapshot cadence's new
    # intervals, each with a snapshot (noisy here, 12-24 in 200 steps: snapshots without a
    # node dir cost next to nothing, so they come every few steps)
    assert int(folded[0][7]) <= 40, folded
    assert folded[0][8] == "True", folded  # the same model beside it, under DDP alone


def test_one_ranks_no_to_the_hook_keeps_it_off_every_rank() -> None:
    """The ranks weigh the hook each on its own figures; near the line they differ (here:
    rank 0 finds it would not pay, rank 1 that it would). They settle it in an agreement:
    no rank's DDP carries it (a hook on some ranks never folds, and they would pay its pass
    for nothing), and a stop comes through the schedule."""
    outs = ranks("doorbell_ranks.py", 2, "split")
    assert all(o[-2:] == ["hooked", "False"] and o[5] == "False" for o in outs), outs
    assert outs[0][3] == outs[1][3] and 200 <= int(outs[0][3]) <= 200 + LIMIT, outs


def test_a_script_whose_ddp_has_its_own_hook_keeps_the_agreements_own_collective() -> None:
    """Rank 0's DDP carries a hook of the script's own: the ranks agree not to fold (their
    reductions keep one size, no hang) and a stop comes through the schedule, at the
    next agreement."""
    outs = ranks("doorbell_ranks.py", 2, "own-hook")
    assert {tuple(o[2:8]) for o in outs} == {tuple(outs[0][2:8])}, outs
    stopped = int(outs[0][3])
    assert outs[0][5] == "False" and 200 <= stopped <= 200 + LIMIT, outs


def test_a_hook_the_script_registers_after_training_began_takes_over_from_the_bell() -> None:
    """DDP takes one comm hook, and State's went on once it paid: a hook the script
    registers later (rank 0 a Python one, rank 1 a built-in one, once the bell rides in
    the reduction, from step 50 on) still works as under plain DDP: the bell asks the
    ranks to stop folding, the script's hook gets every bucket from the step after, a
    stop comes through the schedule, and the weights are bitwise those of plain DDP with
    the same hooks."""
    outs = ranks("doorbell_ranks.py", 2, "late-hook")
    # "rank R stopped S active A agreements N SAME calls C agreed-at STEPS late L"
    assert {tuple(o[2:9]) for o in outs} == {tuple(outs[0][2:9])}, outs
    stopped, late = int(outs[0][3]), int(outs[0][14])
    assert 50 <= late < 200, outs  # the bell rode in State's DDP by then
    assert outs[0][5] == "False" and 200 <= stopped <= 200 + LIMIT, outs
    assert outs[0][8] == "True", outs  # the same weights as DDP with the script's hooks
    # every step's reduction from the step after the one that asked to stop folding
    assert int(outs[0][10]) == (stopped - late) * 2 - 1, outs  # both DDPs, one folded step


def test_a_reduction_that_carried_the_bell_and_failed_fails_the_step() -> None:
    """A peer lost while the bell rides in the reduction: the survivor's backward fails
    at once, as under plain DDP, and never trains on its own unreduced gradients."""
    outs = ranks("doorbell_ranks.py", 2, "peer-lost")
    assert sorted(" ".join(o) for o in outs) == [
        "rank 0 failed-after 100",
        "rank 1 left-after 100",
    ], outs


def test_where_the_bell_rode_in_the_reduction_it_alone_says_but_a_new_group_agrees() -> None:
    a = Agreement()
    assert a.due(1, group=1, bell=False)  # the first commit on a group, whatever the bell
    a.agreed(1, 5)
    assert not a.due(5, group=1, bell=False)  # the schedule would agree at 5
    assert a.due(3, group=1, bell=True)  # a rank rang
    assert a.due(5, group=1, bell=None)  # no reduction carried it: the schedule
    assert a.due(6, group=2, bell=False)  # a re-formation


@pytest.mark.parametrize(
    ("pass_s", "step_s", "buckets", "pays"),
    [
        (2e-6, 0.002, 1, False),  # a tiny model: the Python hook's call costs 5% of it
        (2e-6, 0.010, 1, True),  # ... 1% of a longer step
        (900e-6, 0.012, 1, False),  # 4 MB of gradients: 7.5% of a 12 ms step
        (90e-6, 0.010, 1, True),  # 1.9%: within what the agreements may cost
        (90e-6, 0.010, 2, False),  # ... but not with a second bucket's call
    ],
)
def test_the_bell_goes_on_only_where_its_hook_costs_what_agreements_may(
    pass_s: float, step_s: float, buckets: int, pays: bool
) -> None:
    verdict = bell_pays(pass_s, step_s, buckets)
    assert verdict.pays is pays
    cost = pass_s + buckets * HOOK_S
    assert f"{cost * 1e6:.0f} us ({pass_s * 1e6:.0f} us over" in verdict.reason, verdict.reason
    assert f"{buckets} bucket(s)" in verdict.reason and f"{cost / step_s:.1%}" in verdict.reason
    assert pays is (cost <= SHARE * step_s)


@pytest.mark.usefixtures("one_rank")
def test_a_hook_is_weighed_for_each_bucket_ddp_reduces() -> None:
    """The Python hook's cost comes once per bucket: DDP's first bucket holds 1 MB, the
    others 25 MB (``bucket_cap_mb``)."""
    small = DDP(torch.nn.Linear(64, 64))
    big = DDP(torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))))
    capped = DDP(
        torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))), bucket_cap_mb=4
    )
    assert [doorbell._bucket_count(d) for d in (small, big, capped)] == [1, 3, 9]


def test_the_step_is_weighed_once_the_first_steps_on_a_group_are_past() -> None:
    """The first steps on a new group are its warm-up (slow, and their agreements
    slower): the bell is weighed against the steps after them."""
    a = Agreement()
    for _ in range(SETTLED - 1):
        a.stepped(0.002)
    assert a.step_s() is None, "only the warm-up's steps timed"
    a.stepped(0.002)
    assert a.step_s() == pytest.approx(0.002)


@pytest.mark.usefixtures("one_rank")
def test_the_bell_is_weighed_once_its_ddp_was_seen_and_goes_on_only_where_it_pays() -> None:
    """A real DDP: found at its first forward, its pass timed; weighed once the step is
    timed; settled at the ranks' next agreement: a DDP where the hook would cost more
    than the agreements may keeps DDP's own C++ reduction (no comm hook), one where it
    pays carries it unless another rank declined, and none is weighed again at later
    forwards."""
    cases = ((1e-9, False, False), (1.0, True, False), (1.0, False, True))
    for step_s, pays, declined in cases:  # declined: another rank's figures said no
        model = torch.nn.Linear(64, 64)
        bell = Doorbell(lambda: Rung(False, False))
        bell.watch([model])
        ddp = DDP(model)
        bell.consider(step_s)
        assert bell.verdict is None and not bell.declines, "nothing seen: nothing weighed"
        ddp(torch.randn(2, 64)).sum().backward()
        bell.consider(None)
        assert bell.verdict is None, "the step not timed yet: not weighed yet"
        bell.consider(step_s)
        assert bell.verdict is not None and bell.declines is not (pays or declined)
        assert not ddp._comm_hooks, "not before the ranks settle it"
        bell.settle(declined or bell.declines)
        assert bool(ddp._comm_hooks) is pays and bell.ready is pays and not bell.declines
        verdict = bell.verdict
        assert verdict.pays is pays and ("another rank" in verdict.reason) is declined
        ddp(torch.randn(2, 64)).sum().backward()
        bell.consider(1.0 - step_s)
        bell.settle(False)
        assert bell.verdict is verdict, "weighed once per DDP"


@pytest.mark.usefixtures("one_rank")
def test_the_forward_hook_goes_once_the_ddp_is_found_and_comes_back_after_a_change() -> None:
    """A module with a forward hook takes torch's slower call path every step: the hook
    that finds the DDP goes once it found it, and comes back at a re-formation
    (``forget``), where the script wraps the module in a new DDP, found in turn."""
    model = torch.nn.Linear(8, 8)
    bell = Doorbell(lambda: Rung(False, False))
    bell.watch([model])
    model(torch.randn(2, 8))  # a forward outside DDP finds nothing: the hook stays
    assert model._forward_pre_hooks, "listening until a DDP is seen"
    first = DDP(model)
    first(torch.randn(2, 8)).sum().backward()
    assert not model._forward_pre_hooks, "found: no hook left on the module"
    bell.consider(1.0)
    bell.settle(False)
    assert bell.ready, "the found DDP carries the bell"
    verdict = bell.verdict
    bell.watch([model])  # State's objects set anew, the same DDP around the module
    first(torch.randn(2, 8)).sum().backward()
    assert not model._forward_pre_hooks, "the same DDP: no hook left on the module"
    bell.consider(1.0)
    assert bell.verdict is verdict and not bell.declines and bell.ready, "not weighed again"
    bell.forget()
    assert model._forward_pre_hooks and not bell.ready, "a re-formation listens again"
    second = DDP(model)
    second(torch.randn(2, 8)).sum().backward()
    assert not model._forward_pre_hooks
    bell.consider(1.0)
    bell.settle(False)
    assert bell.ready and second._comm_hooks, "the new DDP carries it"


def test_state_frees_its_collectives_tensors_itself_and_holds_no_group_past_destroy() -> None:
    """Two real ranks. The tensors of State's agreements are freed on the main thread
    (``comm.lent``): freed by gloo's thread, they take the GIL, which it cannot have once
    the interpreter finalizes, and the process aborts after its job succeeded
    (examples/device_subsets.py: 3 runs in 73, 3 at once on this machine).
    The script's ``destroy_process_group`` frees the group at once (held by elastic, it
    would live on to the end); a new group, on a port of its own, gets a new control
    group."""
    outs = ranks("control_exit.py", 2, str(free_port()))
    expect = ["freed-on-main", "True", "freed", "8", "alive-after-destroy", "False",  # 8 made
              "new-generation", "True"]  # fmt: skip
    assert outs == [expect] * 2, outs
