"""``elastic-run status``: a running job, as etcd sees it, for people at a terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from elastic.agent.args import HelpFormatter, Parser, UsageError
from rendezvous.client import EtcdClient
from rendezvous.config import ConfigError, RdzvConf, build_options
from rendezvous.errors import RendezvousError
from rendezvous.mirror import read_view
from rendezvous.records import JobOutcome
from rendezvous.rules import MemberState, member_state
from rendezvous.view import JobView

# flag, its dest, the variable a job's pods have, what it is, whether a job needs it
JOB_FLAGS = (
    ("--rdzv-endpoint", "endpoint", "PET_RDZV_ENDPOINT", "the job's etcd, host[:port][,...]", True),
    ("--rdzv-id", "run_id", "PET_RDZV_ID", "the job's id", True),
    ("--rdzv-conf", "conf", "PET_RDZV_CONF", "TLS, auth and prefix keys, as for the job", False),
)


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="elastic-run status",
        description="Show a job: its round, members, standbys, restarts and state, read from "
        "etcd. Inside a job's pod (kubectl exec job/trainer -- elastic-run status) the job's "
        "own PET_RDZV_* variables are used.",
        formatter_class=HelpFormatter,
    )
    for flag, dest, var, what, _ in JOB_FLAGS:
        underscored = "--" + flag[2:].replace("-", "_")
        default = os.environ.get(var, "")
        p.add_argument(
            flag, underscored, dest=dest, default=default, help=f"{what} (default: ${var})"
        )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _ago(ts: float) -> str:
    s = max(time.time() - ts, 0)
    return (
        f"{s:.0f}s ago"
        if s < 120
        else f"{s / 60:.0f}min ago"
        if s < 7200
        else f"{s / 3600:.1f}h ago"
    )


def _nnodes(view: JobView) -> tuple[int, int]:
    """The job's MIN:MAX as its live nodes were started with (0, 0 if none says)."""
    for n in view.nodes.values():
        if n.record.max_nodes:
            return n.record.min_nodes, n.record.max_nodes
    return 0, 0


def describe(view: JobView, run_id: str) -> dict[str, Any]:
    """The job as plain data (what --json prints, and what the table shows)."""
    r, closed = view.round, view.closed
    min_nodes, max_nodes = _nnodes(view)
    cap = max_nodes or (len(r.members) if r else 1)
    members = []
    for rank, m in enumerate(r.members if r else ()):
        state = member_state(view, m.id, m.rev, cap)
        node = view.nodes.get(m.id)
        rec = node.record if node is not None and node.rev == m.rev else None
        gone = view.gone.get(m.id)
        host = rec.host if rec else gone.host if gone is not None and gone.rev == m.rev else ""
        shown = state.value
        if closed is not None and state in (MemberState.LEFT, MemberState.LOST):
            shown = "finished" if closed.state is JobOutcome.SUCCEEDED else "stopped"
        members.append(
            {
                "rank": rank,
                "node": m.id,
                "host": host,
                "addr": m.addr,
                "workers": m.nproc,
                "state": shown,
                "metrics": f"{m.addr}:{rec.metrics}" if rec and rec.metrics else "",
            }
        )
    in_round = {(m.id, m.rev) for m in r.members} if r else set()
    others = [
        {
            "node": n.record.id,
            "host": n.record.host,
            "addr": n.record.addr,
            "workers": n.record.nproc,
            "state": member_state(view, n.record.id, n.rev, cap).value,
        }
        for n in sorted(view.nodes.values(), key=lambda n: n.rev)
        if (n.record.id, n.rev) not in in_round
    ]
    if closed is not None:
        job_state = closed.state.value
    elif r is None:
        job_state = "forming"
    elif all(m["state"] == MemberState.RUNNING.value for m in members):
        job_state = "running"
    else:
        job_state = "changing"
    out: dict[str, Any] = {
        "job": run_id,
        "state": job_state,
        "members": members,
        "standbys": [o for o in others if o["state"] == MemberState.STANDBY.value],
        "waiting": [o for o in others if o["state"] != MemberState.STANDBY.value],
    }
    if max_nodes:
        present = sum(1 for m in members if m["state"] == "running") if r else len(view.nodes)
        out["nnodes"] = {"min": min_nodes, "max": max_nodes}
        out["needs"] = max(min_nodes - present, 0) if closed is None else 0
    elif closed is not None:
        out["needs"] = 0
    if r is not None:
        out["round"] = {
            "number": r.number,
            "world_size": r.world_size,
            "cause": r.cause.value,
            "restarts": r.restarts,
            "formed_at": r.formed_at,
            "master": f"{r.master_addr}:{r.master_port}",
            "joined": list(r.joined),
            "left": list(r.left),
            "lost": list(r.lost),
        }
    if view.leader is not None:
        out["leader"] = view.leader.id  # the node that writes rounds (see records.py)
    if closed is not None:
        out["closed"] = {
            "state": closed.state.value,
            "reason": closed.reason,
            "at": closed.at,
            "by": closed.by,
        }
    if view.problems:
        out["problems"] = list(view.problems)
    return out


def render(d: dict) -> str:
    lines = [f"job {d['job']}: {d['state']}"]
    r = d.get("round")
    if r:
        change = (
            ", ".join(f"{k} {', '.join(r[k])}" for k in ("joined", "left", "lost") if r[k])
            or "none"
        )
        lines.append(
            f"round {r['number']} formed {_ago(r['formed_at'])} ({r['cause']}); "
            f"world size {r['world_size']} on {len(d['members'])} node(s); "
            f"restarts {r['restarts']}; changes: {change}; master {r['master']}"
            + (f"; leader {d['leader']}" if d.get("leader") else "")
        )
    if d.get("closed"):
        c = d["closed"]
        lines.append(f"closed {_ago(c['at'])} by {c['by']}: {c['reason'] or c['state']}")
    if d["members"]:
        rows = [("RANK", "NODE", "HOST", "ADDRESS", "WORKERS", "STATE", "METRICS")]
        rows += [
            (
                str(m["rank"]),
                m["node"],
                m["host"],
                m["addr"],
                str(m["workers"]),
                m["state"],
                m["metrics"],
            )
            for m in d["members"]
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += [
            "  " + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
    if d.get("nnodes"):
        n = d["nnodes"]
        size = f"nnodes {n['min']}:{n['max']}"
        lines.append(f"{size}; needs {d['needs']} more node(s) to train" if d["needs"] else size)
    for key, title in (("waiting", "waiting to join"), ("standbys", "standbys")):
        if d[key]:
            nodes = ", ".join(
                f"{s['node']} ({s['host']}, {_workers(s['workers'])}{_unless_joining(s)})"
                for s in d[key]
            )
            lines.append(f"{title}: {nodes}")
    for p in d.get("problems", []):
        lines.append(f"warning: {p}")
    return "\n".join(lines)


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _unless_joining(s: dict[str, Any]) -> str:
    return "" if s["state"] in ("joining", "standby") else f", {s['state']}"


def main(argv: Sequence[str]) -> int:
    try:
        a = parser().parse_args(list(argv))
        for flag, dest, var, _, needed in JOB_FLAGS:
            if needed and not getattr(a, dest):
                raise UsageError(f"which job? give {flag}, or set {var} (a job's pods have it)")
        etcd, opts = build_options(a.endpoint, a.run_id, 1, 1, RdzvConf.parse(a.conf))
    except (UsageError, ConfigError) as e:
        print(f"elastic-run status: error: {e}", file=sys.stderr)
        return 2
    client = EtcdClient(etcd)
    try:
        view = read_view(client, opts.job_prefix)
        if (
            not view.nodes
            and view.round_record is None
            and view.closed_record is None
            and not view.problems
            and view.closed_junk is None
        ):
            print(
                f"elastic-run status: error: no job {a.run_id!r} under {opts.prefix} "
                f"at {etcd.describe()}",
                file=sys.stderr,
            )
            return 1
        d = describe(view, a.run_id)
    except RendezvousError as e:
        print(f"elastic-run status: error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(d, indent=2) if a.json else render(d))
    return 0
