"""The round's TCPStore, hosted by the rank-0 agent as torchrun's c10d backend does.

Workers find it at MASTER_ADDR:MASTER_PORT with TORCHELASTIC_USE_AGENT_STORE=True, the
same environment torchrun gives them. Each round gets a store on a fresh port, dropped
when the round ends, so a stale worker of an older round has nothing to connect to.

torch is imported in the background as soon as the agent starts, so a node that becomes
rank 0 after a failure does not pay the import on the recovery path.
"""

from __future__ import annotations

import datetime
import threading


def prefetch() -> None:
    """Import torch in a thread now; a later import waits on it instead of starting over."""

    def load() -> None:
        import torch.distributed  # noqa: F401

    threading.Thread(target=load, name="import-torch", daemon=True).start()


class StoreError(RuntimeError):
    """The store could not be hosted on the round's port."""


def host(addr: str, port: int, timeout: float = 900.0) -> object:
    """Start a TCPStore server on ``port``; it lives as long as the returned object."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(
            host_name=addr,
            port=port,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (RuntimeError, OSError) as e:
        raise StoreError(f"cannot host the round's store on port {port}: {e}") from None
