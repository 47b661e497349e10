"""The README documents what the code does: rdzv-conf keys, and the two commands on top."""

from __future__ import annotations

from harness import ROOT

from rendezvous.config import KEYS

README = (ROOT / "README.md").read_text()


def test_every_rdzv_conf_key_is_documented_as_in_the_code() -> None:
    for key, (_, _, help_text) in KEYS.items():
        assert f"| `{key}` | {help_text} |" in README, f"README lacks rdzv-conf key {key}"


def test_readme_starts_with_the_run_and_test_commands() -> None:
    first_block = README.split("```sh", 1)[1].split("```", 1)[0]
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert commands == [
        ".ci/install && elastic-run --nproc-per-node 2 examples/train_ddp.py",
        ".ci/install --test && python3 -m pytest -q",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run must run the README's test command"
