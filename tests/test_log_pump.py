"""The pump between a worker's stderr and the console: a C++ stack that torch's warning
about a vanished peer carries goes to the worker's stderr file, and the console gets the
warning and one line saying where the stack is; any other output is shown as it came."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from elastic.agent.logs import ERR, QUIET, Pump, StreamPlan

WARNING = (
    b"[W1207 12:23:10.203286104 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl("
    b"fd=9, addr=[::ffff:127.0.0.1]:34076, remote=[::ffff:127.0.0.1]:57797): Connection "
    b"reset by peer\n"
)
STACK = (
    b"Exception raised from recvBytes at /__w/pytorch/torch/csrc/distributed/c10d/Utils.hpp:784"
    b" (most recent call first):\n"
    + b"".join(
        b"frame #%d: c10::Error::Error() + 0x9d (0x7fb0 in libc10.so)\n" % i for i in range(3)
    )
    + b"<omitting python frames>\n"
    + b"frame #3: <unknown function> + 0x64b425 (0x7fb0 in libtorch_python.so)\n\n"
)


def pump(tmp_path: Path, data: bytes, *, tee: bool = False) -> Path:
    """``data`` through a Pump of stderr to the console, as the agent sets one up (tee'd
    to the worker's stderr file, or not); returns that file's path."""
    kept = tmp_path / "stderr.log"
    file = open(kept, "wb") if tee else None  # noqa: SIM115 - closed below
    read, write = os.pipe()
    p = Pump(os.fdopen(read, "rb"), ERR, StreamPlan(True, b"", file, kept=kept))
    os.write(write, data)
    os.close(write)
    p.thread.join(10)
    if file is not None:
        file.close()
    return kept


@pytest.mark.parametrize("tee", [False, True], ids=["console", "tee"])
def test_a_peer_gone_warnings_cpp_stack_is_kept_off_the_console(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], tee: bool
) -> None:
    after = b"re-formed live: rank 0 of 2 at step 107 in 0.24s\n"
    kept = pump(tmp_path, WARNING + STACK + after, tee=tee)
    err = capfd.readouterr().err
    note = f"(its C++ stack, 4 frames, left off the console: in {kept})\n"
    assert err == (WARNING + note.encode() + after).decode(), err
    assert STACK in kept.read_bytes()


def test_other_output_and_other_stacks_are_shown_as_they_came(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    own = b"[W1207 12:00:00.0 init.cpp:1] a warning of the script's own\n"
    traceback = b"Traceback (most recent call last):\n  File 'x.py', line 1\nValueError: no\n"
    data = own + STACK + b"frame #9 is a line of the script's\n" + traceback
    kept = pump(tmp_path, data)
    assert capfd.readouterr().err == data.decode()
    assert not kept.exists()


def test_a_stack_at_the_end_of_the_stream_is_kept_too(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    kept = pump(tmp_path, WARNING + STACK)
    assert "left off the console" in capfd.readouterr().err
    assert kept.read_bytes() == STACK


def test_a_c10d_errors_stack_is_kept_off_the_console_and_ends_at_its_empty_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """An abandoned round's store, still tried by a connect left to finish: an error of
    c10d's own that names no vanished peer; the line after the stack's empty line shows."""
    error = (
        b"[rank1]:[E1207 12:24:51.519982130 TCPStore.cpp:328] [c10d] TCP client failed to "
        b"connect/validate to host 127.0.0.1:38225 - timed out (try=1, timeout=250ms)\n"
    )
    after = b"restored step 120 (from rank 0, sent over the process group) in 0.22s\n"
    kept = pump(tmp_path, error + STACK + after)
    note = f"(its C++ stack, 4 frames, left off the console: in {kept})\n"
    assert capfd.readouterr().err == (error + note.encode() + after).decode()


def test_the_note_comes_as_the_stack_ends_not_with_the_next_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The worker prints nothing more for a while (it trains): the note is not held back
    for ``QUIET`` seconds, since c10's empty line ends the stack."""
    read, write = os.pipe()
    p = Pump(os.fdopen(read, "rb"), ERR, StreamPlan(True, b"", None, kept=tmp_path / "e.log"))
    os.write(write, WARNING + STACK)
    seen = ""
    deadline = time.monotonic() + QUIET / 2
    while "left off the console" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
        seen += capfd.readouterr().err
    os.close(write)
    p.thread.join(10)
    assert "left off the console" in seen, seen
