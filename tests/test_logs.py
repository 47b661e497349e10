"""Worker output as torchrun shows it: unprefixed console, --redirects, --tee, filters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT

ECHO = str(ROOT / "tests" / "scripts" / "echo.py")
pytestmark = pytest.mark.slow


def run(tmp_path: Path, *flags: str, script_args: tuple[str, ...] = ()) -> tuple[str, str, Path]:
    logs = tmp_path / "logs"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic",
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(logs),
            "--rdzv-id",
            "logs",
            "--node-id",
            "n",
            *flags,
            ECHO,
            *script_args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr, logs / "logs_n"


def test_console_lines_are_unprefixed_without_tee(tmp_path: Path) -> None:
    out, err, _ = run(tmp_path)
    assert sorted(out.splitlines()) == ["hello from 0", "hello from 1"]
    assert "\ncomplaint from 1\n" in "\n" + err


def test_redirects_send_output_to_files_only(tmp_path: Path) -> None:
    out, err, run_dir = run(tmp_path, "--redirects", "3")
    assert "hello" not in out and "complaint" not in err
    for r in (0, 1):
        d = run_dir / "attempt_0" / str(r)
        assert (d / "stdout.log").read_text() == f"hello from {r}\n"
        assert (d / "stderr.log").read_text() == f"complaint from {r}\n"


def test_tee_writes_files_and_console_and_per_rank_syntax(tmp_path: Path) -> None:
    out, err, run_dir = run(tmp_path, "--tee", "1", "--redirects", "1:2")
    assert "[default0]:hello from 0" in out and "[default1]:hello from 1" in out
    assert (run_dir / "attempt_0" / "0" / "stdout.log").read_text() == "hello from 0\n"
    assert "\ncomplaint from 0\n" in err  # rank 0's stderr: console only, not tee'd
    assert "complaint from 1" not in err  # rank 1's stderr: redirected to its file
    assert (run_dir / "attempt_0" / "1" / "stderr.log").read_text() == "complaint from 1\n"


def test_local_ranks_filter(tmp_path: Path) -> None:
    out, err, _ = run(tmp_path, "--local-ranks-filter", "1")
    assert "hello from 1" in out and "hello from 0" not in out
    assert "complaint from 0" not in err


def test_every_attempt_keeps_its_logs(tmp_path: Path) -> None:
    _, err, run_dir = run(
        tmp_path, "--redirects", "3", "--max-restarts", "1", script_args=("--fail-first",)
    )
    attempts = sorted(p.name for p in run_dir.iterdir())
    assert attempts == ["attempt_0", "attempt_1"]
    for a in attempts:
        assert (run_dir / a / "1" / "stdout.log").read_text() == "hello from 1\n"
    assert "rank 1 (local_rank 1) on n: exit code 3" in err


def test_duplicate_filters_copy_matching_lines(tmp_path: Path) -> None:
    out, _, run_dir = run(tmp_path, "--duplicate-stdout-filters", "from 1")
    assert "hello from 0" in out
    filtered = (run_dir / "attempt_0" / "filtered_stdout.log").read_text()
    assert filtered == "[default1]:hello from 1\n"


def test_prefix_template_applies_to_teed_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = "<${role_name}|${rank}|${local_rank}> "
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", template)
    out, err, _ = run(tmp_path, "--tee", "3")
    assert "<default|1|1> hello from 1" in out and "<default|0|0> complaint from 0" in err
