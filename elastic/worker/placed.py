"""Whether a worker started ahead of its node's joining read its placement too early.

A newcomer's workers start before its node joins (``elastic/agent/lobby.py``), with the
ranks the next round is expected to give them, and wait in ``init_process_group``. When
the round places them otherwise (two nodes joined at the same moment, a member was lost
meanwhile), they can take the new ranks in place, as a re-forming worker does, if the
script has not read the expected ones: its own ``rank = int(os.environ["RANK"])``, or a
framework's at import (Lightning notes the rank). ``watch`` records the first read of a
placement variable through ``os.environ`` from the interpreter's start (the agent puts
``elastic/agent/lobby_site`` on a spawned worker's ``PYTHONPATH``, whose
``sitecustomize`` loads this file before the script runs; the fork server's child calls
it itself) until ``stop``, once the script waits in ``init_process_group``. Iterating
over the environment (``items()``, as tqdm does at import) reads nothing in particular
and is not counted; a copy of it all (``dict(os.environ)``) is, as a read of each.

No imports but the standard library's: ``sitecustomize`` loads this before ``elastic``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import ItemsView, Iterator, Mapping, ValuesView

EARLY = "_elastic_run_placed"  # this file's name as sitecustomize loads it, before elastic

WATCHED = frozenset(
    {
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "TORCHELASTIC_RESTART_COUNT",
    }
)

_first: str | None = None  # the first placement variable read while watched
_watched = False  # watching began (at the interpreter's start, or it says nothing)


class _Unwatched(Mapping[str, str]):
    """The environment read without counting (its iteration)."""

    def __init__(self, env: os._Environ[str]) -> None:
        self.env = env

    def __getitem__(self, key: str) -> str:
        return os._Environ.__getitem__(self.env, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)


class _Watched(os._Environ[str]):
    """``os.environ`` while it is watched (``watch`` to ``stop``)."""

    def __getitem__(self, key: str) -> str:
        global _first
        if _first is None and key in WATCHED:
            _first = key
        return super().__getitem__(key)

    def items(self) -> ItemsView[str, str]:
        return _Unwatched(self).items()

    def values(self) -> ValuesView[str]:
        return _Unwatched(self).values()


def watch() -> None:
    """Count reads of the placement variables from now on."""
    global _watched
    os.environ.__class__ = _Watched
    _watched = True


def stop() -> str | None:
    """Stop counting; the first placement variable the script read, or None."""
    if type(os.environ) is _Watched:
        setattr(os.environ, "__class__", os._Environ)  # noqa: B010 - mypy narrows the type
    return _first


def watched() -> bool:
    """Whether the reads were watched (the worker was started to be): else ``stop``'s
    None says nothing."""
    return _watched


# the module ``sitecustomize`` loaded holds what was read: ``elastic.worker.placed`` is it
if __name__ != EARLY and EARLY in sys.modules:
    sys.modules[__name__] = sys.modules[EARLY]
