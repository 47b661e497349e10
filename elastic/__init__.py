"""elastic-run: elastic, fault-tolerant PyTorch training.

The worker-side API, imported lazily (the agent imports this package too, and must not
pay for torch):

    elastic.State, elastic.SnapshotPolicy, elastic.CheckpointMismatchError
    elastic.ElasticSampler, elastic.BatchPolicy
    elastic.heartbeat()
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "State": "elastic.state",
    "SnapshotPolicy": "elastic.state",
    "CheckpointMismatchError": "elastic.state",
    "ElasticSampler": "elastic.sampler",
    "BatchPolicy": "elastic.sampler",
}

__all__ = [*_LAZY, "heartbeat"]


def heartbeat(step: int | None = None) -> None:
    """Tell the agent this worker makes progress (for scripts that do not use State).

    A worker that has sent one heartbeat and then none for --worker-hang-timeout
    seconds is treated as failed. Outside elastic-run this does nothing.
    """
    from elastic.control import REPORTS, worker_block

    block = worker_block()
    if block is not None:
        block.mark(REPORTS)
        block.beat(step)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
