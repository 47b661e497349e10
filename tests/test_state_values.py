"""``State``'s values as attributes: the script's names never meet State's own."""

from __future__ import annotations

import pytest
import torch

from elastic.worker.state import RESERVED, State


def test_every_name_state_uses_is_refused_for_a_value_and_said_why() -> None:
    assert {"commit", "restore", "run", "snapshot", "flush", "close", "heartbeat"} <= RESERVED
    assert {"stats", "policy", "step", "snapshot_policy"} <= RESERVED
    for name in sorted(RESERVED - {"snapshot_policy"}):
        with pytest.raises(ValueError, match=f"'{name}' is a name State uses itself"):
            State(**{name: 5})


def test_names_of_internals_are_plain_values_stored_and_read_back() -> None:
    """What State keeps for itself lives on one object: a value may have any other name,
    ``values``, ``cadence`` or ``_comm`` included."""
    names = ("values", "objects", "cadence", "hooks", "group", "ctl", "comm", "restored")
    state = State(**dict.fromkeys(names, 7), epoch=0)
    for name in names:
        assert getattr(state, name) == 7
        setattr(state, name, 8)
        assert getattr(state, name) == 8
    state.epoch = 3
    assert state.epoch == 3 and state.step == 0
    assert state._core.values["epoch"] == 3  # what is saved
    assert state.stats.snapshots == 0 and state.policy.every == "auto"


def test_objects_are_attributes_too_and_an_undeclared_name_is_an_error() -> None:
    model = torch.nn.Linear(2, 2)
    state = State(model=model)
    assert state.model is model
    other = torch.nn.Linear(2, 2)
    state.model = other
    assert state._core.objects["model"] is other
    with pytest.raises(AttributeError, match=r"State\(\.\.\., best_loss=\.\.\.\)"):
        state.best_loss = 0.5  # it would not be saved: say how to declare it
    with pytest.raises(AttributeError, match="cannot be set"):
        state.stats = 7  # type: ignore[misc]
    with pytest.raises(AttributeError, match="no value or object 'epoch'"):
        _ = state.epoch


def test_the_round_is_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``state.round`` follows the environment (and, once formed, the process group) of
    the round running now: a live re-formation updates both."""
    state = State(epoch=0)
    for var, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    r = state.round
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size) == (3, 4, 1, 2)
    assert (r.group_rank, r.restart_count) == (1, 2)
    monkeypatch.setenv("RANK", "0")  # after a re-formation
    assert state.round.rank == 0
    assert state.round.device == torch.device("cpu") or torch.cuda.is_available()
    with pytest.raises(ValueError, match="'round' is a name State uses itself"):
        State(round=1)


class Loader:
    """An object told of each commit, as a framework adapter's is."""

    def __init__(self) -> None:
        self.commits = 0

    def on_commit(self) -> None:
        self.commits += 1

    def state_dict(self) -> dict[str, int]:
        return {"commits": self.commits}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.commits = d["commits"]


def test_an_object_set_anew_is_the_one_told_of_the_next_commits() -> None:
    """``commit()`` finds the objects it tells once, not at every step: setting one
    anew is what makes it look again."""
    first, second = Loader(), Loader()
    state = State(loader=first, model=torch.nn.Linear(2, 2))
    state.commit()
    state.loader = second
    state.commit()
    state.commit()
    assert (first.commits, second.commits, state.step) == (1, 2, 3)
