"""Each rank's RNG states are kept per step, so a restore to the step before a snapshot
that was cut short still finds its own; they are in their file when ``save`` returns (a
worker killed right after its snapshot still has them), in a format read without pickle."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import ROOT

from elastic.worker import rng


def test_the_rng_of_an_older_step_survives_a_newer_save(tmp_path: Path) -> None:
    torch.manual_seed(1)
    rng.save(str(tmp_path), 0, 4)
    expected = torch.rand(3)
    rng.save(str(tmp_path), 0, 5)  # step 5's snapshot then never completes
    torch.rand(100)
    rng.restore(str(tmp_path), 0, 4)
    assert torch.equal(torch.rand(3), expected)


def test_only_the_newest_files_are_kept(tmp_path: Path) -> None:
    for step in range(1, 8):
        rng.save(str(tmp_path), 3, step)
    kept = sorted(p.name for p in tmp_path.glob("rng-rank3-*"))
    assert kept == [f"rng-rank3-step{s}.rng" for s in (5, 6, 7)]


def test_the_file_is_in_place_when_save_returns(tmp_path: Path) -> None:
    """What a SIGKILL right after the snapshot leaves: the file as save() left it, read by
    another process's restore (here: the states of this one, changed since)."""
    torch.manual_seed(7)
    rng.save(str(tmp_path), 1, 12)
    expected = torch.rand(3)
    data = (tmp_path / "rng-rank1-step12.rng").read_bytes()
    torch.rand(10)
    assert rng.decode(data)[0] == 12
    rng.restore(str(tmp_path), 1, 12)
    assert torch.equal(torch.rand(3), expected)


def test_every_generator_comes_back_from_the_file(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(3)
    np.random.randn()  # a Gaussian cached by NumPy is part of its state
    torch.manual_seed(3)
    rng.save(str(tmp_path), 2, 9)
    expected = (random.random(), random.gauss(0, 1), np.random.randn(), torch.rand(1))
    random.random(), np.random.rand(), torch.rand(1)
    rng.restore(str(tmp_path), 2, 9)
    assert (random.random(), random.gauss(0, 1), np.random.randn(), torch.rand(1)) == expected


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) - 7],  # cut short
        lambda b: b"junk" + b,  # not ours
        lambda b: b[:30] + b"{" + b[31:],  # its header broken
        lambda b: rng.encode(8, rng.capture()),  # of another step
        lambda b: rng.encode(9, {**rng.capture(), "torch": torch.zeros(7, dtype=torch.uint8)}),
    ],
    ids=["cut-short", "foreign", "bad-header", "other-step", "refused-by-torch"],
)
def test_a_damaged_file_is_named_and_reseeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object
) -> None:
    rng.save(str(tmp_path), 0, 9)
    path = tmp_path / "rng-rank0-step9.rng"
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with caplog.at_level(logging.INFO, "elastic.state"):
        rng.restore(str(tmp_path), 0, 9)
    drawn = torch.rand(3)
    rng.reseed(9, 0)
    assert torch.equal(drawn, torch.rand(3))
    assert [r.levelname for r in caplog.records] == ["WARNING"], caplog.text
    assert str(path) in caplog.text


def test_a_rank_without_its_file_of_the_step_is_reseeded_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng.save(str(tmp_path), 0, 3)  # of an older step only: this rank ran on this node
    with caplog.at_level(logging.INFO, "elastic.state"):
        rng.restore(str(tmp_path), 0, 6)
        rng.restore(str(tmp_path), 5, 6)  # a rank new on this node: nothing to say
    assert len(caplog.records) == 1 and "rank 0" in caplog.text, caplog.text


def test_a_process_without_numpy_saves_and_restores(tmp_path: Path) -> None:
    """NumPy is not a dependency of torch or of ours: a worker without it keeps its RNG."""
    shim = tmp_path / "no-numpy" / "numpy"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    code = (
        "import sys, torch; from elastic.worker import rng\n"
        "assert 'numpy' not in sys.modules\n"
        f"rng.save({str(tmp_path)!r}, 0, 1); want = torch.rand(2); torch.rand(5)\n"
        f"rng.restore({str(tmp_path)!r}, 0, 1); assert torch.equal(torch.rand(2), want)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{shim.parent}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
