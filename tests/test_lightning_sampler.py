"""The Lightning adapter's rules. ResumableSampler, its sampler: DistributedSampler's order
and split when nothing happens, and the rest of the epoch, once, over any new world size;
which of a snapshot and the script's checkpoint file a Trainer resumes from."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import need
from torch.utils.data import DistributedSampler

try:
    from elastic.integrations.lightning import ResumableSampler
except ImportError:
    ResumableSampler = None  # type: ignore[assignment,misc]


@pytest.fixture(autouse=True)
def _lightning() -> None:
    need(ResumableSampler is not None, "lightning is not installed (pip install -e '.[test]')")


def samplers(n: int, world: int, **kw: object) -> list[ResumableSampler]:
    data = list(range(n))
    return [
        ResumableSampler(DistributedSampler(data, world, r, **kw), 4, drop_batch=False)  # type: ignore[arg-type]
        for r in range(world)
    ]


@pytest.mark.parametrize("n", [96, 97, 5])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_unresumed_it_is_distributed_samplers_order(
    n: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    """A run without faults trains exactly the samples it would without the adapter."""
    for epoch in (0, 1):
        for r, mine in enumerate(samplers(n, world, shuffle=shuffle, drop_last=drop_last)):
            theirs = DistributedSampler(
                list(range(n)), world, r, shuffle=shuffle, drop_last=drop_last
            )  # type: ignore[arg-type]
            theirs.set_epoch(epoch)
            mine.set_epoch(epoch)
            assert list(mine) == list(theirs) and len(mine) == len(theirs)


@pytest.mark.parametrize("before,after", [(2, 1), (2, 3), (3, 2), (1, 2)])
@pytest.mark.parametrize("n", [96, 101])
def test_resumed_over_a_new_world_every_sample_once(before: int, after: int, n: int) -> None:
    """k batches trained at one world size, the rest at another: the epoch holds every
    sample once (a tail shorter than the world is padded, as DistributedSampler pads);
    the length stays a whole epoch's at the new size, and ``offset`` says how many of
    its batches the resumed iteration does not yield."""
    old = samplers(n, before)
    for s in old:
        s.set_epoch(3)
    k = 5
    trained = [i for s in old for i in list(s)[: k * 4]]
    state = old[0].state(batches=k)
    assert state["consumed"] == k * 4 * before and state["epoch"] == 3
    new = samplers(n, after)
    for s in new:
        s.load(state)
        s.set_epoch(3)  # Lightning sets the epoch again: the position stays
    rest = [i for s in new for i in s]
    assert sorted(set(trained + rest)) == list(range(n))
    assert len(trained + rest) - n == -(n - k * 4 * before) % after  # the padding only
    whole = -(-n // after)  # DistributedSampler's samples per rank
    yielded = -(-(n - k * 4 * before) // after)
    for s in new:
        assert len(s) == whole and len(list(s)) == yielded
        assert s.offset == -(-whole // 4) - -(-yielded // 4)
    # trained on after the resume: the position moves on from where it was
    again = new[0].state(batches=new[0].offset + 2)
    assert again["consumed"] == k * 4 * before + 2 * 4 * after


def test_a_new_epoch_starts_from_its_beginning() -> None:
    [s] = samplers(96, 1)
    s.load({"elastic_position": 1, "epoch": 0, "consumed": 40, "batches": 10})
    assert (len(list(s)), len(s), s.offset) == (56, 96, 10)
    s.set_epoch(1)
    assert (s.start, s.offset, len(list(s))) == (0, 0, 96)


def test_only_strategies_whose_checkpoint_every_rank_holds_whole_are_snapshotted() -> None:
    """FSDP, ModelParallel and DeepSpeed checkpoints are rank 0's alone or each rank's
    shard: no snapshot of the whole checkpoint there (ModelParallel's shards have their
    own: test_model_parallels_shards_are_snapshotted_to_the_checkpoint_dir)."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    from elastic.integrations.lightning import sharded

    assert sharded(DDPStrategy()) is None
    assert sharded(SingleDeviceStrategy("cpu")) is None
    assert sharded(FSDPStrategy()) == "FSDPStrategy"
    assert sharded(ModelParallelStrategy()) == "ModelParallelStrategy"


def test_model_parallels_and_fsdps_shards_are_snapshotted_to_the_checkpoint_dir() -> None:
    """FSDP2's DTensors and FSDP1's flat parameters (as get_state_dict reads them) are
    what DCP saves and re-shards: their shards go to --checkpoint-dir where it is given;
    DeepSpeed's format is its own."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
    )

    from elastic.integrations.lightning import shards_dir

    assert shards_dir(ModelParallelStrategy(), "/ckpt") == "/ckpt"
    assert shards_dir(ModelParallelStrategy(), None) is None
    assert shards_dir(ModelParallelStrategy(), "") is None
    assert shards_dir(FSDPStrategy(), "/ckpt") == "/ckpt"
    assert shards_dir(FSDPStrategy(), None) is None
    assert shards_dir(DDPStrategy(), "/ckpt") is None
    # made without its __init__, which asks for deepspeed: the rule reads only its class
    assert shards_dir(DeepSpeedStrategy.__new__(DeepSpeedStrategy), "/ckpt") is None


@pytest.mark.parametrize(
    ("snapshot", "file", "resumes"),
    [(-1, -1, False), (8, -1, True), (8, 5, True), (8, 8, False), (8, 12, False), (-1, 5, False)],
)
def test_a_snapshot_of_the_shards_is_resumed_only_where_newer_than_the_file(
    snapshot: int, file: int, resumes: bool
) -> None:
    from elastic.integrations.lightning import from_snapshot

    assert from_snapshot(snapshot, file) is resumes


def test_the_step_of_the_scripts_checkpoint_file_or_sharded_directory(tmp_path: Path) -> None:
    """Read without loading its tensors; a missing or foreign file is -1 (Lightning then
    says what is wrong with it)."""
    import torch

    from elastic.integrations.lightning import _file_step

    torch.save({"global_step": 12, "state_dict": {"w": torch.ones(3)}}, tmp_path / "last.ckpt")
    (tmp_path / "sharded.ckpt").mkdir()  # ModelParallel's own: shards, and meta.pt beside
    torch.save({"global_step": 20}, tmp_path / "sharded.ckpt" / "meta.pt")
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    assert _file_step(tmp_path / "last.ckpt") == 12
    assert _file_step(tmp_path / "sharded.ckpt") == 20
    assert _file_step(tmp_path / "junk.ckpt") == -1
    assert _file_step(tmp_path / "absent.ckpt") == -1
    assert _file_step(None) == -1


@pytest.mark.parametrize(
    ("snapshot", "peeked", "reads"),
    [(9, 5, False), (9, 9, False), (9, 12, True), (9, -1, True), (0, 0, False)],
)
def test_the_scripts_checkpoint_file_is_read_only_where_newer_than_the_snapshot(
    snapshot: int, peeked: int, reads: bool
) -> None:
    from elastic.integrations.lightning import reads_file

    assert reads_file(snapshot, peeked) is reads


def test_a_live_round_resumes_from_its_snapshot_without_reading_an_older_file(
    tmp_path: Path,
) -> None:
    """What a real Trainer's strategy is asked to load (``ckpt_path``) beside the snapshot
    of step 9: an older or as new file is never read (a live round used to read the
    script's whole last.ckpt, only to drop it); a newer one, or one whose step cannot be
    peeked, is read by Lightning's own reader as before."""
    import lightning.pytorch as pl
    import torch

    from elastic.integrations.lightning import ElasticLightning

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    strategy, real = trainer.strategy, trainer.strategy.load_checkpoint
    snapshot = {"global_step": 9, "from": "snapshot"}
    for step in (5, 9, 12):
        torch.save({"global_step": step, "w": torch.ones(1 << 16)}, tmp_path / f"{step}.ckpt")
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")

    def load(name: str) -> tuple[object, int]:
        reads = []

        def counted(path: str | Path, weights_only: bool | None = None) -> dict:
            reads.append(path)
            return real(path, weights_only)

        strategy.load_checkpoint = counted  # type: ignore[method-assign]
        ElasticLightning()._resume_from(trainer, snapshot)
        try:
            got = strategy.load_checkpoint(tmp_path / name)
        except Exception as e:  # Lightning's own error for a file it cannot read
            got = type(e)
        assert strategy.load_checkpoint == counted  # the adapter's wrapper is gone again
        return got, len(reads)

    assert load("5.ckpt") == (snapshot, 0)
    assert load("9.ckpt") == (snapshot, 0)
    got, reads = load("12.ckpt")
    assert isinstance(got, dict) and got["global_step"] == 12 and reads == 1
    got, reads = load("junk.ckpt")
    assert reads == 1 and not isinstance(got, dict), got


class _Net:
    """Stands for a LightningModule: ``made_anew`` asks only where fit() could find it."""


_CACHED = _Net()  # a module-level one: fit() finds it again in its globals


def test_a_module_is_kept_live_only_where_fit_makes_it_anew() -> None:
    """A sharded module is cut over one group: the workers are kept through a change only
    where each fit() makes its own, as far as can be told: not alive before run(), not in
    fit's closure (cached there), globals, bound object or partial arguments."""
    import functools
    import weakref

    from elastic.integrations.lightning import made_anew

    fresh = _Net()

    def makes() -> None:
        _Net()

    assert made_anew(fresh, weakref.WeakSet(), makes)
    assert not made_anew(fresh, weakref.WeakSet([fresh]), makes)  # made before run()
    cache: list[_Net] = []
    kept = fresh

    def closes_over() -> None:
        cache.append(kept)

    assert not made_anew(fresh, weakref.WeakSet(), closes_over)
    assert not made_anew(_CACHED, weakref.WeakSet(), makes)  # in fit's globals

    class Job:
        def __init__(self) -> None:
            self.model = fresh

        def fit(self) -> None: ...

    assert not made_anew(fresh, weakref.WeakSet(), Job().fit)
    assert not made_anew(fresh, weakref.WeakSet(), functools.partial(lambda m: None, fresh))
    assert made_anew(fresh, weakref.WeakSet(), functools.partial(lambda m: None, None))
