"""Which of a rank's TCP connections are its process group's: those whose other end a
peer rank of the group holds, and those to the round's store.

What appeared while the group formed is only a guess: another thread of the script may
have connected meanwhile (a logging or metrics client reconnecting), and a group formed
before elastic watched (the script bound ``init_process_group`` before importing
elastic) leaves no better guess than every connection of the process. The ranks can
tell exactly together: each publishes the two addresses of its candidates in the
round's store, and a candidate is the group's when a peer holds its mirror (the same
two addresses, swapped). gloo connects every pair of ranks, so each peer mirrors at
least one; one that mirrors none (it has not said, or said for another group) leaves
every candidate the group's, since a group connection left uncut leaves a collective
blocked, where a script's connection cut costs the script a reconnect.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Addr = tuple[str, int]
Ends = tuple[Addr, Addr]  # (this end, the other end)
Conn = tuple[int, Any, Any]  # (fd, local address, remote address), as ``group`` reads them


def key(rank: int) -> str:
    """The store key under which ``rank`` says the ends of its candidates."""
    return f"elastic/ends/{rank}"


def _host(host: str) -> str:
    """One spelling per address: an IPv4 address seen through an IPv6 socket
    (``::ffff:10.0.0.1``, as torch's store connects) is the IPv4 one."""
    host = host.lower()
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def addr(a: Any) -> Addr:
    return _host(str(a[0])), int(a[1])


def of(conn: Conn) -> Ends:
    return addr(conn[1]), addr(conn[2])


def encode(conns: Iterable[Conn]) -> bytes:
    return json.dumps(sorted([*of(c)[0], *of(c)[1]] for c in conns)).encode()


def decode(raw: bytes) -> set[Ends]:
    """A peer's ends; none where the value is not what ``encode`` writes."""
    try:
        rows = json.loads(raw)
        return {((_host(a), int(p)), (_host(b), int(q))) for a, p, b, q in rows}
    except (ValueError, TypeError):
        return set()


@dataclass(frozen=True)
class Narrowed:
    """The group's connections among the candidates, and why."""

    group: frozenset[Conn]
    why: str


def narrow(
    mine: Iterable[Conn],
    peers: Mapping[int, set[Ends]],
    rank: int,
    world: int,
    store: Iterable[Addr],
) -> Narrowed:
    """Of ``mine`` (this rank's candidates), those a peer holds the other end of
    (``peers``: rank to the ends it said), and those to the round's ``store``
    (its addresses); every candidate where a peer of the ``world`` mirrors none."""
    mine = frozenset(mine)
    mirrors = {c: (of(c)[1], of(c)[0]) for c in mine}
    wanted = set(mirrors.values())
    for peer in range(world):
        if peer != rank and not wanted & peers.get(peer, set()):
            return Narrowed(mine, f"rank {peer} holds no end of them: all {len(mine)} kept")
    theirs = set().union(*peers.values()) if peers else set()
    stores = {addr(a) for a in store}
    group = frozenset(c for c in mine if mirrors[c] in theirs or of(c)[1] in stores)
    spared = len(mine) - len(group)
    return Narrowed(group, f"{len(group)} the group's, {spared} the script's own")
