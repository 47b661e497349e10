"""elastic-run accepts every torchrun 2.13 flag, both spellings, and reads PET_* the same way."""

from __future__ import annotations

import pytest
from torch.distributed.run import get_args_parser

from elastic.agent.args import UsageError, build_parser, parse_args

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


def test_abbreviations_as_torchrun_accepts_them() -> None:
    ns = parse_args(["--redirect=3", "--max-restart", "2", "t.py"])  # torch's own tests do
    assert (ns.redirects, ns.max_restarts) == ("3", 2)


def test_a_typo_names_the_closest_flag_and_prints_the_usage() -> None:
    with pytest.raises(UsageError) as e:
        parse_args(["--nprocs-per-node", "2", "t.py"])
    assert "did you mean --nproc-per-node?" in str(e.value)
    assert e.value.usage.startswith("usage: elastic-run [options] training_script")


def test_help_is_grouped_shows_defaults_and_hides_underscore_spellings() -> None:
    text = build_parser().format_help()
    for group in ("job size:", "rendezvous:", "workers:", "fault tolerance:", "checkpoints"):
        assert group in text
    assert "metrics:" in text and "logging" in text and "no effect" in text
    assert "--nproc-per-node" in text and "--rdzv_endpoint" not in text
    assert "(default: 1:1)" in text and "(default: 0)" in text  # --nnodes, --max-restarts
    assert "arguments for the training script" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("elastic-run ")


@pytest.mark.parametrize("conf", ["join_timeout=30,store_type=tcp", "use_libuv=1,rank=0"])
def test_rdzv_conf_keys_of_torchruns_backends_are_accepted(conf: str) -> None:
    from rendezvous.config import RdzvConf, build_options

    build_options("127.0.0.1", "j", 1, 1, RdzvConf.parse(conf))


def test_a_key_no_backend_knows_is_ignored_with_a_warning_naming_the_closest() -> None:
    """As torchrun ignores it; a misspelt timeout is named, with the key it resembles."""
    from rendezvous.config import RdzvConf, build_options

    conf = RdzvConf.parse("join_timout=30,zzz=1")
    _, rdzv = build_options("127.0.0.1", "j", 1, 1, conf)
    assert rdzv.join_timeout == 600.0 and conf.unknown == ("join_timout", "zzz")
    assert conf.warnings() == [
        "--rdzv-conf join_timout: no rendezvous reads this key; ignored "
        "(did you mean join_timeout?)",
        "--rdzv-conf zzz: no rendezvous reads this key; ignored",
    ]


def test_quotes_a_shell_would_have_removed_are_removed() -> None:
    """PyTorch's own launcher tests pass --rdzv-conf='join_timeout=5,...' in a list."""
    from rendezvous.config import RdzvConf

    conf = RdzvConf.parse("'join_timeout=5,last_call_timeout=1,timeout=5'")
    assert (conf.join_timeout, conf.last_call_timeout, conf.unknown) == (5.0, 1.0, ())
    assert conf.warnings() == ["--rdzv-conf: the quotes around its value were removed"]


def test_the_scripts_arguments_are_never_read_as_ours() -> None:
    """torchrun users' scripts take --checkpoint, --worker, --max...: prefixes of our own
    flags, which argparse alone would take (or refuse as ambiguous)."""
    ns = parse_args(["--nproc-per-node", "2", "train.py", "--checkpoint", "x", "--worker", "--max"])
    assert ns.training_script == "train.py" and ns.nproc_per_node == "2"
    assert ns.training_script_args == ["--checkpoint", "x", "--worker", "--max"]
    ns = parse_args(["-r", "3", "--rdzv-conf=join_timeout=5", "-m", "pkg.mod", "--tee", "1"])
    assert (ns.redirects, ns.rdzv_conf, ns.module) == ("3", "join_timeout=5", True)
    assert (ns.training_script, ns.training_script_args) == ("pkg.mod", ["--tee", "1"])
