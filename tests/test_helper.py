"""The helper-process base both the store host and the fork server stand on."""

from __future__ import annotations

import os

from harness import ROOT

from elastic.agent.helper import Helper


def test_a_helper_says_ready_answers_and_ends_when_the_agent_closes_it() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'scripts'}:{ROOT}"}
    h = Helper("echo_helper", env)
    try:
        assert h.receive(30) == {"ready": True}
        assert os.getsid(h.proc.pid) != os.getsid(0)  # its own session: no terminal Ctrl-C
        h.send({"n": 1})
        assert h.receive(10) == {"echo": {"n": 1}}
        assert h.exit_code is None
    finally:
        h.close()
    assert h.exit_code == 0  # it read the end of the stream and returned
