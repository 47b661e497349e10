"""Stock torchrun trains with ``--rdzv-backend etcd-v3`` once this project is installed."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from conftest import need
from harness import ROOT, Proc, wait_until

from elastic.agent.etcd_server import EtcdServer
from rendezvous.client import EtcdClient
from rendezvous.config import RdzvConf, build_options
from rendezvous.handler import EtcdV3RendezvousHandler
from rendezvous.protocol import NodeSpec, Rendezvous

SCRIPT = ROOT / "tests" / "scripts" / "ddp_min.py"


def torchrun(endpoint: str, run_id: str, nnodes: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--local-addr",
        "127.0.0.1",
        "--rdzv-conf",
        "last_call_timeout=1,lease_ttl=3",
        str(SCRIPT),
        "6",
    ]


@pytest.mark.slow
def test_two_stock_torchrun_agents_train_to_completion(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    need(
        any(ep.name == "etcd-v3" for ep in entry_points(group="torchrun.handlers")),
        "the project is not installed (pip install -e .): no torchrun.handlers entry point",
    )
    agents = [
        Proc(
            torchrun(etcd.endpoint, run_id, "2"),
            env={"RESULT_DIR": str(tmp_path)},
            name=f"torchrun{i}",
        )
        for i in range(2)
    ]
    procs.extend(agents)
    for a in agents:
        assert a.wait(120) == 0, a.transcript()
    done = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(d["rank"] for d in done) == [0, 1, 2, 3]
    assert {d["world"] for d in done} == {4}
    assert len({round(d["checksum"], 6) for d in done}) == 1  # DDP kept replicas in sync
    assert {d["env"]["TORCHELASTIC_RUN_ID"] for d in done} == {run_id}
    # a late joiner finds the job closed and stops at once, as with torch's c10d backend
    late = Proc(torchrun(etcd.endpoint, run_id, "1:2"), name="late")
    procs.append(late)
    assert late.wait(60) != 0
    assert "has finished" in "\n".join(late.err)


def _handler(etcd: EtcdServer, run_id: str, node: str) -> EtcdV3RendezvousHandler:
    opts, rdzv = build_options(
        etcd.endpoint, run_id, 2, 3, RdzvConf.parse("last_call_timeout=0.2,lease_ttl=3")
    )
    me = NodeSpec(id=node, addr="127.0.0.1", nproc=1)
    return EtcdV3RendezvousHandler(Rendezvous(EtcdClient(opts), rdzv, me))


def test_every_member_sees_a_late_node_from_its_own_reading(etcd: EtcdServer, run_id: str) -> None:
    """torch's agents poll every member; a caller that polls one member only (a custom
    agent, a monitor) must see a late node there too, whichever member it asks."""
    a, b = _handler(etcd, run_id, "a"), _handler(etcd, run_id, "b")
    late = _handler(etcd, run_id, "c")
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), (a, b)))
        assert sorted(i.rank for i in infos) == [0, 1]
        follower = b if infos[1].rank == 1 else a
        assert follower.num_nodes_waiting() == 0
        late._rdzv.start()  # registers and waits: the round of two has room for three
        assert wait_until(follower.num_nodes_waiting, 10.0, "the follower sees c") == 1
    finally:
        for h in (a, b, late):
            h._rdzv.shutdown(leave=True)
            h._rdzv.client.close()
