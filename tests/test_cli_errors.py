"""Bad input ends in one clear line naming the problem, a non-zero exit, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import ROOT

from rendezvous.net import free_port

SCRIPT = str(ROOT / "tests" / "scripts" / "ddp_min.py")


def elastic_run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "elastic", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=str(ROOT),
    )


def error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr
    return errors[0]


@pytest.mark.parametrize(
    "args,needle",
    [
        # refused by the launcher (torchrun exits 1 for these too)
        (["--nnodes", "4:1", SCRIPT], "--nnodes '4:1': the maximum 1 is below the minimum 4"),
        (["--nnodes", "abc", SCRIPT], "--nnodes 'abc': expected N or MIN:MAX"),
        (["--nproc-per-node", "0", SCRIPT], "--nproc-per-node 0: must be at least 1"),
        (["--nproc-per-node", "gpu", SCRIPT], "--nproc-per-node gpu: no GPU is visible"),
        (["--nproc-per-node", "many", SCRIPT], "expected a number, auto, cpu, gpu or xpu"),
        (["--rdzv-backend", "zookeeper", SCRIPT], "--rdzv-backend 'zookeeper': elastic-run's"),
        (["--rdzv-conf", "lease_ttl=zero", SCRIPT], "--rdzv-conf lease_ttl='zero'"),
        (["no/such/train.py"], "training script 'no/such/train.py': no such file"),
        (["stauts"], "no such file (did you mean the command 'elastic-run status'?)"),
        (["--max-restarts", "-1", SCRIPT], "--max-restarts -1: must be >= 0"),
        (["--redirects", "7", SCRIPT], "modes are 0 (none)"),
        (["--local-ranks-filter", "a", SCRIPT], "--local-ranks-filter 'a'"),
        (["--signals-to-handle", "SIGNOPE", SCRIPT], "unknown signal 'SIGNOPE'"),
        (["--no-python", "-m", SCRIPT], "--no-python and --module cannot be used together"),
    ],
)
def test_bad_input_is_one_line(args: list[str], needle: str) -> None:
    done = elastic_run(*args, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert needle in error_line(done)


@pytest.mark.parametrize(
    "args,needle",
    [
        # refused by argparse (exit 2 under torchrun too)
        (["--max-restarts", "x", SCRIPT], "invalid int value: 'x'"),
        (["--nproc-per-nod", "2", "--nosuch", SCRIPT], "unrecognized arguments: --nosuch"),
        (["--nprocs", "2", SCRIPT], "--nprocs (did you mean --nproc-per-node?)"),
        ([], "no training script given: elastic-run [options] train.py"),
    ],
)
def test_what_argparse_refuses_exits_2(args: list[str], needle: str) -> None:
    done = elastic_run(*args)
    assert done.returncode == 2
    assert needle in error_line(done)


def test_unreachable_etcd_names_the_endpoint() -> None:
    """An etcd cluster (so no agent serves it, as it would one free endpoint on this host)
    where nothing answers: one line naming the endpoints and what to check."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    done = elastic_run(
        "--rdzv-endpoint", f"{a},{b}", "--rdzv-id", "x", "--rdzv-conf", "connect_timeout=2",
        SCRIPT, timeout=30,
    )  # fmt: skip
    assert done.returncode == 1
    line = error_line(done)
    assert f"etcd unreachable at http://{a}, http://{b}" in line
    assert "nothing accepts connections there" in line


@pytest.mark.parametrize(
    ("host", "met"),
    [("127.0.0.1", "it refuses connections"), ("no-such-host.invalid", "it does not resolve")],
)
def test_nothing_at_an_endpoint_this_node_does_not_serve(host: str, met: str) -> None:
    """A free port of this host with is_host=false, or a name that does not resolve (a
    typo, or a Kubernetes service whose pod is not up yet): waited for, then one line
    that says what a connection there met."""
    endpoint = f"{host}:{free_port()}"
    conf = "is_host=false,join_timeout=2"
    done = elastic_run(
        "--rdzv-endpoint", endpoint, "--rdzv-id", "x", "--rdzv-conf", conf, SCRIPT, timeout=30
    )
    assert done.returncode == 1
    line = error_line(done)
    assert f"nothing answered at {endpoint} within join_timeout (2s; {met})" in line


def test_pet_variables_are_read_like_torchrun() -> None:
    done = elastic_run(SCRIPT, env={"PET_NNODES": "3:2"})
    assert "--nnodes '3:2'" in error_line(done)
    done = elastic_run(SCRIPT, env={"PET_NPROC_PER_NODE": "0"})
    assert "--nproc-per-node 0" in error_line(done)
