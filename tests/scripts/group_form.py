"""One rank forming a gloo group through ``elastic.worker.group.Group.form`` over a store
the test hosts (for tests/test_group.py): it prints ``formed``, or what forming raised,
whether the group counts it as broken, and how long it took."""

from __future__ import annotations

import datetime
import os
import time

from elastic.contract import ControlBlock
from elastic.worker.group import Group, Placement


def main() -> None:
    block = ControlBlock(os.environ["BLOCK"])
    g = Group(block)
    g.backend, g.timeout = "gloo", datetime.timedelta(seconds=60)
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
    started = time.monotonic()
    try:
        asked = (block.abandon_generation, block.pause_generation)  # as the agent publishes
        g.form(Placement(1, {k: os.environ[k] for k in keys}, asked))
        print("formed", flush=True)
    except Exception as e:
        took = time.monotonic() - started
        print(f"broke {g.breaks(e)} after {took:.1f}s: {type(e).__name__}", flush=True)
    g.close()


if __name__ == "__main__":
    main()
