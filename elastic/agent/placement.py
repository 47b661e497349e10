"""The environment of one worker: exactly what torchrun 2.13 gives it for the same ranks."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rendezvous.records import RoundCause


@dataclass(frozen=True)
class Placement:
    """Where a worker sits in the job for one round."""

    local_rank: int
    rank: int
    group_rank: int
    local_world_size: int
    world_size: int
    group_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    # the rank-0 agent hosts the round's store (torchrun's c10d backend); False: the rank-0
    # worker hosts it itself (torchrun's static rendezvous), see Agent._start
    agent_store: bool = True


def restart_count(before: int, cause: RoundCause, *, first: bool) -> int:
    """torchrun's TORCHELASTIC_RESTART_COUNT for this node's next round.

    torchrun counts, per agent, the restarts its workers needed: a member that failed,
    vanished or left makes the survivors' workers fail, so that counts; nodes joining
    (``num_nodes_waiting``) restart the workers uncounted, and a node's first round is 0.
    The job's restart budget (``--max-restarts``) is another count: failures only.
    """
    if first or cause in (RoundCause.START, RoundCause.RESIZE):
        return before
    return before + 1


def round_env(p: Placement) -> dict[str, str]:
    """The variables that change from round to round (a live worker takes these in place)."""
    return {
        "RANK": str(p.rank),
        "GROUP_RANK": str(p.group_rank),
        "ROLE_RANK": str(p.rank),
        "LOCAL_WORLD_SIZE": str(p.local_world_size),
        "WORLD_SIZE": str(p.world_size),
        "GROUP_WORLD_SIZE": str(p.group_world_size),
        "ROLE_WORLD_SIZE": str(p.world_size),
        "MASTER_ADDR": p.master_addr,
        "MASTER_PORT": str(p.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(p.restart_count),
        # a store on a port fresh to this round, so no stale worker of an older one reaches it
        "TORCHELASTIC_USE_AGENT_STORE": str(p.agent_store),
    }


def worker_env(
    p: Placement,
    *,
    role: str,
    run_id: str,
    max_restarts: int,
    error_file: str,
    virtual_local_rank: bool = False,
    extra: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment (the agent's own, plus torchrun's variables) for one worker."""
    parent = dict(os.environ if base is None else base)
    env = dict(parent)
    env.update(extra or {})
    env.update(round_env(p))
    env.update(
        {
            "ROLE_NAME": role,
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": parent.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file,
            "LOCAL_RANK": str(p.local_rank),
        }
    )
    if virtual_local_rank:  # each worker sees only its own GPU, as device 0 (as torchrun)
        env["LOCAL_RANK"] = "0"
        visible = parent.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            env["CUDA_VISIBLE_DEVICES"] = str(p.local_rank)
        else:
            gpus = [g.strip() for g in visible.split(",")]
            if p.local_rank >= len(gpus):
                raise ValueError(
                    f"--virtual-local-rank: local rank {p.local_rank} exceeds "
                    f"CUDA_VISIBLE_DEVICES={visible}"
                )
            env["CUDA_VISIBLE_DEVICES"] = gpus[p.local_rank]
    return env
