"""The recovery benchmark's workload under TorchFT 0.2 (``pip install torchft==0.2.0``):
the same model, batch and pause as ``ddp_steps.py``, written as TorchFT's README writes
a loop (a ``Manager`` per replica group on its reconfigurable ``ProcessGroupGloo``, its
``Optimizer`` wrapper starting the quorum). Gradients go through ``Manager.allreduce``
rather than TorchFT's ``DistributedDataParallel``: with torch 2.13 that wrapper's comm
hook fails an assertion (``assert fut._fut``) when a peer dies, ending the survivors.
One replica group per "node", each under torchrun with one worker; the Lighthouse forms
the quorum.

Each step appends ``{"t", "step", "rank", "world"}`` to ``$RESULT_DIR/w<pid>.jsonl``,
``rank`` being the replica group and ``world`` the quorum's participants.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
from torchft import Manager, Optimizer, ProcessGroupGloo


def main() -> None:
    pause = float(sys.argv[1]) if len(sys.argv) > 1 else 0.05
    group = int(os.environ["REPLICA_GROUP_ID"])
    model = torch.nn.Linear(32, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{group}",
        timeout=timedelta(seconds=10),
    )
    opt = Optimizer(manager, inner)
    path = os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl")
    with open(path, "a") as out:
        while True:
            opt.zero_grad()  # starts the quorum for this step
            model(torch.randn(16, 32)).pow(2).mean().backward()
            for work in [manager.allreduce(p.grad) for p in model.parameters()]:
                work.wait()  # averaged over the quorum; an error is the manager's to track
            if manager.should_commit():  # what opt.step() asks before stepping
                inner.step()
                row = {"t": time.time(), "step": manager.current_step(), "rank": group}
                row["world"] = manager.num_participants()
                out.write(json.dumps(row) + "\n")
                out.flush()
            time.sleep(pause)


if __name__ == "__main__":
    main()
