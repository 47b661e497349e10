"""Sharded state (FSDP2 / DTensor, and FSDP1's FullyShardedDataParallel) through
torch.distributed.checkpoint.

Each rank holds only its shards, so a snapshot is a DCP checkpoint written by all ranks
to a directory every node can read, and a restore loads it into the current sharding:
DCP reshards to the new world size. A checkpoint is complete once DCP has written its
``.metadata`` (the coordinator does that last).

    <checkpoint_dir>/dcp-step-<N>/   one per snapshot, the newest ``keep`` kept
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("elastic.sharded")
_NAME = re.compile(r"^dcp-step-(\d{12})$")


def is_sharded(objects: dict[str, Any]) -> bool:
    """Whether a model holds shards: DTensor parameters (FSDP2, HSDP, tensor parallel),
    or FSDP1 modules, whose flat parameters are plain tensors that only its own state
    dicts (``get_state_dict``) turn into shards a checkpoint can hold."""
    from torch.distributed.tensor import DTensor

    models = [o for o in objects.values() if isinstance(o, torch.nn.Module)]
    return any(isinstance(p, DTensor) for m in models for p in m.parameters()) or any(
        fsdp1_modules(m) for m in models
    )


def fsdp1_modules(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s FSDP1 (``FullyShardedDataParallel``) modules, "" for the
    model itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [n for n, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]


def _split(objects: dict[str, Any]) -> tuple[list, list, dict[str, Any]]:
    models = [(k, o) for k, o in objects.items() if isinstance(o, torch.nn.Module)]
    optims = [(k, o) for k, o in objects.items() if isinstance(o, torch.optim.Optimizer)]
    others = {
        k: o
        for k, o in objects.items()
        if not isinstance(o, torch.nn.Module | torch.optim.Optimizer)
    }
    return models, optims, others


def _state_dict(objects: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    models, optims, others = _split(objects)
    out: dict[str, Any] = {
        "values": dict(values),
        "others": {k: o.state_dict() for k, o in others.items()},
    }
    for name, model in models:
        opts = [o for _, o in optims if _owns(o, model)]
        msd, osd = get_state_dict(model, opts)
        out[f"model/{name}"] = msd
        if opts:
            out[f"optim/{name}"] = osd
    return out


def _owns(opt: torch.optim.Optimizer, model: torch.nn.Module) -> bool:
    params = {id(p) for p in model.parameters()}
    return any(id(p) in params for g in opt.param_groups for p in g["params"])


def path_for(directory: Path, step: int) -> Path:
    return directory / f"dcp-step-{step:012d}"


def complete_steps(directory: Path) -> list[int]:
    """Steps with a complete DCP checkpoint here, newest first."""
    if not directory.is_dir():
        return []
    steps = [
        int(m.group(1))
        for p in directory.iterdir()
        if (m := _NAME.match(p.name)) and (p / ".metadata").exists()
    ]
    return sorted(steps, reverse=True)


def save(
    directory: Path, step: int, objects: dict[str, Any], values: dict[str, Any], keep: int
) -> None:
    """All ranks together. Raises OSError if the filesystem refuses."""
    import torch.distributed.checkpoint as dcp

    target = path_for(directory, step)
    dcp.save(_state_dict(objects, values), checkpoint_id=str(target))
    import torch.distributed as dist

    if dist.get_rank() == 0:
        for old in complete_steps(directory)[keep:]:
            shutil.rmtree(path_for(directory, old), ignore_errors=True)
        for p in directory.iterdir():  # leftovers of saves cut short
            m = _NAME.match(p.name)
            if m and int(m.group(1)) < step and not (p / ".metadata").exists():
                shutil.rmtree(p, ignore_errors=True)


def load(
    directory: Path, step: int, objects: dict[str, Any], values: dict[str, Any]
) -> dict[str, Any]:
    """Load the step's checkpoint into ``objects`` (resharding); returns the plain values
    (``values`` names the ones to look for)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _state_dict(objects, values)
    dcp.load(sd, checkpoint_id=str(path_for(directory, step)))
    models, optims, others = _split(objects)
    for name, model in models:
        opts = [o for _, o in optims if _owns(o, model)]
        set_state_dict(
            model,
            opts,
            model_state_dict=sd[f"model/{name}"],
            optim_state_dict=sd.get(f"optim/{name}", {}),
        )
    for name, obj in others.items():
        with contextlib.suppress(KeyError):
            obj.load_state_dict(sd["others"][name])
    loaded: dict[str, Any] = sd["values"]
    return loaded
