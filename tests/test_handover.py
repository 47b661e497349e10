"""The handover rule: a node told to leave trains on only while the job's newest state
would otherwise go with it, and only until a round with a newcomer trained a step; and
the wait's owner, which holds the signal back and bounds the wait."""

from __future__ import annotations

import signal

import pytest
from harness import wait_until

from elastic.agent.handing import Handover
from elastic.agent.handover import Holding, hands_over, holds_alone


def holding(**kw: object) -> Holding:
    facts: dict[str, object] = {
        "round": 3,
        "size": 1,
        "joined": 0,
        "newcomer": False,
        "others": 1,
        "step": 40,
        "resumed": 12,
        "on_disk": False,
    }
    facts.update(kw)
    return Holding(**facts)  # type: ignore[arg-type]


NEW_PAIR = {"round": 4, "size": 2, "joined": 1}  # round 4: this node and one that joined it
FRESH = {"size": 3, "joined": 1, "newcomer": True, "resumed": None}  # it joined two


@pytest.mark.parametrize(
    ("waiting", "kw", "keep", "why"),
    [
        # as the signal comes: it hands over only what would go with it
        (False, {}, True, "alone holds the job's newest state (step 40)"),
        (False, {"others": 2}, True, "the 2 node(s) joining have it"),
        (False, {"on_disk": True}, False, "goes to --checkpoint-dir"),
        (False, {"step": -1}, False, "no step trained"),
        # a fresh newcomer, its worker still receiving the state: it brings nothing
        (False, {**FRESH, "step": 0}, False, "no step trained"),
        (False, {"size": 2}, False, "the other nodes of round 3 hold what it trained"),
        (False, {"size": 3, "joined": 1}, False, "hold what it trained"),  # one trained with it
        (False, {"size": 2, "joined": 1, "newcomer": True}, False, "hold step 40 now"),
        # a newcomer may bring the newest state (its snapshot, kept while it was out)
        (False, {"size": 2, "joined": 1, "newcomer": True, "resumed": None}, True, "first step"),
        # the round with a newcomer formed, its workers did not train a step yet
        (False, {**NEW_PAIR, "resumed": None}, True, "do not hold the job's newest state"),
        (False, {**NEW_PAIR, "resumed": 40}, True, "until the round's first step"),
        (False, {**NEW_PAIR, "resumed": 39}, False, "hold step 40 now"),
        (False, {"others": 0}, False, "no node is there"),
        (False, {"others": -1}, False, "no node is there"),  # etcd does not answer
        # while it hands over: it leaves once a round with others trained a step
        (True, {}, True, "alone holds"),  # the newcomer has not joined yet
        (True, {"others": -1}, True, "etcd does not answer"),  # the bound ends it
        (True, {"others": 0}, False, "no node is there"),  # the newcomer went
        (True, {**NEW_PAIR, "resumed": None}, True, "round's first step"),
        (True, {**NEW_PAIR, "resumed": 40, "step": 40}, True, "round's first step"),
        (True, {**NEW_PAIR, "resumed": 40, "step": 41}, False, "hold step 41 now"),
        (True, {"round": 5, "others": 0}, False, "no node is there"),  # it failed
        (True, {"round": 5}, True, "alone holds"),  # ... or comes again
    ],
)
def test_a_node_told_to_leave_trains_on_only_until_a_round_with_a_newcomer_trained_a_step(
    waiting: bool, kw: dict[str, object], keep: bool, why: str
) -> None:
    got, reason = hands_over(waiting, holding(**kw))
    assert got is keep and why in reason, reason


@pytest.mark.parametrize(
    ("kw", "alone"),
    [
        ({}, True),  # alone in its round
        ({"step": -1}, False),  # nothing trained
        ({"size": 3, "joined": 1}, False),  # one trained with it
        ({**NEW_PAIR, "resumed": None}, True),  # its newcomers have not trained with it yet
        ({**NEW_PAIR, "resumed": 39}, False),  # they have: the round trained step 40
        ({"on_disk": True}, True),  # a checkpoint is older than what it holds
    ],
)
def test_a_node_holds_the_newest_state_alone_until_another_member_trained_with_it(
    kw: dict[str, object], alone: bool
) -> None:
    """What a node whose own worker failed asks before it steps out (``lobby.step_out``):
    the others would go on from an older state."""
    assert holds_alone(holding(**kw)) is alone


def test_a_handover_holds_the_first_signal_back_once_and_leaves_with_it() -> None:
    """The owner of the wait (``handing.Handover``): the first signal held back while the
    state would go with the node; a second one, the state handed over, or the bound end
    the wait, and the node leaves as the first signal asked; it is tried once."""
    expired: list[int] = []
    h = Handover(30.0, expired.append)
    assert h.consider(signal.SIGTERM, holding) == (True, None) and h.active
    assert h.consider(None, holding) == (True, None)  # handing over
    assert h.consider(signal.SIGINT, holding) == (False, signal.SIGTERM) and not h.active
    assert h.consider(signal.SIGTERM, holding) == (False, signal.SIGTERM)  # once: it leaves

    h = Handover(30.0, expired.append)
    assert h.consider(signal.SIGTERM, holding)[0]
    shared = lambda: holding(**NEW_PAIR, resumed=39)  # noqa: E731  # the newcomer has it
    assert h.consider(None, shared) == (False, signal.SIGTERM) and not h.active

    h = Handover(30.0, expired.append)
    on_disk = lambda: holding(on_disk=True)  # noqa: E731
    assert h.consider(signal.SIGTERM, on_disk) == (False, signal.SIGTERM) and not h.active
    assert Handover(0.0, expired.append).consider(signal.SIGTERM, holding) == (
        False,
        signal.SIGTERM,
    )

    h = Handover(0.05, expired.append)
    assert h.consider(signal.SIGTERM, holding)[0]
    wait_until(lambda: expired == [signal.SIGTERM], 5, "the bound brings the signal back")
    assert h.consider(signal.SIGTERM, holding) == (False, signal.SIGTERM)
