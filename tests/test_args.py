"""elastic-run accepts every torchrun 2.13 flag, both spellings, and reads PET_* the same way."""

from __future__ import annotations

import pytest
from torch.distributed.run import get_args_parser

from elastic.agent.args import build_parser, parse_args

# Defaults that differ on purpose: the rendezvous backend (etcd v3, not static), the
# empty-string spelling of "no filters", and nproc_per_node (checked below).
DIFFERENT_DEFAULTS = {
    "rdzv_backend",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "nproc_per_node",
}


def _options(parser) -> dict[str, object]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_every_torchrun_flag_is_accepted_with_the_same_meaning() -> None:
    theirs, ours = _options(get_args_parser()), _options(build_parser())
    missing = set(theirs) - set(ours)
    assert not missing, f"torchrun flags elastic-run lacks: {sorted(missing)}"
    for opt, action in theirs.items():
        mine = ours[opt]
        assert mine.dest == action.dest, opt
        assert (mine.nargs == 0) == (action.nargs == 0), f"{opt}: switch vs value"
        if action.dest not in DIFFERENT_DEFAULTS and opt.startswith("--"):
            assert mine.default == action.default, f"{opt}: {mine.default!r} != {action.default!r}"
    # None there means "1, or one per --devices device": the same default for torchrun's use
    assert ours["--nproc-per-node"].default is None
    assert theirs["--nproc-per-node"].default == "1"


def test_pet_variables_override_defaults_and_flags_override_pet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PET_NNODES", "2:3")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "etcd:2379")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    ns = parse_args(["--max-restarts", "1", "t.py", "--lr", "0.1"])
    assert (ns.nnodes, ns.rdzv_endpoint, ns.standalone, ns.max_restarts) == (
        "2:3",
        "etcd:2379",
        True,
        1,
    )
    assert ns.training_script_args == ["--lr", "0.1"]


def test_both_spellings() -> None:
    a = parse_args(["--nproc_per_node", "3", "--rdzv_id", "x", "-r", "1", "-t", "2", "t.py"])
    b = parse_args(
        ["--nproc-per-node", "3", "--rdzv-id", "x", "--redirects", "1", "--tee", "2", "t.py"]
    )
    assert vars(a) == vars(b)
