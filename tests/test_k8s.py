"""deploy/k8s: overlays build, resources validate strictly, the Prometheus Operator objects
fit their CRDs, the trainer's command is elastic-run's, and it really trains."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import need, need_binary
from crd_fields import MODELS, unknown_fields
from harness import ROOT, Proc

from elastic.agent.args import build_parser, parse_args
from elastic.agent.etcd_server import EtcdServer

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["dev", "dev-monitored", "production"]
MONITORED = ["dev-monitored", "production"]
KUBERNETES = "1.32.0"  # the API version the manifests are validated against
CRD_KINDS = {"PodMonitor", "PrometheusRule"}


@cache
def build(overlay: str) -> tuple[dict, ...]:
    kubectl = need_binary("kubectl")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def find(docs: tuple[dict, ...], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_with_everything(overlay: str) -> None:
    """dev needs a bare cluster only (kind, minikube): no Prometheus Operator kinds."""
    docs = build(overlay)
    kinds = sorted(d["kind"] for d in docs)
    for kind in (
        "StatefulSet",
        "Job",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ConfigMap",
        "Namespace",
    ):
        assert kind in kinds, kind
    assert (set(kinds) >= CRD_KINDS) == (overlay in MONITORED), kinds
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
        "elastic-run-dev" if overlay.startswith("dev") else "elastic-run"
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_validate_strictly(overlay: str) -> None:
    for doc in build(overlay):
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at "
                f"{'.'.join(map(str, e.path))}"
            )


@pytest.mark.parametrize("overlay", MONITORED)
def test_prometheus_operator_objects_fit_their_crds(overlay: str) -> None:
    need(MODELS.is_dir(), "tests/k8s has no node_modules: npm install --prefix tests/k8s")
    node = need_binary("node")
    objects = [d for d in build(overlay) if d["kind"] in CRD_KINDS]
    assert {d["kind"] for d in objects} == CRD_KINDS
    done = subprocess.run(
        [node, "validate_monitoring.mjs"],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT / "tests" / "k8s",
    )
    assert done.returncode == 0, done.stderr
    assert all(v is None for v in json.loads(done.stdout).values()), done.stdout
    for d in objects:
        assert unknown_fields(d["spec"], f"{d['kind']}Spec") == [], d["kind"]
        assert set(d["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    # and the checks bite: a misspelt field and a wrong type are both caught
    bad = json.loads(json.dumps(find(tuple(objects), "PodMonitor", "elastic-run")))
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert unknown_fields(bad["spec"], "PodMonitorSpec")
    bad["spec"]["podMetricsEndpoints"][0]["port"] = 9400
    done = subprocess.run(
        [node, "validate_monitoring.mjs"],
        input=json.dumps([bad]),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT / "tests" / "k8s",
    )
    assert "must be string" in done.stdout


def test_monitoring_is_the_same_as_deploy_prometheus_and_grafana() -> None:
    docs = build("production")
    rule = find(docs, "PrometheusRule", "elastic-run")
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert (
        find(build("dev-monitored"), "PodMonitor", "elastic-run")["metadata"]["labels"]["release"]
        == "prometheus"
    )
    dashboard = find(docs, "ConfigMap", "grafana-dashboard-elastic-run")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["elastic-run.json"]) == json.loads(
        (ROOT / "deploy/grafana/elastic-run.json").read_text()
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_references_only_earlier_variables(overlay: str) -> None:
    """Kubernetes expands $(VAR) only for variables defined earlier in the same list."""
    for doc in build(overlay):
        if doc["kind"] not in ("StatefulSet", "Job"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            seen: set[str] = set()
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in seen, f"{doc['metadata']['name']}: {e['name']} uses {ref}"
                seen.add(e["name"])
            for arg in c.get("args", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in seen, f"{doc['metadata']['name']}: args use {ref}"


def test_production_etcd_is_three_members_with_tls_spread_over_nodes() -> None:
    docs = build("production")
    etcd = find(docs, "StatefulSet", "etcd")
    assert etcd["spec"]["replicas"] == 3
    pod = etcd["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["ETCD_INITIAL_CLUSTER"].count("https://") == 3
    assert env["ETCD_CLIENT_CERT_AUTH"] == env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    assert "requiredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]
    probes = pod["containers"][0]
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert pod["containers"][0]["image"].startswith("gcr.io/etcd-development/etcd:v3.6")
    trainer = find(docs, "Job", "trainer")["spec"]["template"]["spec"]
    gpu = trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpu == "8"
    assert find(docs, "PodDisruptionBudget", "trainer")["spec"]["minAvailable"] == 2
    pvc = find(docs, "PersistentVolumeClaim", "checkpoints")["spec"]
    assert pvc["accessModes"] == ["ReadWriteMany"] and pvc["storageClassName"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_trainer_completes_and_its_probes_follow_the_agent(overlay: str) -> None:
    """An Indexed Job whose pods complete (a finished job is not restarted forever),
    resized through parallelism = completions; ready while training, live while turning."""
    job = find(build(overlay), "Job", "trainer")["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "Ignore"  # evictions and preemptions are not failures
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_dashboard_configmap_carries_the_sidecar_label() -> None:
    cm = find(build("dev-monitored"), "ConfigMap", "grafana-dashboard-elastic-run")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def trainer_command(overlay: str) -> tuple[list[str], dict[str, str]]:
    """The trainer container's arguments and the PET_* environment the manifest gives it."""
    docs = build(overlay)
    trainer = find(docs, "Job", "trainer")["spec"]["template"]["spec"]
    container = trainer["containers"][0]
    config = container["envFrom"][0]["configMapRef"]["name"]
    env = dict(find(docs, "ConfigMap", config)["data"])
    return list(container["args"]), env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_command_parses_flag_for_flag(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, env = trainer_command(overlay)
    for key, value in env.items():
        assert key.startswith("PET_"), key
        monkeypatch.setenv(key, value)
    ns = parse_args(args)  # unknown flags and bad values raise
    assert ns.node_id == "$(POD_NAME)" and ns.local_addr == "$(POD_IP)"
    assert ns.training_script == "/app/examples/train_ddp.py"
    assert ns.nnodes == env["PET_NNODES"] and ns.rdzv_endpoint == env["PET_RDZV_ENDPOINT"]
    known = {o for a in build_parser()._actions for o in a.option_strings}
    ours = args[: args.index(ns.training_script)]
    assert [f for f in ours if f.startswith("--") and f not in known] == []


@pytest.mark.slow
def test_the_manifest_command_trains_as_two_local_pods(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """The dev overlay's trainer, run as two processes with the manifest's arguments and
    environment; the manifest's etcd address mapped to the local one, the image's /app
    to this checkout, the pod fields to local values."""
    args, env = trainer_command("dev")
    env["PET_RDZV_ENDPOINT"] = re.sub(r"etcd-0\.etcd:2379", etcd.endpoint, env["PET_RDZV_ENDPOINT"])
    env["PET_RDZV_ID"] = run_id
    pods = []
    for i in range(2):
        local = [
            a.replace("$(POD_NAME)", f"trainer-{i}")
            .replace("$(POD_IP)", "127.0.0.1")
            .replace("/app/", f"{ROOT}/")
            .replace("/checkpoints", str(tmp_path / f"c{i}"))
            for a in args
        ]
        epochs = local.index("--epochs")
        local[epochs + 1] = "2"
        pods.append(Proc([sys.executable, "-m", "elastic", *local], env=env, name=f"trainer-{i}"))
    procs.extend(pods)
    for p in pods:
        assert p.wait(180) == 0, p.transcript()
    logs = "\n".join(line for p in pods for line in p.err)
    # rank order is registration order, which either pod may win
    assert re.search(r"world size 2 on 2 node\(s\) \[trainer-[01], trainer-[01]\]", logs), logs
    assert "epoch 1: loss" in "\n".join(pods[0].out + pods[1].out)


def test_dockerfile_lints_clean() -> None:
    hadolint = need_binary("hadolint")
    done = subprocess.run(
        [hadolint, str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["elastic-run"]' in text and "USER 1000" in text
    assert "VARIANT" in text and "cuda" in text
