"""The store helper's own process (see ``storehost``): ``python -m
elastic.agent.store_server FD``, FD a Unix SOCK_SEQPACKET socket to the agent.

Once torch is imported it sends ``{"ready": true}``. Requests are JSON messages:
``{"host": ADDR, "port": P}`` (replied to with ``{"ok": true}`` or ``{"error": "..."}``)
replaces the hosted store with a fresh one on P; ``{"drop": true}`` drops it. The
process ends when the agent closes the socket.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import socket

from elastic.agent.helper import agent_socket, say_ready

STORE_TIMEOUT = datetime.timedelta(seconds=900)


def serve(sock: socket.socket) -> None:
    from torch.distributed import TCPStore  # the point of this process: torch, off the agent

    say_ready(sock)
    store = None  # kept referenced: the store lives as long as this variable holds it
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return
        msg = json.loads(data)
        store = None  # one round, one store: the previous one goes first
        if "host" not in msg:
            continue
        try:
            store = TCPStore(  # noqa: F841 - held, not used: it serves until replaced
                host_name=msg["host"],
                port=int(msg["port"]),
                is_master=True,
                wait_for_workers=False,
                multi_tenant=True,
                timeout=STORE_TIMEOUT,
            )
            reply: dict[str, object] = {"ok": True}
        except (RuntimeError, OSError) as e:
            reply = {"error": str(e)}
        sock.send(json.dumps(reply).encode())


if __name__ == "__main__":
    # OSError: the agent went (a close with the "ready" unread resets the socket)
    with contextlib.suppress(KeyboardInterrupt, OSError):
        serve(agent_socket())
