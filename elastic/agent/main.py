"""``elastic-run [torchrun flags] script ...``: run this node's agent."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from elastic.agent.args import UsageError, parse_args
from elastic.agent.config import build_config
from elastic.agent.etcd_server import EtcdServerError
from elastic.agent.launch import launch
from elastic.agent.metrics import MetricsError
from rendezvous.config import ConfigError
from rendezvous.errors import RendezvousError


def fail(message: str, code: int = 1) -> int:
    print(f"elastic-run: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: Sequence[str]) -> int:
    from elastic.cli import setup_logging

    try:
        cfg = build_config(parse_args(argv))
    except UsageError as e:
        if e.usage:
            print(e.usage, file=sys.stderr)
        return fail(str(e), e.code)
    setup_logging(cfg.node_id)
    try:
        return launch(cfg)
    except (RendezvousError, ConfigError, EtcdServerError, MetricsError) as e:
        return fail(str(e))
