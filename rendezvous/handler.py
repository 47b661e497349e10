"""The etcd v3 rendezvous as a torch ``RendezvousHandler``: ``torchrun --rdzv-backend etcd-v3``.

Registered under the entry-point group ``torchrun.handlers``; torch calls
``handler_creator()`` and then the returned creator with its ``RendezvousParameters``.
torch's own etcd backends speak the v2 API that etcd 3.6 removed; this one speaks v3.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import api as torch_api

from rendezvous import version
from rendezvous.client import EtcdClient
from rendezvous.config import ConfigError, RdzvConf, build_options
from rendezvous.errors import (
    EtcdUnavailableError,
    MalformedRecordError,
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)
from rendezvous.net import default_local_addr
from rendezvous.protocol import NodeSpec, Rendezvous
from rendezvous.records import JobOutcome
from rendezvous.rules import RoundEnd

log = logging.getLogger(__name__)

_TORCH_ERRORS: dict[type[Exception], type[Exception]] = {
    RendezvousClosedError: torch_api.RendezvousClosedError,
    RendezvousTimeoutError: torch_api.RendezvousTimeoutError,
    EtcdUnavailableError: torch_api.RendezvousConnectionError,
    MalformedRecordError: torch_api.RendezvousStateError,
    RendezvousError: torch_api.RendezvousError,
}


def _to_torch(e: RendezvousError) -> Exception:
    # A late joiner gets RendezvousClosedError, as with torch's c10d backend: torch 2.13's
    # launcher crashes on RendezvousGracefulExitError outside a standby list.
    for ours, theirs in _TORCH_ERRORS.items():
        if isinstance(e, ours):
            return theirs(str(e))
    return torch_api.RendezvousError(str(e))


class EtcdV3RendezvousHandler(torch_api.RendezvousHandler):
    """Adapts ``Rendezvous`` to torch's agent: each round gets a fresh TCPStore on rank 0."""

    def __init__(self, rdzv: Rendezvous, store_timeout: float = 300.0) -> None:
        self._rdzv = rdzv
        self._store_timeout = datetime.timedelta(seconds=store_timeout)
        self._store: Store | None = None
        self._started = False

    def get_backend(self) -> str:
        return "etcd-v3"

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> torch_api.RendezvousInfo:
        try:
            if not self._started:
                self._rdzv.start()
                self._started = True
            r = self._rdzv.next_round()
        except RendezvousError as e:
            raise _to_torch(e) from None
        group_rank = r.rank_of(self._rdzv.me.id)
        self._store = None  # the previous round's store server goes away with it
        tcp = TCPStore(
            r.master_addr,
            r.store_port,
            is_master=group_rank == 0,
            timeout=self._store_timeout,
            wait_for_workers=False,
        )
        self._store = PrefixStore(f"round{r.number}", tcp)
        log.info(
            "round %d: group rank %d of %d, master %s:%d",
            r.number,
            group_rank,
            r.size,
            r.master_addr,
            r.master_port,
        )
        return torch_api.RendezvousInfo(
            self._store,
            group_rank,
            r.size,
            torch_api.RendezvousStoreInfo(r.master_addr, r.master_port),
        )

    def is_closed(self) -> bool:
        try:
            return self._rdzv.closed() is not None
        except RendezvousError:
            return False

    def set_closed(self) -> None:
        self._rdzv.close(JobOutcome.SUCCEEDED, f"closed by {self._rdzv.me.id}")

    def num_nodes_waiting(self) -> int:
        """Non-zero whenever the round should end: torch's agent then re-rendezvouses
        without charging a restart, which is what a lost or departed node deserves."""
        self._rdzv.upkeep()
        change = self._rdzv.check()
        if change is None:
            try:
                return self._rdzv.nodes_waiting()  # each member answers from its own reading
            except RendezvousError:
                return 0
        if change.end in (RoundEnd.JOB_SUCCEEDED, RoundEnd.JOB_DONE_WITHOUT, RoundEnd.JOB_FAILED):
            return 0
        return max(1, len(change.nodes))

    def get_run_id(self) -> str:
        return self._rdzv.options.run_id

    def shutdown(self) -> bool:
        try:
            if self._started:
                self.set_closed()
            self._rdzv.shutdown(leave=True)
            return True
        except RendezvousError as e:
            log.warning("etcd-v3 rendezvous shutdown failed: %s", e)
            return False


def create_handler(params: torch_api.RendezvousParameters) -> EtcdV3RendezvousHandler:
    try:
        conf = RdzvConf.parse({k: v for k, v in params.config.items() if v is not None})
        for line in conf.warnings():
            log.warning("%s", line)
        etcd_opts, rdzv_opts = build_options(
            params.endpoint, params.run_id, params.min_nodes, params.max_nodes, conf
        )
    except ConfigError as e:
        raise ValueError(str(e)) from None
    addr = params.local_addr or default_local_addr()
    # torch's agent assigns global ranks through the round's store, so nproc is nominal here
    me = NodeSpec(
        id=f"{socket.gethostname()}-{os.getpid()}",
        addr=addr,
        nproc=1,
        pid=os.getpid(),
        version=version(),
    )
    return EtcdV3RendezvousHandler(Rendezvous(EtcdClient(etcd_opts), rdzv_opts, me))
