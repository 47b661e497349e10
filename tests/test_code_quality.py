"""The tree stays lint-clean, formatted and type-checked: the README's test command checks it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import ROOT


@pytest.mark.parametrize(
    "tool",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy"],  # configured in pyproject.toml: elastic and rendezvous, strict
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_tool_is_clean(tool: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *tool], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
