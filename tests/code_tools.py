"""The linters and the type checker, started once the tests are collected so they run
beside the first tests (mypy alone is half a minute of one core) and read by
test_code_quality when its turn comes."""

from __future__ import annotations

import subprocess
import sys

from harness import ROOT

TOOLS = {
    "ruff-check": ["ruff", "check", "."],
    "ruff-format": ["ruff", "format", "--check", "."],
    "mypy": ["mypy"],  # configured in pyproject.toml: elastic and rendezvous, strict
}
_running: dict[str, subprocess.Popen[str]] = {}


def start(names: list[str]) -> None:
    for name in names:
        if name not in _running:
            _running[name] = subprocess.Popen(
                [sys.executable, "-m", *TOOLS[name]],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )


def result(name: str) -> tuple[int, str]:
    """The tool's exit code and output (started now if it was not yet)."""
    start([name])
    p = _running.pop(name)
    out, _ = p.communicate(timeout=300)
    return p.returncode, out


def stop() -> None:
    """Those no test read (the run was cut short): they end with the session."""
    for p in _running.values():
        p.kill()
        p.wait()
    _running.clear()
