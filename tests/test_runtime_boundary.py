"""The runtime boundary: the agent never loads torch, the rendezvous never imports the
rest of elastic-run, and no ELASTIC_RUN_* variable is spelled outside the contract."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from agents import TRAIN_LOOP, start_agent, wait_workers, wait_world
from harness import ROOT, Proc

from elastic.agent.etcd_server import EtcdServer

AGENT_SIDE = ["elastic.cli", "elastic.contract", "elastic.stored", "elastic.tools.status"]


def modules(package: str) -> list[str]:
    base = ROOT / package.replace(".", "/")
    return [
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in sorted(base.glob("*.py"))
        if p.name != "__main__.py"
    ]


def imported_by(names: list[str]) -> set[str]:
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print('\\n'.join(sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), check=True
    )
    return set(done.stdout.split())


def test_agent_side_imports_no_torch() -> None:
    names = modules("elastic.agent") + AGENT_SIDE + modules("rendezvous")
    names.remove("rendezvous.handler")  # the torchrun plugin: it runs inside torch's agent
    loaded = imported_by(names)
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}
    assert "elastic.worker" not in loaded


PURE = ["elastic.agent.core", "rendezvous.rules", "rendezvous.view", "rendezvous.records"]


def test_the_rules_are_pure_by_import() -> None:
    """The decision table and the membership rules load neither gRPC nor the etcd client
    (nor torch): they are functions of values, testable and readable on their own."""
    loaded = imported_by(PURE)
    heavy = ("grpc", "etcd3", "torch", "rendezvous.client", "rendezvous.mirror")
    assert not {m for m in loaded if m.split(".")[0] in heavy or m in heavy}


def test_rendezvous_imports_nothing_of_elastic() -> None:
    for path in (ROOT / "rendezvous").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("elastic"), f"{path.name}: {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("elastic") for a in node.names), path.name


def test_worker_variables_are_spelled_only_in_the_contract() -> None:
    spelled = re.compile(r"""["']ELASTIC_RUN_(CONTROL|NODE_DIR|NODE_ID|SNAPSHOT_POLICY)""")
    for path in [*ROOT.glob("elastic/**/*.py"), *ROOT.glob("rendezvous/*.py")]:
        if path.name == "contract.py":
            continue
        assert not spelled.search(path.read_text()), f"{path} spells a contract variable"


@pytest.mark.slow
def test_a_running_agent_has_no_torch_mapped(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    agent = start_agent(
        procs,
        etcd.endpoint,
        run_id,
        "a",
        TRAIN_LOOP,
        "--steps",
        "100000",
        nnodes="1",
        env={"RESULT_DIR": str(tmp_path)},
    )
    wait_world(tmp_path, 1)
    [worker] = wait_workers(agent, 1)
    assert "libtorch" in Path(f"/proc/{worker}/maps").read_text()  # the check can see torch
    assert "libtorch" not in Path(f"/proc/{agent.pid}/maps").read_text()


FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def test_elastic_imports_no_framework() -> None:
    """The framework adapters are optional extras: only importing one loads its framework."""
    names = [
        m
        for package in ("elastic", "elastic.worker", "elastic.agent", "elastic.tools")
        for m in modules(package)
    ]
    loaded = imported_by(["elastic", *names])
    adapters = {f"elastic.integrations.{m}" for m in ("lightning", "transformers", "accelerate")}
    assert not adapters & set(loaded)
    assert not {m for m in loaded if m.split(".")[0] in FRAMEWORKS}
