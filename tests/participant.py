"""A rendezvous participant in its own process, driven line by line over stdin.

Tests start several of these as "nodes". Each prints JSON events on stdout:
``ready`` once registered, ``round`` when it is in a new round, ``change`` when
``check()`` reports something, ``error`` with the message of a rendezvous error.

Commands: next | finish | fail | announce | close | leave | exit | progress [STEP] | others
(``progress 7``: report step 7 as this node's; either way, say the job's recorded one).
With ``--arrive`` it first says it is on its way (``arriving``), and registers on
``register``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rendezvous.client import EtcdClient
from rendezvous.config import RdzvConf, build_options
from rendezvous.errors import RendezvousError
from rendezvous.mirror import read_view
from rendezvous.protocol import NodeSpec, Rendezvous
from rendezvous.records import FailureReport, JobOutcome, RoundRecord

_out = threading.Lock()


def emit(event: str, **fields: object) -> None:
    with _out:
        print(json.dumps({"event": event, **fields}), flush=True)


def members(rdzv: Rendezvous, r: RoundRecord) -> list[str]:
    """All of round ``r``'s members: a node that does not lead holds only its own bucket
    of them, so the test reads the round once, whole (as ``elastic-run status`` does)."""
    if not r.complete:
        whole = read_view(rdzv.client, rdzv.options.job_prefix).round
        if whole is not None and whole.number == r.number:
            r = whole
    return [m.id for m in r.members]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--nnodes", default="1:4")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--conf", default="")
    ap.add_argument("--max-restarts", type=int, default=0)
    ap.add_argument("--arrive", action="store_true", help="on its way before registering")
    a = ap.parse_args()
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format=f"{a.id} %(levelname)s %(message)s"
    )
    lo, _, hi = a.nnodes.partition(":")
    try:
        etcd_opts, opts = build_options(
            a.endpoint, a.run_id, int(lo), int(hi or lo), RdzvConf.parse(a.conf)
        )
        rdzv = Rendezvous(
            EtcdClient(etcd_opts),
            opts,
            NodeSpec(id=a.id, addr="127.0.0.1", nproc=a.nproc, pid=os.getpid()),
            max_restarts=a.max_restarts,
        )
        if a.arrive:
            rdzv.announce_arrival()
            emit("arriving")
            while sys.stdin.readline().strip() != "register":
                pass
        rdzv.start()
    except (RendezvousError, ValueError) as e:
        emit("error", kind=type(e).__name__, message=str(e))
        sys.exit(3)
    emit("ready", rev=rdzv.rev)

    def watch() -> None:
        last = None
        version = rdzv.version
        while True:
            rdzv.upkeep()
            change = rdzv.check()
            key = (change.end, change.detail) if change else None
            if change is not None and key != last:
                emit("change", end=change.end.name, detail=change.detail, nodes=list(change.nodes))
            last = key
            version = rdzv.wait(version, 1.0)

    threading.Thread(target=watch, daemon=True).start()
    for line in sys.stdin:
        cmd = line.strip()
        try:
            if cmd == "next":
                r = rdzv.next_round()
                emit(
                    "round",
                    number=r.number,
                    rank=r.rank_of(a.id),
                    members=members(rdzv, r),
                    leads=rdzv.mirror.full,
                    world_size=r.world_size,
                    master_addr=r.master_addr,
                    master_port=r.master_port,
                    cause=r.cause.value,
                    restarts=r.restarts,
                    joined=list(r.joined),
                    left=list(r.left),
                    lost=list(r.lost),
                    rev=rdzv.rev,
                )
            elif cmd == "finish":
                rdzv.finish_round()
                emit("finished")
            elif cmd == "fail":
                rdzv.report_failure(FailureReport(f"worker failed on {a.id}"))
                emit("failed")
            elif cmd == "in_place":  # its workers re-form in place (said while it leads)
                rdzv.announce_in_place(True)
                emit("in_place")
            elif cmd.startswith("progress"):
                if cmd != "progress":
                    rdzv.report_progress(int(cmd.split()[1]))
                    rdzv.flush_progress()
                rec = rdzv.progress()
                emit("progress", step=rec.step if rec else -1, node=rec.node if rec else "")
            elif cmd.startswith("raise "):  # fenced: its workers' step, only over an older one
                rdzv.raise_progress(int(cmd.split()[1]))
                rdzv.flush_progress()
                emit("raised")
            elif cmd == "resume":  # carry on after a lapse (the agent does it on LAPSED)
                emit("resumed", ok=rdzv.resume())
            elif cmd == "broken":  # its workers' group broke: probe as the agent then does
                rdzv.probe_members(broken=True)
                emit("probed")
            elif cmd == "others":
                emit("others", n=rdzv.others())
            elif cmd == "announce":
                rdzv.announce_leaving()
                emit("announced")
            elif cmd == "close":
                emit("closed", wrote=rdzv.close(JobOutcome.SUCCEEDED, "done"))
            elif cmd == "leave":
                rdzv.shutdown(leave=True)
                emit("left")
                return
            elif cmd == "exit":
                return
        except RendezvousError as e:
            emit("error", kind=type(e).__name__, message=str(e))


if __name__ == "__main__":
    main()
