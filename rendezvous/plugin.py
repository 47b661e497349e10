"""The ``torchrun.handlers`` entry point, apart from the handler itself.

torch loads its entry points while ``torch.distributed.elastic.rendezvous`` initialises,
which ``rendezvous.handler`` imports: pointing the entry point at the handler module
would load it half-initialised whenever it is imported first. Here nothing is imported
until torch creates a handler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def handler_creator() -> Callable[[Any], Any]:
    """Returns the creator torch registers as ``etcd-v3`` (torch calls this at once)."""

    def create(params: Any) -> Any:
        from rendezvous.handler import create_handler

        return create_handler(params)

    return create
