"""The tree stays lint-clean, formatted and type-checked: the README's test command checks it."""

from __future__ import annotations

import ast
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


@pytest.mark.parametrize("package", ["elastic/agent", "elastic/worker"])
def test_each_package_map_names_its_modules(package: str) -> None:
    """The map in a package's docstring names every module there (as an entry, or in
    an entry's line: ``zygote: its process``), and names no module that is gone."""
    base = ROOT / package
    doc = ast.get_docstring(ast.parse((base / "__init__.py").read_text())) or ""
    rows = [line.split() for line in doc.splitlines() if line.startswith("    ")]
    modules = {p.stem for p in base.glob("*.py") if p.stem != "__init__"}
    entries = {row[0] for row in rows}
    words = {w.strip("(),:;") for row in rows for w in row}
    assert entries <= modules, f"named but missing: {entries - modules}"
    assert modules <= words, f"not in the map: {modules - words}"
