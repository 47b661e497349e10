"""The README and docs/ document what the code does: the two commands on top, the
rdzv-conf keys, every metric, and links that lead somewhere."""

from __future__ import annotations

import re

from harness import ROOT

from rendezvous.config import KEYS

README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def test_every_rdzv_conf_key_is_documented_as_in_the_code() -> None:
    for key, (_, _, help_text) in KEYS.items():
        assert f"| `{key}` | {help_text} |" in REFERENCE, f"docs lack rdzv-conf key {key}"


def test_every_metric_the_agent_exports_is_in_the_metrics_table() -> None:
    names = set()
    for path in (ROOT / "elastic").rglob("*.py"):
        names |= set(re.findall(r'"elastic_run_([a-z_]+)"', path.read_text()))
    table = REFERENCE.split("## Metrics", 1)[1]
    for name in sorted(names):
        assert re.search(rf"`{name}(_total|_info)?[`{{ ]", table), f"metrics table lacks {name}"


def test_readme_starts_with_the_run_and_test_commands() -> None:
    first_block = README.split("```sh", 1)[1].split("```", 1)[0]
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert commands == [
        ".ci/install && elastic-run --nproc-per-node 2 examples/train_ddp.py",
        ".ci/install --test && python3 -m pytest -q -n 2 --dist loadfile",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run must run the README's test command"


def test_links_lead_to_files_that_exist() -> None:
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
