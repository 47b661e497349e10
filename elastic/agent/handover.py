"""Whether a node told to leave first hands the job's newest state to a node joining.

A node holds the job's newest state alone when no other member of its round trained with
it: it runs alone, or every other member joined in this round and has not trained a step
with it yet (their workers are still starting, or receiving the state). The state is
then in its workers' memory and its node's shared memory only, both gone once it leaves.
Told to leave (SIGTERM: a spot node reclaimed) in that case, while another node is
joining (registered, or on its way: a newcomer whose workers start ahead says so before
it registers, ``rendezvous.arrival``), it keeps training until a round with that node
has trained one step: the newcomer's ranks received the state over the process group
and put it in their node's snapshot slot before that step (``Snapshotter.keep``), so
nothing is lost when this node goes. Anywhere else it leaves at once: other members of
its round hold what it trained, no step was trained, the state goes to
``--checkpoint-dir`` as it leaves, or no node is there to take it. The agent bounds the
wait (``--handover-timeout``) and leaves at once on a second signal. The same facts say
whether a node whose own worker failed may step out of the job while the others go on
(``holds_alone``, for ``lobby.step_out``): not while they would go on from older state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Holding:
    """What a node knows of the state it holds, at one turn of its loop."""

    round: int  # the round it runs in now
    size: int  # that round's nodes
    joined: int  # ... of them new in it
    newcomer: bool  # this node is one of those
    others: int  # nodes but this one registered in the job or on their way (-1: unknown)
    step: int  # its workers' newest step (0: none trained; -1: none, or not elastic.State)
    resumed: int | None  # the step they resumed from in this round (None: not said yet)
    on_disk: bool  # --checkpoint-dir: the newest state is saved as it leaves anyway

    @property
    def veterans(self) -> int:
        """The other members that were in the round before: they trained with this node."""
        return self.size - self.joined - (0 if self.newcomer else 1)


def shared(h: Holding) -> str | None:
    """Why the other members of its round hold what this node trained (None: they may
    not): some trained with it in the round before, or the round trained a step since
    they all resumed from the newest state any of them held. A newcomer may bring the
    newest state (its snapshot, kept while it was out of the job) until that step."""
    if h.size <= 1:
        return None
    if not h.newcomer and h.veterans > 0:
        return f"the other nodes of round {h.round} hold what it trained"
    if h.resumed is not None and h.step > h.resumed:
        return f"the other nodes of round {h.round} hold step {h.step} now"
    return None


def holds_alone(h: Holding) -> bool:
    """This node may hold the job's newest state alone: it trained, and no other member
    of its round holds what it did (``shared``)."""
    return h.step > 0 and shared(h) is None


def hands_over(waiting: bool, h: Holding) -> tuple[bool, str]:
    """(keep training, why). ``waiting``: it already trains on to hand the state over
    (else the signal just came)."""
    if h.on_disk:
        return False, "the newest state goes to --checkpoint-dir as this node leaves"
    if h.step <= 0:  # a fresh newcomer's worker says 0 as it receives the state
        return False, "no step trained: nothing to hand over"
    why = shared(h)
    if why is not None:
        return False, why
    if h.size > 1:
        return True, (
            f"the nodes that joined round {h.round} do not hold the job's newest state "
            f"(step {h.step}) until the round's first step"
        )
    if h.others < 0 and waiting:
        return True, "etcd does not answer: the round with the newcomer may yet form"
    if h.others <= 0:
        return False, "no node is there to take the newest state"
    return True, (
        f"this node alone holds the job's newest state (step {h.step}): training on until "
        f"the {h.others} node(s) joining have it"
    )
