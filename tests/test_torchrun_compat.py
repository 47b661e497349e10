"""The same command line under stock torchrun and under elastic-run, in the same test.

Each test runs torchrun 2.13 and elastic-run with identical flags and compares what a
user sees: exit codes, worker output and environment, log layout. A difference is a
failing test; the differences docs/torchrun.md documents are asserted as
documented.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, TypeVar

import pytest
from harness import ROOT, port_pair

pytestmark = pytest.mark.slow
T = TypeVar("T")


class Batched(NamedTuple):
    """A run of ``BATCH``: what it did, and its own log dir."""

    done: subprocess.CompletedProcess
    logs: Path


SCRIPT = str(ROOT / "tests" / "scripts" / "compat.py")
ECHO = str(ROOT / "tests" / "scripts" / "echo.py")
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "elastic-run": [sys.executable, "-m", "elastic"],
}


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    return {**base, "OMP_NUM_THREADS": "1", **extra}


def run(
    who: str, *args: str, stdin: str | None = None, cwd: Path = ROOT, **extra: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAUNCHERS[who], *args],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(cwd),
        env=env(**extra),
    )


def each(fn: Callable[[str], T]) -> dict[str, T]:
    """``fn(launcher)`` for both launchers, side by side: they share no port or file."""
    with ThreadPoolExecutor(len(LAUNCHERS)) as pool:
        futures = {who: pool.submit(fn, who) for who in LAUNCHERS}
        return {who: f.result() for who, f in futures.items()}


def both(*args: str, **kw: object) -> dict[str, subprocess.CompletedProcess]:
    return each(lambda who: run(who, *args, **kw))  # type: ignore[arg-type]


def lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.strip())


# Command lines that share no port, file or input: both launchers run each of them up
# front, several at once (most of a run is torchrun's ``import torch``), and the tests
# below read what they did. ``{logs}``: a log dir of the command line's own.
CONSOLE = {
    "plain": ("--nproc-per-node", "2"),
    "tee": ("--nproc-per-node", "2", "--tee", "3"),
    "tee-stdout-redirect-stderr": ("--nproc-per-node", "2", "--tee", "1", "--redirects", "2"),
    "filter": ("--nproc-per-node", "2", "--local-ranks-filter", "1"),
    "tee-filter": ("--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "0"),
}
SCRIPT_RUNS = {
    "module": ("-m", "json.tool", "--help"),
    "no-python": ("--no-python", "echo", "hi"),
    "run-path": ("--run-path", ECHO),
}
REFUSED = {
    "no-python-with-module": ("--no-python", "--module", ECHO),
    "nproc-unknown": ("--nproc-per-node", "unknown", ECHO),
    "logs-specs": ("--logs-specs", "DOESNOT_EXIST", ECHO),
    "unknown-flag": ("--nprocs", "2", ECHO),
    "no-script": (),
}
TWO = ("--nproc-per-node", "2")
TEMPLATE = "${role_name}-${rank}-${local_rank}| "
BATCH: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    **{f"console-{k}": (("--log-dir", "{logs}", *v, ECHO), {}) for k, v in CONSOLE.items()},
    **{f"script-{k}": (("--nproc-per-node", "1", *v), {}) for k, v in SCRIPT_RUNS.items()},
    **{f"refused-{k}": (v, {}) for k, v in REFUSED.items()},
    "prefix": (
        ("--nproc-per-node", "2", "--tee", "3", ECHO),
        {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": TEMPLATE},
    ),
    "log-dir": (("--log-dir", "{logs}", "--rdzv-id", "j", "-r", "3", "-t", "0", *TWO, ECHO), {}),
    "abbreviated": (("--redirect=3", "--nproc-per-node", "2", ECHO), {}),
    "other-backends": (("--standalone", "--rdzv-conf", "join_timeout=30,store_type=tcp", ECHO), {}),
    "nobody-reads": (("--standalone", "--rdzv-conf", "join_timout=30", ECHO), {}),
    "quoted": (
        ("--standalone", "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", ECHO),
        {},
    ),
}
AT_ONCE = 4  # runs at a time: more only queue for the two cores


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Batched]]:
    """What each of ``BATCH`` did under each launcher."""
    base = tmp_path_factory.mktemp("compat")

    def one(job: tuple[str, str]) -> Batched:
        name, who = job
        args, extra = BATCH[name]
        logs = base / name / who
        done = run(who, *(a.format(logs=logs) for a in args), **extra)  # type: ignore[arg-type]
        return Batched(done, logs)

    jobs = [(name, who) for name in BATCH for who in LAUNCHERS]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        done = list(pool.map(one, jobs))
    out: dict[str, dict[str, Batched]] = {name: {} for name in BATCH}
    for (name, who), d in zip(jobs, done, strict=True):
        out[name][who] = d
    return out


def port_pairs() -> dict[str, int]:
    """A port pair for each launcher, all four ports distinct."""
    ports: dict[str, int] = {}
    for who in LAUNCHERS:
        ports[who] = port_pair({p + i for p in ports.values() for i in (0, 1)})
    return ports


def static_job(who: str, port: int) -> list[subprocess.CompletedProcess]:
    flags = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    procs = [
        subprocess.Popen(
            [*LAUNCHERS[who], *flags, "--node-rank", str(rank), SCRIPT, "--allreduce"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=str(ROOT),
            env=env(),
        )
        for rank in (1, 0)  # the second node starts first: ranks still follow --node-rank
    ]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            p.kill()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_static_multi_node_form() -> None:
    for who in LAUNCHERS:  # one after the other: four agents at once crowd two cores
        port = port_pair()
        node1, node0 = static_job(who, port)
        assert node0.returncode == node1.returncode == 0, (who, node0.stderr, node1.stderr)
        assert lines(node0.stdout) == [f"rank 0/2 group 0 port {port} sum 1"], who
        assert lines(node1.stdout) == [f"rank 1/2 group 1 port {port} sum 1"], who


def test_c10d_style_endpoint_that_is_not_an_etcd() -> None:
    """pytorch/examples' run_example.sh line: the agent on that host serves it."""
    flags = ("--nnodes=1", "--nproc_per_node=2", "--rdzv_id=101")
    ports = port_pairs()
    got = each(
        lambda who: run(
            who, *flags, f"--rdzv_endpoint=localhost:{ports[who]}", SCRIPT, "--allreduce"
        )
    )
    for who, done in got.items():
        assert done.returncode == 0, (who, done.stderr)
        assert [re.sub(r"port \d+", "port P", s) for s in lines(done.stdout)] == [
            "rank 0/2 group 0 port P sum 1",
            "rank 1/2 group 0 port P sum 1",
        ], who
    assert "serving the job's etcd at localhost" in got["elastic-run"].stderr


def test_master_port_is_the_workers_and_tcp_init_works() -> None:
    ports = port_pairs()
    got = each(lambda who: run(who, "--nproc-per-node", "2", "--master-port", str(ports[who]),
                               SCRIPT, "--allreduce", "--tcp"))  # fmt: skip
    for who, done in got.items():
        port = ports[who]
        assert done.returncode == 0, (who, done.stderr)
        assert lines(done.stdout) == [
            f"rank 0/2 group 0 port {port} sum 1",
            f"rank 1/2 group 0 port {port} sum 1",
        ], who


def test_stdin_reaches_the_worker() -> None:
    for who, done in both("--nproc-per-node", "1", SCRIPT, "--stdin", stdin="42\n").items():
        assert done.returncode == 0, (who, done.stderr)
        assert lines(done.stdout) == ["rank 0 read '42'"], who


def test_abbreviated_flags(ran: dict[str, dict[str, Batched]]) -> None:
    for who, (done, _) in ran["abbreviated"].items():
        assert done.returncode == 0, (who, done.stderr)
        assert "hello" not in done.stdout and "complaint" not in done.stderr, who


def test_rdzv_conf_keys_of_other_backends(ran: dict[str, dict[str, Batched]]) -> None:
    got = {who: b.done for who, b in ran["other-backends"].items()}
    for who, done in got.items():
        assert done.returncode == 0, (who, done.stderr)
        assert lines(done.stdout) == ["hello from 0"], who
    assert "store_type: a key of torchrun's backends, no effect" in got["elastic-run"].stderr


def test_rdzv_conf_keys_nobody_reads_and_quotes_left_by_a_list_command_line(
    ran: dict[str, dict[str, Batched]],
) -> None:
    """A key no backend reads is ignored by both (elastic-run names it and the key it
    resembles); PyTorch's own launcher tests pass the value with literal quotes."""
    got = {who: b.done for who, b in ran["nobody-reads"].items()}
    quoted = {who: b.done for who, b in ran["quoted"].items()}
    for who in LAUNCHERS:
        for done in (got[who], quoted[who]):
            assert done.returncode == 0, (who, done.stderr)
            assert lines(done.stdout) == ["hello from 0"], who
    assert "join_timout: no rendezvous reads this key; ignored (did you mean join_timeout?)" in (
        got["elastic-run"].stderr
    )


def test_file_timer_watchdog_kills_the_expired_worker() -> None:
    got = both("--nproc-per-node", "1", SCRIPT, "--timer", TORCHELASTIC_ENABLE_FILE_TIMER="1")
    for who, done in got.items():
        assert "not reached" not in done.stdout, who
        assert done.returncode != 0, who
    # torchrun's watchdog SIGKILLs its own agent too (no report); elastic-run reports
    assert got["torchrun"].returncode == -signal.SIGKILL
    ours = got["elastic-run"]
    assert ours.returncode == 1 and "its file timer 'slow_step' expired" in ours.stderr


@pytest.mark.parametrize("flags", CONSOLE)
def test_console_output_is_the_same(flags: str, ran: dict[str, dict[str, Batched]]) -> None:
    got = ran[f"console-{flags}"]
    theirs, ours = got["torchrun"].done, got["elastic-run"].done
    assert theirs.returncode == ours.returncode == 0, ours.stderr
    assert lines(ours.stdout) == lines(theirs.stdout)
    worker_err = [s for s in lines(theirs.stderr) if "complaint" in s]
    assert [s for s in lines(ours.stderr) if "complaint" in s] == worker_err


def test_prefix_template_with_tee(ran: dict[str, dict[str, Batched]]) -> None:
    got = {who: b.done for who, b in ran["prefix"].items()}
    assert lines(got["elastic-run"].stdout) == lines(got["torchrun"].stdout)
    assert "default-1-1| hello from 1" in got["elastic-run"].stdout


def test_log_dir_layout(ran: dict[str, dict[str, Batched]]) -> None:
    got = ran["log-dir"]
    for done, _ in got.values():
        assert done.returncode == 0, done.stderr
    layout = {}
    for who in LAUNCHERS:
        (run_dir,) = got[who].logs.iterdir()  # <log-dir>/<run id>_<suffix>/: one per run
        layout[who] = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.log"))
    assert layout["elastic-run"] == layout["torchrun"]


@pytest.mark.parametrize("flags", SCRIPT_RUNS)
def test_how_the_script_runs(flags: str, ran: dict[str, dict[str, Batched]]) -> None:
    got = {who: b.done for who, b in ran[f"script-{flags}"].items()}
    assert got["torchrun"].returncode == got["elastic-run"].returncode == 0
    assert lines(got["elastic-run"].stdout) == lines(got["torchrun"].stdout)


def test_one_node_with_a_master_port_gets_the_master_addr_and_run_path_its_path() -> None:
    ports = port_pairs()
    got = each(
        lambda who: run(
            who, "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(ports[who]),
            "--run-path", SCRIPT, "--where",
        )
    )  # fmt: skip
    for who, done in got.items():
        assert done.returncode == 0, (who, done.stderr)
        assert lines(done.stdout) == [
            f"rank 0 at 127.0.0.1:{ports[who]}",
            f"rank 0 path {str(ROOT)!r}",  # the launcher's own sys.path[0] (python -m: cwd)
        ], who


@pytest.mark.parametrize("args", REFUSED)
def test_refused_command_lines_exit_as_under_torchrun(
    args: str, ran: dict[str, dict[str, Batched]]
) -> None:
    got = {who: b.done for who, b in ran[f"refused-{args}"].items()}
    assert got["elastic-run"].returncode == got["torchrun"].returncode != 0, {
        who: (done.returncode, done.stderr[-300:]) for who, done in got.items()
    }
    assert "Traceback" not in got["elastic-run"].stderr


def test_record_and_restart_count(tmp_path: Path) -> None:
    got = each(
        lambda who: run(
            who,
            *("--nproc-per-node", "2", "--max-restarts", "1", ECHO, "--fail-first"),
            ECHO_SYNC=str(tmp_path / who),  # rank 0's first line is printed before the fault
        )
    )
    assert got["torchrun"].returncode == got["elastic-run"].returncode == 0
    assert lines(got["elastic-run"].stdout) == lines(got["torchrun"].stdout)  # both attempts
    plain = both("--nproc-per-node", "2", ECHO, "--fail-first")  # exit 3, no @record
    for who, done in plain.items():
        assert done.returncode == 1, who
        assert "error_file: <N/A>" in done.stderr, who  # no file to point at
        assert "https://pytorch.org/docs/stable/elastic/errors.html" in done.stderr, who
    failed = both("--nproc-per-node", "1", SCRIPT, "--raise")
    for who, done in failed.items():
        assert done.returncode == 1, who
        assert "ValueError: broken on rank 0" in done.stderr, who
        assert "error_file: <N/A>" not in done.stderr, who  # @record wrote one


def test_sigterm_exit_code_is_documented() -> None:
    def stopped(who: str) -> int:
        p = subprocess.Popen(
            [*LAUNCHERS[who], "--nproc-per-node", "1", SCRIPT, "--sleep"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=str(ROOT),
            env=env(),
        )
        try:
            assert p.stdout is not None
            assert "sleeping" in p.stdout.readline()
            p.send_signal(signal.SIGTERM)
            return p.wait(60)
        finally:
            p.kill()
            p.wait()

    codes = each(stopped)
    # torchrun exits 1; elastic-run 128+SIGTERM, as shells and Kubernetes expect (docs/torchrun.md)
    assert codes == {"torchrun": 1, "elastic-run": 128 + signal.SIGTERM}
