"""Every example runs, under elastic-run where it is distributed, in a short mode."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import ROOT

pytestmark = pytest.mark.slow


def elastic_run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=str(ROOT))


def test_readme_first_command_runs_train_ddp() -> None:
    done = elastic_run("--nproc-per-node", "2", "examples/train_ddp.py", "--epochs", "2")
    assert done.returncode == 0, done.stderr
    assert "[rank0]: epoch 1: loss" in done.stdout
    assert "world size 2" in done.stdout
