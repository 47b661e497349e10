"""One worker of the torchrun-compatibility tests: what it prints depends on the flags.

--allreduce [--tcp]   join the process group (env:// or tcp://MASTER_ADDR:MASTER_PORT),
                      all-reduce the ranks and print the placement
--stdin               print the line read from stdin
--timer               arm torch's file timer for 0.5 s and overrun it
--raise               fail with an exception under torch's @record
--where               print MASTER_ADDR, MASTER_PORT and sys.path[0]
"""

import os
import sys
import time


def say(line: str) -> None:
    """One write per line: workers share the console, and print() writes the newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


rank = os.environ["RANK"]
if "--where" in sys.argv:
    say(f"rank {rank} at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    say(f"rank {rank} path {sys.path[0]!r}")
if "--stdin" in sys.argv:
    say(f"rank {rank} read {sys.stdin.readline().strip()!r}")
if "--allreduce" in sys.argv:
    import torch
    import torch.distributed as dist

    init = None
    if "--tcp" in sys.argv:
        init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group(
            "gloo", init_method=init, rank=int(rank), world_size=int(os.environ["WORLD_SIZE"])
        )
    else:
        dist.init_process_group("gloo")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    say(
        f"rank {rank}/{os.environ['WORLD_SIZE']} group {os.environ['GROUP_RANK']} "
        f"port {os.environ['MASTER_PORT']} sum {t.item():.0f}"
    )
    dist.destroy_process_group()
if "--timer" in sys.argv:
    from torch.distributed.elastic import timer

    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=0.5, scope="slow_step"):
        time.sleep(30)
    say("not reached")
if "--raise" in sys.argv:
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        raise ValueError(f"broken on rank {rank}")

    main()
if "--sleep" in sys.argv:
    say(f"rank {rank} sleeping")
    time.sleep(60)
