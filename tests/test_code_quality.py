"""The tree stays lint-clean, formatted and type-checked: the README's test command checks it."""

from __future__ import annotations

import ast

import pytest
from code_tools import TOOLS, result
from harness import ROOT


@pytest.mark.parametrize("tool", list(TOOLS))
def test_tool_is_clean(tool: str) -> None:
    code, out = result(tool)  # started beside the first tests (conftest)
    assert code == 0, out


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
