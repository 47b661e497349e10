"""Each rank's RNG states are kept per step, so a restore to the step before a snapshot
that was cut short still finds its own; they are read at the step and written off the
training thread."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
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
    rng.flush()
    kept = sorted(p.name for p in tmp_path.glob("rng-rank3-*.pt"))
    assert kept == [f"rng-rank3-step{s}.pt" for s in (5, 6, 7)]


def test_the_training_thread_reads_the_states_and_never_writes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    writer: list[str] = []
    write = rng._write

    def slow(*args: Any) -> None:
        writer.append(threading.current_thread().name)
        release.wait(10)
        write(*args)

    monkeypatch.setattr(rng, "_write", slow)
    torch.manual_seed(7)
    rng.save(str(tmp_path), 0, 1)  # returns with the file not yet written
    expected = torch.rand(3)
    assert not list(tmp_path.glob("rng-*.pt"))
    torch.rand(10)
    release.set()
    rng.restore(str(tmp_path), 0, 1)  # waits for the write in flight
    assert torch.equal(torch.rand(3), expected)
    assert writer == ["rng-writer"]


def test_every_generator_comes_back_from_the_file(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    rng.save(str(tmp_path), 2, 9)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.random(), np.random.rand(), torch.rand(1)
    rng.restore(str(tmp_path), 2, 9)  # the file loads with weights_only: no NumPy objects
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
