"""A live worker alone (world size 1) whose first restore fails as a collective does when
the rank sending the state is lost, ``$BREAKS`` times in a row (the restore done again in
the next group fails too: a second loss during the recovery from the first), for
tests/test_group.py: ``State.run`` re-forms each time, as for any change, and restores
again in the next group. Prints what happened as JSON."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

import elastic
from elastic.worker.state import State

dist.init_process_group("gloo")
state = elastic.State(model=torch.nn.Linear(2, 2))
real = State._restore_snapshot
restores: list[int] = []
breaks = int(os.environ.get("BREAKS", "1"))


def lost_sender(self: State, *args: Any, **kwargs: Any) -> tuple[int, int]:
    restores.append(1)
    if len(restores) <= breaks:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    return real(self, *args, **kwargs)


State._restore_snapshot = lost_sender  # type: ignore[method-assign]
entered: list[str] = []
state.run(lambda: entered.append(str(dist.get_world_size())))
print(json.dumps({"restores": len(restores), "entered": entered}), flush=True)
state.close()
