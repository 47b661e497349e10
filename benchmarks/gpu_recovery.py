"""What a worker crash costs a GPU job, and where the time goes (run it where there is CUDA).

One node, one worker on one GPU training a ~134M-parameter MLP with Adam (1.6 GB of state)
under elastic-run with ``--max-restarts 1``. The worker SIGKILLs itself after step 20 of
its first attempt; the agent restarts it and it resumes from the node's snapshot. For
``--start-method spawn`` and ``forkserver`` this prints the time from the kill to the
first step of the new attempt, and its parts: the new process up, ``import torch``, CUDA
initialised, the NCCL process group formed, DDP built, the state restored, the first
step done.

    python benchmarks/gpu_recovery.py [--repeat 2]
"""

import time

STARTED = time.time()  # before anything else: when this process got to run Python

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

MARKS = ("python", "torch", "cuda", "nccl", "ddp", "restore", "step")


def worker() -> None:
    marks = {"python": STARTED}
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import elastic

    marks["torch"] = time.time()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    marks["cuda"] = time.time()
    dist.init_process_group("nccl", device_id=device)
    dist.barrier()
    marks["nccl"] = time.time()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).to(device)
    model = DDP(net, device_ids=[device.index])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    marks["ddp"] = time.time()
    state = elastic.State(model=model, optimizer=opt)
    state.restore()
    torch.cuda.synchronize()
    marks["restore"] = time.time()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    x = torch.randn(256, 4096, device=device)
    while state.step < 30:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        state.commit()
        torch.cuda.synchronize()
        if "step" not in marks:
            marks["step"] = time.time()
            print(json.dumps({"attempt": attempt, "marks": marks}), flush=True)
        if attempt == 0 and state.step == 20:
            print(json.dumps({"killed": time.time()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    state.close()
    dist.destroy_process_group()


def run(start_method: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-m", "elastic", "--start-method", start_method, "--max-restarts", "1",
         __file__, "--worker"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the job failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    killed = next(r["killed"] for r in rows if "killed" in r)
    marks = next(r["marks"] for r in rows if r.get("attempt") == 1)
    parts, previous = {}, killed
    for name in MARKS:
        parts[name] = marks[name] - previous
        previous = marks[name]
    parts["total"] = marks["step"] - killed
    return parts


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here")
        return
    labels = {
        "python": "kill -> new process runs Python",
        "torch": "import torch (and elastic)",
        "cuda": "CUDA initialised",
        "nccl": "NCCL process group",
        "ddp": "model on GPU, DDP built",
        "restore": "state restored (snapshot -> GPU)",
        "step": "first step",
        "total": "kill -> first step",
    }
    for method in ("spawn", "forkserver"):
        runs = [run(method) for _ in range(a.repeat)]
        print(f"--start-method {method} (median of {a.repeat}):")
        for key, label in labels.items():
            print(f"  {label:<36} {statistics.median(r[key] for r in runs):6.2f} s")


if __name__ == "__main__":
    main()
