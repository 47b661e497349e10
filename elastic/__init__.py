"""elastic-run: elastic, fault-tolerant PyTorch training.

The worker-side API, imported lazily (the agent imports this package too, and must not
pay for torch):

    elastic.State, elastic.SnapshotPolicy, elastic.CheckpointMismatchError,
    elastic.Reformation (what leaves State.run's function for a live re-formation)
    elastic.ElasticSampler, elastic.BatchPolicy
    elastic.report(), elastic.heartbeat()
    elastic.tune_workers(dataset, batch_size)  (DataLoader num_workers, measured)
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "State": "elastic.worker.state",
    "SnapshotPolicy": "elastic.contract",
    "CheckpointMismatchError": "elastic.worker.restore",
    "Reformation": "elastic.worker.group",
    "ElasticSampler": "elastic.worker.sampler",
    "BatchPolicy": "elastic.worker.sampler",
    "tune_workers": "elastic.tools.tune_workers",
}

__all__ = [*_LAZY, "heartbeat", "report"]


def report(step: int | None = None, loss: float | None = None, samples: int | None = None) -> None:
    """Training progress for the agent's /metrics (State.commit() does this itself):
    the step, the loss, and the samples this worker trained on since the last call.

    It is also a heartbeat: a worker that reported once and then not for
    --worker-hang-timeout seconds is treated as failed. Outside elastic-run: no-op.
    """
    from elastic.worker import progress

    progress.report(step, loss, samples)


def heartbeat(step: int | None = None) -> None:
    """Only the heartbeat of ``report``: for long phases without steps (evaluation)."""
    report(step)


def watch_the_first_group(imported: bool = True) -> None:
    """In a worker that re-forms in place (under elastic-run, ``--restart-mode live``),
    see the script's first process group form, whenever it does: a re-formation then
    cuts that group's connections only (``worker.group.watch_first_group``). In any
    worker under elastic-run, a gloo group the script leaves is destroyed at its exit
    (``worker.finalize``). ``imported``: the script imported elastic, which the agent
    is told (``_uses_elastic``); the fork server, which calls this for every worker it
    forks, whatever its script, passes False. Nowhere else is torch imported here."""
    import os

    from elastic.contract import CONTROL_ENV, RESTART_MODE_ENV, RestartMode

    live = os.environ.get(RESTART_MODE_ENV, RestartMode.LIVE.value) == RestartMode.LIVE.value
    if os.environ.get(CONTROL_ENV):
        from elastic.worker import finalize

        finalize.at_exit()  # a group the script leaves is destroyed in order
    if os.environ.get(CONTROL_ENV) and live:
        from elastic.worker import group

        group.watch_first_group()
        if imported:
            _uses_elastic()


_told = False  # this worker said that its script uses elastic


def _uses_elastic() -> None:
    """In a worker that re-forms in place, tell the agent that the script uses elastic
    (``ELASTIC``): it may be on its way into State.run, and a graceful change waits for
    it to get there rather than replace it as it starts. Said at ``import elastic``, or,
    in a fork server's child (which finds elastic imported), at the script's first use
    of the API (``elastic.State``, ``from elastic import ...``) or an adapter's import
    (``elastic.integrations``). Once said, never again."""
    global _told
    if _told:
        return
    import os

    from elastic.contract import CONTROL_ENV, ELASTIC, RESTART_MODE_ENV, RestartMode, worker_block

    live = os.environ.get(RESTART_MODE_ENV, RestartMode.LIVE.value) == RestartMode.LIVE.value
    block = worker_block() if live and os.environ.get(CONTROL_ENV) else None
    if block is not None:
        block.mark(ELASTIC)
        _told = True


watch_the_first_group()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    _uses_elastic()
    import importlib

    attr = "tune" if name == "tune_workers" else name
    return getattr(importlib.import_module(module), attr)
