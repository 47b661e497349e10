"""A helper process for tests/test_helper.py: ready at once, echoes each message."""

from __future__ import annotations

import json

from elastic.agent.helper import agent_socket, say_ready

sock = agent_socket()
say_ready(sock)
while data := sock.recv(1 << 16):
    sock.send(json.dumps({"echo": json.loads(data)}).encode())
