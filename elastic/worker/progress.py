"""Training progress, reported by workers, exported on their agent's ``/metrics``.

Under elastic-run each worker has ``PROMETHEUS_MULTIPROC_DIR`` pointing into its node's
shared-memory directory; prometheus-client writes the values there and the agent merges
them into its endpoint. Outside elastic-run (torchrun, plain python) this does nothing.
``State.commit()`` reports by itself; scripts without State call ``elastic.report``.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

from elastic import contract
from elastic.contract import MULTIPROC_ENV, NODE_ID_ENV

# seconds between writes of the step metrics: a scrape comes every few seconds, a step
# may come every millisecond, and each write is a locked store in a shared file
METRICS_EVERY = 0.2

_metrics: dict[str, Any] | None = None
_last: tuple[float, float] | None = None  # (time, samples) at the previous report
_parents: dict[str, Any] = {}  # the metrics, declared once per process
_marked: contract.ControlBlock | None = None  # the block told this worker reports
_written: float | None = None  # monotonic time the step metrics were last written
_pending: list[Any] = [None, None, 0]  # step, loss, samples reported since then


def _get() -> dict[str, Any] | None:
    global _metrics
    if _metrics is not None:
        return _metrics or None
    if not os.environ.get(MULTIPROC_ENV):
        _metrics = {}
        return None
    if not _parents:
        _parents.update(_declare())
    env = os.environ
    labels = {
        "job": env.get("TORCHELASTIC_RUN_ID", ""),
        "node": env.get(NODE_ID_ENV, ""),
        "rank": env.get("RANK", "0"),
        "local_rank": env.get("LOCAL_RANK", "0"),
    }
    _metrics = {name: parent.labels(**labels) for name, parent in _parents.items()}
    return _metrics


def relabel() -> None:
    """The worker's rank changed (a live re-formation): report under the new labels."""
    global _metrics, _last
    if _metrics:
        flush()
        _metrics, _last = None, None


def _declare() -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram

    names = ["job", "node", "rank", "local_rank"]

    def gauge(name: str, doc: str) -> Any:
        return Gauge(name, doc, names, multiprocess_mode="livemostrecent")

    def counter(name: str, doc: str) -> Any:
        return Counter(name, doc, names)

    def histogram(name: str, doc: str) -> Any:
        return Histogram(
            name,
            doc,
            names,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, float("inf")),
        )

    return {
        "step": gauge("elastic_run_training_step", "Optimizer steps done"),
        "loss": gauge("elastic_run_training_loss", "Loss the script reported last"),
        "samples": counter("elastic_run_training_samples", "Samples this worker trained on"),
        "rate": gauge(
            "elastic_run_training_samples_per_second",
            "Samples per second between the last two reports",
        ),
        "snapshot": histogram(
            "elastic_run_snapshot_seconds", "Seconds a snapshot blocked the training thread"
        ),
        "snapshot_bytes": gauge("elastic_run_snapshot_bytes", "Size of the newest snapshot"),
        "blocked": counter(
            "elastic_run_snapshot_blocked_seconds",
            "Seconds the training thread waited for snapshots",
        ),
        "ckpt": histogram(
            "elastic_run_checkpoint_write_seconds",
            "Seconds to write a checkpoint file (in the background)",
        ),
        "ckpt_bytes": counter(
            "elastic_run_checkpoint_written_bytes", "Bytes of checkpoint files written"
        ),
        "ckpt_failures": counter(
            "elastic_run_checkpoint_failures",
            "Checkpoints (or snapshots) that could not be written",
        ),
        "interval": gauge(
            "elastic_run_snapshot_interval_steps",
            "Steps between snapshots (--snapshot-every, or chosen by the budget)",
        ),
        "at_risk": gauge(
            "elastic_run_snapshot_steps_at_risk",
            "The most committed steps a crash can lose at the current interval",
        ),
        "cost": gauge(
            "elastic_run_snapshot_cost_seconds",
            "Measured time a snapshot adds to training (blocking and competing for cores)",
        ),
        "step_time": gauge(
            "elastic_run_step_seconds", "Measured time of a step without a snapshot in it"
        ),
        "restore": gauge("elastic_run_restore_seconds", "Seconds the last restore took"),
        "restore_bytes": gauge("elastic_run_restore_bytes", "Bytes the last restore loaded"),
    }


def report(step: int | None = None, loss: float | None = None, samples: int | None = None) -> None:
    """Progress of this worker: ``samples`` trained on since the last report. Also tells
    the agent the worker is alive (see --worker-hang-timeout), at every report; the
    metrics take the latest figures every ``METRICS_EVERY`` seconds."""
    global _marked, _written
    block = contract.worker_block()
    if block is not None:
        if block is not _marked:
            block.mark(contract.REPORTS)
            _marked = block
        block.beat(step)
    m = _get()
    if m is None:
        return
    pending = _pending
    if step is not None:
        pending[0] = step
    if loss is not None:
        pending[1] = loss
    if samples:
        pending[2] += samples
    now = time.monotonic()
    if _written is None or now - _written >= METRICS_EVERY:
        if _written is None:
            atexit.register(flush)  # a script need not close its State
        _written = now
        _write(m, now)


def _write(m: dict[str, Any], now: float) -> None:
    global _last
    step, loss, samples = _pending
    _pending[:] = [None, None, 0]
    if step is not None:
        m["step"].set(step)
    if loss is not None:
        m["loss"].set(float(loss))
    if samples:
        m["samples"].inc(samples)
        if _last is not None and now > _last[0]:
            m["rate"].set(samples / (now - _last[0]))
        _last = (now, samples)


def flush() -> None:
    """Write what the throttle holds back (before the labels change, or at the end)."""
    m = _get()
    if m is not None and _pending != [None, None, 0]:
        _write(m, time.monotonic())


def snapshot(seconds: float, nbytes: int) -> None:
    """A snapshot taken: what it blocked the training thread for, and its size."""
    m = _get()
    if m is not None:
        m["snapshot"].observe(seconds)
        m["snapshot_bytes"].set(nbytes)
        m["blocked"].inc(seconds)


def cadence(interval: int, cost: float, step: float, at_risk: int) -> None:
    """The snapshot interval the ranks agreed on, and the figures it came from."""
    m = _get()
    if m is not None:
        m["interval"].set(interval)
        m["at_risk"].set(at_risk)
        m["cost"].set(cost)
        m["step_time"].set(step)


def waited(seconds: float) -> None:
    """optimizer.step() waited this long for a snapshot's background copy."""
    m = _get()
    if m is not None:
        m["blocked"].inc(seconds)


def checkpoint(ok: bool, seconds: float, nbytes: int) -> None:
    m = _get()
    if m is None:
        return
    if ok:
        m["ckpt"].observe(seconds)
        m["ckpt_bytes"].inc(nbytes)
    else:
        m["ckpt_failures"].inc()


def restored(seconds: float, nbytes: int) -> None:
    m = _get()
    if m is not None:
        m["restore"].set(seconds)
        m["restore_bytes"].set(nbytes)
