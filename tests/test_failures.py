"""Whose fault a worker's end was (``elastic.agent.failures``), read from a real process's
stderr through the agent's own pump: a collective that failed because a peer vanished is
a consequence, however the interpreter then went down."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.agent.failures import collect, last_line
from elastic.agent.logs import ERR, Pump, StreamPlan

GLOO_RESET = (  # what gloo raises
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
    "Read error [127.0.0.1]:35735: Connection reset by peer"
)
# as a worker whose all-reduce failed ends about 1 time in 3 (torch 2.13, a peer SIGKILLed
# mid-transfer of 16 MB): its traceback, then, as the interpreter exits, gloo's thread
# frees the failed work's tensors, cannot take the GIL, and the C++ runtime aborts
DIES = """
import os, sys
try:
    raise RuntimeError({error!r})
except RuntimeError:
    import traceback
    for line in traceback.format_exc().splitlines(True):
        sys.stderr.write("[rank1]: " + line)  # torch's prefix, once a group exists
if {aborts}:
    sys.stderr.write("terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()
sys.exit(1)
"""


def _ends(error: str, aborts: bool) -> tuple[int, Pump]:
    """Run a worker that dies of ``error`` (aborting, or exiting 1), its stderr pumped
    as the agent pumps it; (its exit code, the pump once the stream ended)."""
    code = DIES.format(error=error, aborts=aborts)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    assert proc.stderr is not None
    pump = Pump(proc.stderr, ERR, StreamPlan(console=True, prefix=b"", file=None))
    rc = proc.wait(timeout=30)
    pump.thread.join(10)
    return rc, pump


@pytest.mark.parametrize("aborts", [True, False])
def test_a_peer_gone_collective_is_a_consequence_even_when_the_exit_aborts(aborts: bool) -> None:
    rc, pump = _ends(GLOO_RESET, aborts)
    assert rc == (-6 if aborts else 1)
    assert pump.held, "its traceback waits for the agent's verdict, not printed at once"
    failure = collect(1, 1, 4242, rc, "", stderr_tail=pump.tail)
    assert failure.consequence
    assert failure.message == f"[rank1]: RuntimeError: {GLOO_RESET}"


def test_an_error_of_its_own_that_aborts_is_its_own_failure() -> None:
    rc, pump = _ends("shapes do not match", aborts=True)
    failure = collect(1, 1, 4242, rc, "", stderr_tail=pump.tail)
    assert rc == -6 and not failure.consequence and not pump.held


def test_killed_after_a_peer_gone_traceback_is_not_read_as_its_end() -> None:
    """SIGKILL (the OOM killer, say) is not the exception's doing: its own failure."""
    tail = f"Traceback (most recent call last):\n  ...\nRuntimeError: {GLOO_RESET}\n"
    assert not collect(1, 1, 4242, -9, "", stderr_tail=tail).consequence
    assert collect(1, 1, 4242, 1, "", stderr_tail=tail).consequence


def test_the_exception_line_is_read_past_the_runtimes_last_words() -> None:
    end = "terminate called without an active exception"
    tb = f"Traceback (most recent call last):\nRuntimeError: {GLOO_RESET}\n\n{end}\n"
    assert last_line(tb) == f"RuntimeError: {GLOO_RESET}"
    assert last_line("terminate called after throwing an instance of 'x'\n") == ""
    assert last_line("") == ""


def test_the_exception_line_is_read_before_the_frames_pybind11_lists_after_it() -> None:
    """A peer lost under DDP's comm hook: the exception raised in its callback ends with
    "At:" and its frames, each line prefixed by the rank; it was read as the worker's own
    failure (the last line, a frame) and charged a restart (respawn, a standby taking
    over: benchmarks/faults.py)."""
    error = (
        f"[rank0]: RuntimeError: Got the following error when running the callback: {GLOO_RESET}"
    )
    tail = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "train.py", line 64, in train',
            error,
            "[rank0]: At:",
            "[rank0]:   /work/elastic/worker/doorbell.py(212): done",
            "[rank0]:   /usr/lib/python3.11/threading.py(1045): _bootstrap_inner",
        ]
    )
    assert last_line(tail) == error
    failure = collect(0, 0, 4242, 1, "", stderr_tail=tail)
    assert failure.consequence and failure.message == error
    assert last_line("At:\nx.py(1): f") == "x.py(1): f"  # no exception line before it
    assert last_line("ValueError: bad\nfile.py(3): not a frame list") == (
        "file.py(3): not a frame list"
    )
