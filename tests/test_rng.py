"""Each rank's RNG states are kept per step, so a restore to the step before a snapshot
that was cut short still finds its own."""

from __future__ import annotations

from pathlib import Path

import torch

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
    kept = sorted(p.name for p in tmp_path.glob("rng-rank3-*.pt"))
    assert kept == [f"rng-rank3-step{s}.pt" for s in (5, 6, 7)]
