"""The process group a framework's live run re-forms, made before its first Trainer.

``State.run`` re-forms the default process group it finds when it starts; a framework
makes its group inside ``fit``/``train`` otherwise, too late to be kept. Made here, with
the backend the framework would pick by default, the framework finds it made and uses it.
"""

from __future__ import annotations

import os

import torch

from elastic.worker import comm


def ensure_group(backend: str | None) -> None:
    """Under a launcher (``MASTER_ADDR`` set), make the default process group if there is
    none: ``backend``, or NCCL where this local rank has a GPU, else gloo."""
    if comm.dist() is not None or "MASTER_ADDR" not in os.environ:
        return
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    gpu = torch.cuda.is_available() and local < torch.cuda.device_count()
    dist.init_process_group(backend or ("nccl" if gpu else "gloo"))
