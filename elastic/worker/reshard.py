"""Sharded state (FSDP2 / HSDP) re-sharded in memory when the process group re-forms.

A survivor keeps its shards in the process: when the group breaks, ``capture`` takes
views of them (the rows each holds of every DTensor: parameters and optimizer state) and
the small rest (buffers, optimizer settings, samplers, plain values). The script's
``reshard`` function then builds the model and optimizer again on the new world, and
``exchange`` fills them: the ranks gather what each holds and needs, ``reshard_plan``
decides who sends which rows (or that no step is held whole: a lost rank's rows went with
it), and the rows go point to point over the new group, the rest from one rank. A
newcomer offers nothing and takes its shard. When memory does not hold a whole step,
the newest DCP checkpoint in ``--checkpoint-dir`` is loaded instead (``sharded.load``).

Only first-dimension sharding moves this way (FSDP2's ``Shard(0)``, with ``Replicate``
dimensions as HSDP has); ``unsupported`` names anything else, which takes the respawn path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from elastic.worker import comm, sharded, snapshot
from elastic.worker.reshard_plan import Need, NoPlan, Offer, Plan, plan

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

log = logging.getLogger("elastic.state")


def _dtensor() -> type[DTensor]:
    from torch.distributed.tensor import DTensor

    return DTensor


def _rows(t: Any) -> tuple[int, int]:
    """The rows of the full tensor that this rank's local part of DTensor ``t`` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if t.dim() == 0:
        return 0, 1
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return int(offset[0]), int(offset[0]) + int(shape[0])


def unsupported(objects: dict[str, Any]) -> str | None:
    """Why the sharded state cannot be re-sharded in memory, or None when it can."""
    dtensor = _dtensor()
    for name, obj in objects.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        fsdp1 = sharded.fsdp1_modules(obj)
        if fsdp1:
            where = f"{name}.{fsdp1[0]}" if fsdp1[0] else name
            return (
                f"{where} is FSDP1 (FullyShardedDataParallel), whose flat shards only its own "
                "state dicts read: new workers load the DCP checkpoint (FSDP2's fully_shard "
                "re-shards in memory)"
            )
        for key, t in obj.state_dict().items():
            if not isinstance(t, dtensor):
                continue
            for p in t.placements:
                if not (p.is_replicate() or p.is_shard(dim=0)):
                    return f"{name}.{key} is placed {p} (only Shard(0) and Replicate move)"
    return None


def _models(objects: dict[str, Any]) -> dict[str, torch.nn.Module]:
    return {k: o for k, o in objects.items() if isinstance(o, torch.nn.Module)}


def _optimizers(objects: dict[str, Any]) -> dict[str, torch.optim.Optimizer]:
    return {k: o for k, o in objects.items() if isinstance(o, torch.optim.Optimizer)}


def _param_names(objects: dict[str, Any]) -> dict[int, str]:
    """id(parameter) -> "model.fqn", the name an optimizer's state is kept under."""
    return {
        id(p): f"{name}.{fqn}"
        for name, model in _models(objects).items()
        for fqn, p in model.named_parameters()
    }


def _opt_params(opt: torch.optim.Optimizer) -> list[Any]:
    """Parameters in the order ``state_dict()`` numbers them."""
    return [p for g in opt.param_groups for p in g["params"]]


def settle(objects: dict[str, Any]) -> None:
    """Put every FSDP module back in its sharded form (a fault may have cut a forward or
    backward short with parameters gathered); no collective."""
    from torch.distributed.fsdp import FSDPModule

    for model in _models(objects).values():
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def forget_old_meshes() -> None:
    """Drop DTensor's sharding caches (call after a new group formed, before sharding
    over it). They are keyed by specs whose mesh compares equal to a new mesh of the same
    shape, rank aside, so a new DTensor could come out placed on an old mesh, with this
    process's old coordinate (torch 2.13, measured: a rank that moved from 1 to 0 saved
    rows 16-31 as its own); they also keep the old meshes, and their groups, alive."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of tensor ``key`` as they were at ``step``."""

    step: int
    key: str
    lo: int
    hi: int
    tensor: torch.Tensor


@dataclass
class Held:
    """What this rank holds of the sharded state: rows of DTensors (its own, live or
    copied; a buddy's copies) and, per step, the rest (which every rank holds whole),
    packed."""

    pieces: list[Piece] = field(default_factory=list)
    rests: dict[int, memoryview] = field(default_factory=dict)

    def __add__(self, other: Held | None) -> Held:
        if other is None:
            return self
        return Held(self.pieces + other.pieces, {**other.rests, **self.rests})

    @property
    def step(self) -> int:
        """The newest step held (-1: none)."""
        return max(self.rests, default=-1)

    def find(self, key: str, step: int, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of ``key`` at ``step``, from the piece that holds them all."""
        for p in self.pieces:
            if p.key == key and p.step == step and p.lo <= lo and hi <= p.hi:
                return p.tensor[lo - p.lo : hi - p.lo]
        raise KeyError(f"{key} rows {lo}-{hi - 1} at step {step}")


def capture(objects: dict[str, Any], values: dict[str, Any], step: int, copy: bool = False) -> Held:
    """This rank's shards and the rest, from the objects as they are (their process
    group may be gone: nothing here communicates). ``copy``: the rows copied to host
    memory (a snapshot), else views of the objects' own (a survivor's, kept while the
    objects are replaced)."""
    dtensor = _dtensor()
    settle(objects)
    pieces: list[Piece] = []

    def piece(key: str, t: DTensor) -> None:
        local = t.to_local().detach()
        kept = local.to("cpu", copy=True) if copy else local
        pieces.append(Piece(step, key, *_rows(t), kept))

    names = _param_names(objects)
    modules: dict[str, dict[str, Any]] = {}
    for name, model in _models(objects).items():
        modules[name] = {}
        for key, t in model.state_dict().items():
            if isinstance(t, dtensor):
                piece(f"{name}.{key}", t)
            else:
                modules[name][key] = t.detach()
    optims: dict[str, Any] = {}
    for oname, opt in _optimizers(objects).items():
        state: dict[str, dict[str, Any]] = {}
        for p in _opt_params(opt):
            q = names.get(id(p))
            if q is None or p not in opt.state:
                continue
            state[q] = {}
            for k, v in opt.state[p].items():
                if isinstance(v, dtensor):
                    piece(f"{oname}:{q}:{k}", v)
                else:
                    state[q][k] = v
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[id(p)] for p in g["params"]],
            }
            for g in opt.param_groups
        ]
        optims[oname] = {"state": state, "param_groups": groups}
    others = {
        k: o.state_dict()
        for k, o in objects.items()
        if k not in modules and k not in optims and hasattr(o, "state_dict")
    }
    rest = {"step": step, "values": values, "modules": modules, "optims": optims, "others": others}
    return Held(pieces, {step: snapshot.to_bytes(rest)})  # packed: a copy


def keep(objects: dict[str, Any], values: dict[str, Any], step: int, buddy_distance: int) -> Held:
    """A snapshot of this rank's shards in host memory, and a copy of them on the rank
    ``buddy_distance`` ranks on (the same local rank of the next node), which in turn
    gives this rank its copy of the rank as far back: a lost node's rows survive on the
    next one. All ranks together (the control group)."""
    mine = capture(objects, values, step, copy=True)
    world, rank = comm.world(), comm.rank()
    if buddy_distance <= 0 or buddy_distance >= world:
        return mine  # one node: nowhere else to keep a copy
    rows = {f"{p.key}\t{p.lo}\t{p.hi}": p.tensor for p in mine.pieces}
    got = comm.control().swap(
        snapshot.to_bytes(rows), (rank + buddy_distance) % world, (rank - buddy_distance) % world
    )
    theirs = [
        Piece(step, key, int(lo), int(hi), t)
        for name, t in snapshot.parse(got).items()
        for key, lo, hi in [name.split("\t")]
    ]
    return Held(mine.pieces + theirs, mine.rests)


@dataclass(frozen=True)
class Outcome:
    """What ``exchange`` did: the step restored (-1: nothing anywhere), where from
    ("memory"; "disk": the caller loads DCP's checkpoint; "nothing"), the rows sent
    between ranks, and why."""

    step: int
    source: str
    sent: int
    reason: str


def _param_of(key: str) -> str:
    """The parameter an optimizer key ("opt:model.fqn:exp_avg") belongs to; a model key
    is its own."""
    return key.split(":")[1] if ":" in key else key


def exchange(
    objects: dict[str, Any], values: dict[str, Any], held: Held | None, disk_step: int
) -> Outcome:
    """Fill ``objects`` (built on the new group) with the newest state that memory holds
    whole, on every rank together. ``disk_step``: this rank's newest complete DCP
    checkpoint (-1: none, or not looked). When no step is held whole, or the disk holds a
    newer one, nothing is loaded and the outcome says "disk"."""
    dtensor = _dtensor()
    held = held or Held()
    new_rows = {
        f"{name}.{key}": _rows(t)
        for name, model in _models(objects).items()
        for key, t in model.state_dict().items()
        if isinstance(t, dtensor)
    }
    everyone = _all_gather(
        {
            "offers": [(p.step, p.key, p.lo, p.hi, str(p.tensor.dtype)) for p in held.pieces],
            "values": sorted(held.rests),
            "rows": new_rows,
            "disk": disk_step,
        }
    )
    offers = [
        Offer(rank=r, step=step, key=k, lo=lo, hi=hi)
        for r, m in enumerate(everyone)
        for step, k, lo, hi, _ in m["offers"]
    ]
    dtypes = {k: d for m in everyone for _, k, _, _, d in m["offers"]}
    needs = [
        Need(rank=r, key=k, lo=span[0], hi=span[1])
        for r, m in enumerate(everyone)
        for k in sorted(dtypes)
        if (span := m["rows"].get(_param_of(k))) is not None
    ]
    decided = plan(offers, needs, {r: set(m["values"]) for r, m in enumerate(everyone)})
    disk = max(m["disk"] for m in everyone)
    if isinstance(decided, NoPlan) or disk > decided.step:
        why = decided.reason if isinstance(decided, NoPlan) else "the disk holds a newer step"
        return Outcome(step=disk, source="disk" if disk >= 0 else "nothing", sent=0, reason=why)
    me = comm.rank()
    optim_rows = _fill(objects, decided, held, dtypes, me)
    mine = held.rests.get(decided.step) if me == decided.values_from else None
    rest = snapshot.parse(comm.control().broadcast(mine, decided.values_from))
    _load_rest(objects, values, rest, optim_rows)
    return Outcome(step=decided.step, source="memory", sent=decided.sent(), reason=decided.reason)


def _all_gather(obj: Any) -> list[Any]:
    d = comm.dist()
    group = comm.control().group()
    if d is None or group is None:
        return [obj]
    out: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(out, obj, group=group)
    return out


def _fill(
    objects: dict[str, Any], decided: Plan, held: Held, dtypes: dict[str, str], me: int
) -> dict[str, torch.Tensor]:
    """Carry out the moves. Model rows go straight into the new parameters' local parts;
    optimizer rows into new tensors shaped as their parameter's local part (returned by
    key, every optimizer key this rank's parameters have, empty parts included)."""
    import torch.distributed as dist

    dtensor = _dtensor()
    targets: dict[str, tuple[int, torch.Tensor]] = {}
    for name, model in _models(objects).items():
        for key, t in model.state_dict().items():
            if isinstance(t, dtensor):
                targets[f"{name}.{key}"] = (_rows(t)[0], t.to_local())
    for key, dtype in dtypes.items():
        if ":" in key and _param_of(key) in targets:
            first, like = targets[_param_of(key)]
            kind = getattr(torch, dtype.removeprefix("torch."))
            targets[key] = (first, torch.empty_like(like, dtype=kind))
    device = next((t.device for _, t in targets.values()), torch.device("cpu"))
    with torch.no_grad():
        for m in decided.moves:
            first, out = targets[m.key]
            view = out[m.lo - first : m.hi - first]
            if m.src == me:
                part = held.find(m.key, decided.step, m.lo, m.hi)
                if m.dst == me:
                    view.copy_(part)
                else:
                    dist.send(part.to(device).contiguous(), dst=m.dst)  # a copy: host
            elif m.dst == me:
                got = view if view.is_contiguous() else torch.empty_like(view)
                dist.recv(got, src=m.src)
                if got is not view:
                    view.copy_(got)
    return {k: t for k, (_, t) in targets.items() if ":" in k}


def _load_rest(
    objects: dict[str, Any],
    values: dict[str, Any],
    rest: dict[str, Any],
    optim_rows: dict[str, torch.Tensor],
) -> None:
    """The part every rank holds whole into the new objects; each optimizer's state, its
    received rows made DTensors placed as their parameter is now."""
    dtensor = _dtensor()
    models = _models(objects)
    with torch.no_grad():
        for name, model in models.items():
            sd = model.state_dict()
            for key, v in rest["modules"].get(name, {}).items():
                sd[key].copy_(v)
    params = {
        f"{name}.{fqn}": p for name, model in models.items() for fqn, p in model.named_parameters()
    }
    for oname, opt in _optimizers(objects).items():
        saved = rest["optims"].get(oname)
        if saved is None:
            continue
        index = {id(p): i for i, p in enumerate(_opt_params(opt))}
        state: dict[int, dict[str, Any]] = {
            index[id(params[q])]: dict(entry) for q, entry in saved["state"].items()
        }
        for key, local in optim_rows.items():
            o, q, k = key.split(":")
            if o != oname:
                continue
            p = params[q]
            placed = (
                dtensor.from_local(
                    local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
                if isinstance(p, dtensor)
                else local
            )
            state.setdefault(index[id(p)], {})[k] = placed
        groups = [
            {**g, "params": [index[id(params[q])] for q in g["params"]]}
            for g in saved["param_groups"]
        ]
        opt.load_state_dict({"state": state, "param_groups": groups})
    for name, sd in rest["others"].items():
        obj = objects.get(name)
        if obj is not None and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(sd)
    values.update(rest["values"])
    values["step"] = int(rest["step"])


def replace(objects: dict[str, Any], made: Any) -> None:
    """Put what the script's ``reshard`` returned in place of the objects of the same
    names; refuse what would leave an object bound to the old group."""
    if not isinstance(made, dict):
        raise TypeError(
            f"reshard() returned {type(made).__name__}: it returns a dict of the objects it "
            "made, by the names State holds them under ({'model': ..., 'optimizer': ...})"
        )
    for name, obj in made.items():
        old = objects.get(name)
        if old is None:
            raise ValueError(
                f"reshard() returned {name!r}, which State does not hold (it holds "
                f"{sorted(objects)}): give it to State(...) too"
            )
        for kind in (torch.nn.Module, torch.optim.Optimizer):
            if isinstance(old, kind) != isinstance(obj, kind):
                raise TypeError(
                    f"reshard() returned a {type(obj).__name__} as {name!r}, "
                    f"which is a {type(old).__name__}"
                )
    replaced = {id(objects[n]): n for n in made}
    for name, obj in objects.items():
        held = getattr(obj, "optimizer", None)
        if name not in made and id(held) in replaced:
            raise ValueError(
                f"{name!r} holds the optimizer {replaced[id(held)]!r} that reshard() replaces: "
                "make it in reshard() too and return it"
            )
    objects.update(made)
