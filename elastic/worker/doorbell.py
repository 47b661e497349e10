"""Whether any rank wants the ranks to agree, asked inside DDP's gradient all-reduce.

``commit()`` agrees with the other ranks on a stop, a pause for a membership change, a
due snapshot or a new snapshot interval: one small all-reduce. Asked in a collective of
its own, even every ~10 steps (``agreement``), that question cost about a tenth of a 3 ms
DDP step on gloo here (1-2 ms a time). DDP all-reduces the gradients every step anyway,
so the question rides along: two elements more in the bucket DDP reduces first (index 0,
the smallest: DDP caps it at 1 MB), summed over the ranks: 1 in the first from a rank
that wants to agree (a stop, a pause, a new interval), 1 in the second from one whose
snapshot fell due. Every rank agrees at a step whose first is non-zero, and snapshots
without agreeing where only the second is: a snapshot every step costs no collective of
its own. A step whose gradients were not reduced (``no_sync``) falls back to
``agreement``'s schedule.

A comm hook is not free: DDP's C++ reduction scales the gradients as it copies them
into its buckets, and under a hook they are copied, then scaled, a pass of their own
(0.5-1 ms of a 12 ms step of a 4 MB model here); and a hook in Python costs about 100 us
a bucket beside DDP's C++ reduction, whatever the model (a tenth of a tiny model's 1 ms
step here). So the DDP around one of State's modules
is found at its first forward (a forward pre-hook on the module, until then and again
after each re-formation), that pass is timed and its buckets counted,
and the hook goes on only where it costs no more than the agreements it would replace
may (``agreement.bell_pays``: 2% of a step, weighed once the steps are timed, by every
rank: one that finds it does not pay keeps it off all of them; a DDP that already has a
hook of the script's own is left alone). It goes on inert (DDP's own
division and all-reduce, in Python), and folds the bell in
only once every rank said, in an agreement, that its DDP carries the hook: the ranks'
reductions always have the same size. A hook the script registers later (DDP takes one,
once) is handed the buckets once the ranks agreed to stop folding, one step later. CPU
buckets only: reading the bell out of a GPU bucket would make every step wait for the
device, so a CUDA model keeps the agreement's own collective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from elastic.worker.agreement import Bell, bell_pays

PROBE = 1 << 18  # elements of the scaled copy timed (1 MB of float32), scaled to the model


class Rung(NamedTuple):
    """What the ranks asked for in one reduction."""

    agree: bool
    snapshot: bool


class _Slot:
    """One DDP carrying the hook, and the comm hook the script registered on it after ours
    (DDP takes one hook: ours hands the script's its buckets)."""

    def __init__(self) -> None:
        self.theirs: tuple[object, Callable[..., Any]] | None = None


class Doorbell:
    """This rank's end of the bell. ``watch`` the State's objects; ``ready`` goes into the
    agreement, whose outcome ``fold`` takes; ``rang`` says, once per step, what the last
    reduction carried. ``pending()`` (asked during backward) says what this rank asks."""

    def __init__(self, pending: Callable[[], Rung]) -> None:
        self._pending = pending
        self._ddp: DistributedDataParallel | None = None  # the DDP carrying the hook
        self._slot: _Slot | None = None  # ... its slot
        self._seen: DistributedDataParallel | None = None  # found, not yet weighed
        self._pass_s = 0.0  # ... what a hook's pass over its gradients costs a step
        self._buckets = 1  # ... the buckets a hook is called for each step
        self._weighed: DistributedDataParallel | None = None  # the last one weighed
        self._proposed: DistributedDataParallel | None = None  # ... until the ranks settle it
        self.verdict: Bell | None = None  # ... whether the hook went on, and why
        self._modules: list[torch.nn.Module] = []  # State's, whose DDP carries the hook
        self._handles: list[Any] = []  # ... their forward pre-hooks, until it is found
        self.active = False  # every rank's DDP carries it: the bell is in the reduction
        self._reduced = 0  # reductions that carried the bell
        self._read = 0  # ... as of the last ``rang``
        self._rang = Rung(False, False)
        self._fold: _Fold | None = None

    def watch(self, objects: Iterable[Any]) -> None:
        """Look for the DDP of ``objects`` (again, after they were replaced)."""
        self._modules = [
            o.module if isinstance(o, DistributedDataParallel) else o
            for o in objects
            if isinstance(o, torch.nn.Module)
        ]
        self._listen()

    def _listen(self) -> None:
        """A forward pre-hook on each module, until its DDP is found: a module with a
        hook takes torch's slower call path, tens of us a step here."""
        self._unlisten()
        for module in self._modules:  # at a forward, when the script registered its own
            self._handles.append(module.register_forward_pre_hook(self._forward))

    def _unlisten(self) -> None:
        for h in self._handles:
            h.remove()  # safe inside the hook: torch calls a copy of the hooks
        self._handles.clear()

    def _forward(self, module: torch.nn.Module, _args: Any) -> None:
        ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
        if ddp is None or ddp.module is not module:
            return
        self._unlisten()  # a new DDP comes with a new group: ``forget`` listens again
        if ddp not in (self._seen, self._weighed):  # the same after ``watch``: known
            self._seen, self._pass_s, self._buckets = ddp, _pass_time(ddp), _bucket_count(ddp)

    def consider(self, step_s: float | None) -> None:
        """Weigh the DDP found (``bell_pays``) beside a step of ``step_s`` (None: not
        measured yet), as an agreement begins: the ranks settle it in that agreement
        (``declines``)."""
        ddp = self._seen
        if ddp is None or step_s is None:
            return
        self._seen, self._weighed = None, ddp
        self.verdict = bell_pays(self._pass_s, step_s, self._buckets)
        self._proposed = ddp

    @property
    def declines(self) -> bool:
        """This rank weighed a DDP and the hook would not pay here: what it says in the
        agreement. One rank's no is every rank's (``settle``): a hook on some ranks
        only never folds, and those ranks would pay its pass for nothing."""
        return self._proposed is not None and not (self.verdict and self.verdict.pays)

    def settle(self, declined: bool) -> None:
        """The ranks agreed on the DDP each weighed: the hook goes on unless one declined.
        Between steps: the next backward runs it."""
        ddp, self._proposed = self._proposed, None
        if ddp is None:
            return
        if declined and self.verdict is not None and self.verdict.pays:
            self.verdict = Bell(False, "another rank's figures say it would not pay there")
        if not declined:
            self._carry(ddp)

    def _carry(self, ddp: DistributedDataParallel) -> None:
        self._ddp, self._slot, self.active = None, None, False
        if (
            getattr(ddp, "_comm_hooks", None)  # the script's own (a built-in one: below)
            or ddp.process_group.size() != dist.get_world_size()  # the bell must reach all
            or any(p.device.type != "cpu" for p in ddp.module.parameters())
        ):
            return
        slot = _Slot()
        try:
            # unannotated, named as DDP checks them (this module's annotations are strings)
            hook = lambda state, bucket: self._hook(state, bucket, slot)  # noqa: E731
            ddp.register_comm_hook(ddp.process_group, hook)
        except RuntimeError:  # a built-in hook of the script's own
            return
        _adopt_later_hooks(ddp, slot)
        self._ddp, self._slot = ddp, slot

    def forget(self) -> None:
        """Let go of the DDP (a re-formation: it holds the old process group), and look
        for the one the script wraps on the new group."""
        self._ddp, self._slot, self.active = None, None, False
        self._seen = self._weighed = self._proposed = None
        self._listen()

    @property
    def ready(self) -> bool:
        """This rank's DDP carries the hook, and no hook of the script's own came since:
        what every rank must say before it folds (or goes on folding)."""
        return self._slot is not None and self._slot.theirs is None

    def fold(self, everyone_ready: bool) -> None:
        """The ranks agreed: the bell goes into the reductions from the next step, or not."""
        self.active = everyone_ready and self.ready

    def rang(self) -> Rung | None:
        """What the ranks asked in a reduction since the last call; None if none carried it."""
        if not self.active or self._reduced == self._read:
            return None
        self._read = self._reduced
        return self._rang

    def _hook(
        self, group: dist.ProcessGroup, bucket: dist.GradBucket, slot: _Slot
    ) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        if not (self.active and slot is self._slot and bucket.index() == 0):
            if slot.theirs is not None:
                state, theirs = slot.theirs
                out: torch.futures.Future[torch.Tensor] = theirs(state, bucket)
                return out
            buf.mul_(1.0 / group.size())  # as DDP's own does it: scaled first, then summed
            work = dist.all_reduce(buf, group=group, async_op=True)
            assert work is not None
            plain: torch.futures.Future[torch.Tensor] = work.get_future().then(
                lambda f: f.value()[0]
            )
            return plain
        fold = self._fold
        if fold is None or not fold.fits(buf):
            fold = self._fold = _Fold(buf)
        torch.mul(buf, 1.0 / group.size(), out=fold.head)
        asks = self._pending()
        if slot.theirs is not None:  # the script's hook came: every rank stops folding
            asks = Rung(True, asks.snapshot)
        fold.tail.copy_(fold.asks[asks])

        def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            f.value()  # raises a failed reduction's error (a peer lost): the step fails
            buf.copy_(fold.head)
            agree, snapshot = fold.tail.tolist()
            self._rang = Rung(agree > 0, snapshot > 0)
            self._reduced += 1
            return buf

        work = dist.all_reduce(fold.both, group=group, async_op=True)
        assert work is not None
        folded: torch.futures.Future[torch.Tensor] = work.get_future().then(done)
        return folded


def _adopt_later_hooks(ddp: DistributedDataParallel, slot: _Slot) -> None:
    """A comm hook the script registers on ``ddp`` after ours (DDP takes one, once) goes
    into ``slot``: ours hands it every bucket once the ranks stopped folding (the next
    agreement, which the bell asks for at once), and the first bucket until then, as
    DDP's own all-reduce would. Checked and refused as DDP does."""

    def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
        if slot.theirs is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        ddp._check_comm_hook(hook)
        if ddp.logger is not None:
            ddp.logger._set_comm_hook_name(hook.__qualname__)
        ddp._comm_hooks.append((hook, state))
        slot.theirs = (state, hook)

    def register_builtin_comm_hook(comm_hook_type: dist.BuiltinCommHookType) -> None:
        # DDP's C++ hooks, as the Python ones they equal
        builtin = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in builtin:
            raise ValueError(f"unknown built-in comm hook {comm_hook_type}")
        register_comm_hook(ddp.process_group, builtin[comm_hook_type])

    # instance attributes before the class's methods (a Module keeps plain values so)
    ddp.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
    ddp._register_builtin_comm_hook = register_builtin_comm_hook  # type: ignore[method-assign]


class _Fold:
    """The first bucket with the bell behind it, made once: a fresh tensor and a
    concatenation every step cost about 3% of a 2 ms step here. The reduced head is
    copied back into the bucket: DDP takes a hook's result in place of the bucket, but
    handed the head instead, a job of two 4-thread ranks on 2 cores trained its steps
    twice as slowly, its other DDP's too (``steady.py --width 768``: 76 against 38 ms).
    One buffer serves every step: DDP awaits a step's reductions before its backward
    ends."""

    def __init__(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        self.both = buf.new_empty(n + 2)
        self.head, self.tail = self.both[:n], self.both[n:]
        self.asks = {r: buf.new_tensor([float(r.agree), float(r.snapshot)]) for r in _RUNGS}

    def fits(self, buf: torch.Tensor) -> bool:
        """DDP rebuilds its buckets after the first step: the first may change size."""
        return self.head.numel() == buf.numel() and self.both.dtype == buf.dtype


_RUNGS = [Rung(a, s) for a in (False, True) for s in (False, True)]


def _bucket_count(ddp: DistributedDataParallel) -> int:
    """At most how many buckets ``ddp`` reduces a step (a comm hook is called for each):
    its gradients' bytes in a first bucket of its first cap, the rest in buckets of its
    cap (DDP fills a bucket past its cap with a parameter kept whole: maybe fewer)."""
    params = ddp.module.parameters()
    nbytes = int(sum(p.numel() * p.element_size() for p in params if p.requires_grad))
    config = getattr(ddp, "_bucket_config", None)
    first = int(getattr(config, "first_bucket_bytes_cap", 1 << 20))
    cap = max(1, int(getattr(ddp, "bucket_bytes_cap", 25 << 20)))
    return 1 + math.ceil(max(0, nbytes - first) / cap)


def _pass_time(ddp: DistributedDataParallel) -> float:
    """Seconds a scaled copy of ``ddp``'s gradients takes here: the pass a comm hook adds
    to each step (timed on at most ``PROBE`` elements, the best of three, scaled up)."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    if not n:
        return 0.0
    src = torch.ones(min(n, PROBE), dtype=params[0].dtype)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(3):
        began = time.perf_counter()
        torch.mul(src, 0.5, out=dst)
        best = min(best, time.perf_counter() - began)
    return float(best * n / src.numel())
