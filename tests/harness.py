"""Child processes for tests: JSON events read from stdout, bounded waits, sure cleanup."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rendezvous.net import ephemeral_floor, server_port

ROOT = Path(__file__).resolve().parent.parent
TAG_VAR = "ELASTIC_RUN_TEST_TAG"


class Proc:
    """A process whose stdout lines are collected (JSON lines become events)."""

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        name: str = "",
    ) -> None:
        self.name = name or Path(cmd[1] if len(cmd) > 1 else cmd[0]).name
        self.cmd = cmd
        self.p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
            cwd=cwd or str(ROOT),
            start_new_session=True,
        )
        self.pid = self.p.pid
        self.events: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []  # events expect() has returned
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.p.stdout, self.out, True), daemon=True),
            threading.Thread(target=self._read, args=(self.p.stderr, self.err, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream, sink: list[str], parse: bool) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))
            if parse and line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    self.events.put(json.loads(line))

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def expect(
        self,
        event: str,
        timeout: float = 15.0,
        where: Callable[[dict], bool] | None = None,
        **match: object,
    ) -> dict:
        """The next event named ``event`` (matching ``match``); fails with the output."""

        def wanted(ev: dict) -> bool:
            return _matches(ev, event, match) and (where is None or where(ev))

        return self._take(timeout, [(f"{event} {match}", wanted)])[0]

    def expect_each(self, timeout: float, *wanted: tuple[str, dict[str, object]]) -> list[dict]:
        """The next event of each of ``wanted`` ((name, match) pairs), in whichever order
        they come (two threads of the process print them); fails with the output."""
        tests = [(f"{e} {m}", functools.partial(_matches, event=e, match=m)) for e, m in wanted]
        return self._take(timeout, tests)

    def _take(self, timeout: float, tests: list[tuple[str, Callable[[dict], bool]]]) -> list[dict]:
        """The first event each of ``tests`` (what it waits for, the test) accepts, each
        event taken by one test at most; the others are passed over."""
        found: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(found) < len(tests):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(w for i, (w, _) in enumerate(tests) if i not in found)
                raise AssertionError(
                    f"{self.name}: no {missing} within {timeout}s\n{self.transcript()}"
                )
            try:
                ev = self.events.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            for i, (_, test) in enumerate(tests):
                if i not in found and test(ev):
                    found[i] = ev
                    self.seen.append(ev)
                    break
        return [found[i] for i in range(len(tests))]

    def has_seen(self, event: str) -> bool:
        return any(ev.get("event") == event for ev in self.seen)

    def wait_output(self, text: str, timeout: float = 30.0, stream: str = "any") -> str:
        """Wait until a line containing ``text`` was printed; returns the line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sinks = {"out": [self.out], "err": [self.err], "any": [self.out, self.err]}[stream]
            for sink in sinks:
                for line in list(sink):
                    if text in line:
                        return line
            time.sleep(0.05)
        raise AssertionError(
            f"{self.name}: {text!r} not printed within {timeout}s\n{self.transcript()}"
        )

    def transcript(self) -> str:
        return (
            "--- stdout\n"
            + "\n".join(self.out[-80:])
            + "\n--- stderr\n"
            + "\n".join(self.err[-80:])
        )

    def wait(self, timeout: float = 30.0) -> int:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout}s\n{self.transcript()}"
            ) from None
        for t in self._threads:
            t.join(timeout=5)
        return rc

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill_tree(self) -> None:
        """SIGKILL the process and every descendant (resumed first if frozen)."""
        try:
            procs = [psutil.Process(self.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(10)

    @property
    def alive(self) -> bool:
        return self.p.poll() is None


def python(script: str | Path, *args: str, **kw: object) -> list[str]:
    return [sys.executable, str(script), *map(str, args)]


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Every process (but this one) started under ``tag``, whoever its parent is now."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get(TAG_VAR) == tag:
                found.append(p)
    return found


def queued_to_send(pid: int, to: str | None = None) -> int:
    """Bytes waiting in the send queues of ``pid``'s TCP connections (``to``: those to
    that IPv4 address only): more than none stay there once a peer stopped reading and
    the connection is full (the kernel's own table, ``/proc/net/tcp``, matched to the
    process's sockets by inode)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)  # the header
            for line in f:
                fields = line.split()  # sl local remote st tx:rx tr:when retrnsmt uid timeout inode
                if fields[9] in inodes and (to is None or _ipv4(fields[2]) == to):
                    total += int(fields[4].split(":")[0], 16)
    return total


def _ipv4(field: str) -> str:
    """The IPv4 address of a ``/proc/net/tcp(6)`` address (its last 32 bits, stored in
    host order: of an IPv6 address that is not a mapped IPv4 one, something else)."""
    return socket.inet_ntoa(bytes.fromhex(field.split(":")[0][-8:])[::-1])


def until_send_blocked(pid: int) -> None:
    """Wait until ``pid``'s send to a peer that stopped reading fills the connection, and
    a moment more: its write is cut short and waits (``queued_to_send``)."""
    wait_until(lambda: queued_to_send(pid) > 0, 30, f"{pid}'s send fills the connection")
    time.sleep(0.1)


def until_formed(one_try: Callable[[Path], str | None], tmp_path: Path, tries: int = 3) -> None:
    """A test whose scenario rests on a race it cannot win every time: ``one_try`` runs
    it in a folder of its own under ``tmp_path`` and returns None once its assertions
    held, or why the scenario did not form; tried again, ``tries`` times at most, then
    failed with every why."""
    lost = []
    for attempt in range(tries):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        why = one_try(folder)
        if why is None:
            return
        lost.append(why)
    raise AssertionError(f"the scenario never formed in {tries} tries: {lost}")


def port_pair(taken: set[int] | None = None) -> int:
    """A port P with P+1 free too (the static form's etcd: --master-port + 1), P and P+1
    not in ``taken``, both below the range outgoing connections take
    (``rendezvous.net.server_port``): a port free alone let a test's node 0 fail on a
    P+1 another test's connection held, and a health check of an etcd not listening yet
    on a port in that range connected to itself (CI)."""
    taken = set(taken or ())
    floor = ephemeral_floor()
    for _ in range(100):
        port = server_port(avoid=taken | {floor - 1})
        if {port - 1, port, port + 1} & taken or port + 1 >= floor:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            taken.add(port)
            continue
    raise OSError("no free port pair")


def wait_until(
    cond: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def etcdctl(server, *args: str, user: str | None = None) -> str:
    """Run etcdctl (next to the etcd binary) against ``server``; returns stdout."""
    from elastic.agent.etcd_server import etcd_binary

    cmd = [str(Path(etcd_binary()).with_name("etcdctl")), f"--endpoints={server.client_url}"]
    tls = getattr(server, "tls", None)
    if tls:
        cmd += [f"--cacert={tls.ca}"]
        if tls.client_cert:
            cmd += [f"--cert={tls.client_cert}", f"--key={tls.client_key}"]
    if user:
        cmd += [f"--user={user}"]
    done = subprocess.run(
        cmd + list(args),
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "ETCDCTL_API": "3"},
    )
    if done.returncode:
        raise AssertionError(f"etcdctl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def echo_server() -> int:
    """A service of the script's own on loopback (its port): it echoes each byte back; a
    client killed mid-request ends its connection quietly (also ``benchmarks/faults.py``'s)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(64):
                conn.sendall(data)

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(server.getsockname()[1])


def _matches(ev: dict, event: str, match: dict[str, object]) -> bool:
    return ev.get("event") == event and all(ev.get(k) == v for k, v in match.items())
