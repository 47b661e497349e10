"""elastic.State with the model and optimizer on the GPU: snapshot, crash, restore.

Prints one line per step: "step N attempt A device D checksum C". On the first attempt it
SIGKILLs itself after committing --kill-step; the restart must resume right after it.
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

import elastic

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--kill-step", type=int, default=5)
a = ap.parse_args()
dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local)
torch.cuda.set_device(device)
torch.manual_seed(0)
model = torch.nn.Linear(256, 256).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
state = elastic.State(model=model, optimizer=opt)
state.restore()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
while state.step < a.steps:
    loss = model(torch.randn(64, 256, device=device)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    state.commit()
    p = next(model.parameters())
    checksum = float(sum(q.detach().double().sum() for q in model.parameters()))
    sys.stdout.write(
        f"step {state.step} attempt {attempt} device {p.device} checksum {checksum!r}\n"
    )
    sys.stdout.flush()
    if attempt == "0" and state.step == a.kill_step:
        os.kill(os.getpid(), signal.SIGKILL)
state.close()
dist.destroy_process_group()
