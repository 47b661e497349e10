"""The benchmarks' training script: a small gloo DDP loop logging every step.

Each worker appends ``{"t", "step", "rank", "world", "pid", "commit"}`` lines (``commit``:
the seconds the previous step's ``commit()`` took; ``plain``: a step of an ``--ab`` phase
without it) to ``$RESULT_DIR/w<pid>.jsonl``. Plain
(the default), it never resumes from a checkpoint: the benchmarks time recovery, not
training, and ``step`` counts this process's steps. With
``--live`` it runs the loop in ``elastic.State.run``, so under elastic-run its workers keep
their processes through membership changes (or, with ``--restart-mode respawn``, new ones
resume from the snapshots), and ``step`` is the job's committed step it trains: a step
logged twice was trained again.

With ``--device cuda`` the model (``--width``: four hidden Linear(width, width) layers;
by default the tiny Linear(32, 1)) and its optimizer state live on cuda:0 (every worker
on the same GPU: gloo ranks, several to a device), so a worker that keeps its process
through a change keeps its CUDA context and its model on the device.

With ``--ab N`` (and ``--live``) the loop commits for N steps, then trains N steps of a
twin model (the same layers) in a DDP State knows nothing of, in turn: the same
processes, group and moment of the machine measure the step with all State adds (its
comm hook included) and the plain step.

With ``--echo PORT`` the script keeps a connection of its own, opened before the
process group, to an echo service on 127.0.0.1:PORT, and makes one request on it each
step; ``echo_failed`` in each row counts the requests that failed so far (a failed one
reconnects): a re-formation must cut only the process group's connections.

    python benchmarks/ddp_steps.py [step seconds] [--live] [--ab N] [--echo PORT]
                                   [--device cuda] [--width 2048]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import time
from typing import IO

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 10**9


class Echo:
    """The script's own connection: one byte out and back per ``ask``, failures counted."""

    def __init__(self, port: int) -> None:
        self.port, self.failed = port, 0
        self.conn = self._connect()

    def _connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def ask(self) -> None:
        try:
            self.conn.sendall(b"x")
            if self.conn.recv(1) != b"x":
                raise ConnectionError("end of stream")
        except OSError:
            self.failed += 1
            self.conn.close()
            self.conn = self._connect()


echo: Echo | None = None


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    out: IO[str],
    pause: float,
    ab: int = 0,
    twin: torch.nn.Module | None = None,
) -> None:
    ddp = DDP(model)  # on the process group of this round
    plain_ddp = DDP(twin) if twin is not None else ddp  # --ab's plain phases: no State
    plain_opt = torch.optim.SGD(twin.parameters(), lr=0.01) if twin is not None else opt
    rank, world = dist.get_rank(), dist.get_world_size()
    pid = os.getpid()
    first = next(model.parameters())
    committed = 0.0  # seconds the last commit() took
    for i in range(STEPS):
        step = i
        plain = ab > 0 and (i // ab) % 2 == 1  # a phase without commit() (--ab)
        x = torch.randn(16, first.shape[-1], device=first.device)
        net, o = (plain_ddp, plain_opt) if plain else (ddp, opt)
        loss = net(x).pow(2).mean()
        o.zero_grad()
        loss.backward()
        o.step()
        if state is not None:
            step = state.step + 1  # the job's step, once committed
        row = {"t": time.time(), "step": step, "rank": rank, "world": world, "pid": pid,
               "commit": committed, "plain": plain}  # fmt: skip
        if echo is not None:
            echo.ask()
            row["echo_failed"] = echo.failed
        out.write(json.dumps(row))
        out.write("\n")
        out.flush()
        committed = 0.0
        if state is not None and not plain:
            began = time.perf_counter()
            state.commit()
            committed = time.perf_counter() - began
        time.sleep(pause)


state = None


def build(device: str, width: int) -> torch.nn.Module:
    if not width:
        return torch.nn.Linear(32, 1).to(device)
    layers = [torch.nn.Linear(width, width) for _ in range(4)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)


def main() -> None:
    global state, echo
    ap = argparse.ArgumentParser()
    ap.add_argument("pause", type=float, nargs="?", default=0.05)
    ap.add_argument("--live", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=0)
    ap.add_argument(
        "--build-s",
        type=float,
        default=0.0,
        help="seconds between init_process_group and State.run (a model slow to build; "
        "$RESULT_DIR/building.PID says it begins)",
    )
    ap.add_argument(
        "--ab",
        type=int,
        default=0,
        metavar="N",
        help="with --live: N steps with "
        "commit(), N without, in turn (the steps of each phase are the same ones)",
    )
    ap.add_argument("--echo", type=int, default=0, metavar="PORT", help="see the module doc")
    a = ap.parse_args()
    if a.echo:  # before anything of torch.distributed: not the group's
        echo = Echo(a.echo)
    if a.live:  # before the process group, as the README says: a newcomer's worker can
        import elastic  # then start before its node joins (elastic/agent/lobby.py)

        logging.basicConfig(format="%(message)s")  # State's account of each re-formation
        logging.getLogger("elastic").setLevel(logging.INFO)
    dist.init_process_group("gloo")
    if a.build_s:  # said, for a driver that acts while the model builds
        open(os.path.join(os.environ["RESULT_DIR"], f"building.{os.getpid()}"), "w").close()
    time.sleep(a.build_s)
    model = build(a.device, a.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = os.path.join(os.environ["RESULT_DIR"], f"w{os.getpid()}.jsonl")
    with open(path, "a") as out:
        if not a.live:
            train(model, opt, out, a.pause)
            return
        twin = build(a.device, a.width) if a.ab else None
        state = elastic.State(model=model, optimizer=opt)
        state.run(train, model, opt, out, a.pause, a.ab, twin)


if __name__ == "__main__":
    main()
