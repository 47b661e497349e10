"""``elastic-run status``: a running job, as etcd sees it, for people at a terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from elastic.args import Parser, UsageError
from rendezvous.client import EtcdClient
from rendezvous.config import ConfigError, build_options, parse_conf
from rendezvous.errors import RendezvousError
from rendezvous.mirror import JobView, read_view


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="elastic-run status",
        description="Show a job: its round, members, standbys, restarts and state, read from etcd.",
    )
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, dest="endpoint")
    p.add_argument("--rdzv-id", "--rdzv_id", required=True, dest="run_id")
    p.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default="",
        dest="conf",
        help="TLS, auth and prefix keys, as for the job",
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


def describe(view: JobView, run_id: str) -> dict:
    """The job as plain data (what --json prints, and what the table shows)."""
    r, closed = view.round, view.closed
    members = []
    in_round = set()
    for rank, m in enumerate(r.members if r else ()):
        in_round.add(m.id)
        node = view.nodes.get(m.id)
        if node is None or node.rev != m.rev:
            state = "left" if view.was_leaving(m) else "lost"
        elif node.record.state == "leaving":
            state = "leaving"
        elif node.record.done >= r.number:
            state = "stopping"
        else:
            state = "running"
        rec = node.record if node else None
        members.append(
            {
                "rank": rank,
                "node": m.id,
                "host": rec.host if rec else "",
                "addr": m.addr,
                "workers": m.nproc,
                "state": state,
                "metrics": f"{m.addr}:{rec.metrics}" if rec and rec.metrics else "",
            }
        )
    standbys = [
        {
            "node": n.record.id,
            "host": n.record.host,
            "addr": n.record.addr,
            "workers": n.record.nproc,
            "state": n.record.state,
        }
        for n in sorted(view.nodes.values(), key=lambda n: n.rev)
        if n.record.id not in in_round
    ]
    if closed is not None:
        state = closed.state
    elif r is None:
        state = "forming"
    elif all(m["state"] == "running" for m in members):
        state = "running"
    else:
        state = "changing"
    out = {"job": run_id, "state": state, "members": members, "standbys": standbys}
    if r is not None:
        out["round"] = {
            "number": r.number,
            "world_size": r.world_size,
            "cause": r.cause,
            "restarts": r.restarts,
            "formed_at": r.formed_at,
            "master": f"{r.master_addr}:{r.master_port}",
            "joined": list(r.joined),
            "left": list(r.left),
            "lost": list(r.lost),
        }
    if closed is not None:
        out["closed"] = {
            "state": closed.state,
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
    if d["standbys"]:
        lines.append(
            "standbys: "
            + ", ".join(f"{s['node']} ({s['host']}, {s['workers']} workers)" for s in d["standbys"])
        )
    for p in d.get("problems", []):
        lines.append(f"warning: {p}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    try:
        a = parser().parse_args(list(argv))
        etcd, opts = build_options(a.endpoint, a.run_id, 1, 1, parse_conf(a.conf))
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
            and not view.round_error
            and not view.closed_error
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
