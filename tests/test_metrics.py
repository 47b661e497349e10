"""Metrics: collectors on fixtures, the endpoint, and a real agent scraped by promtool and by
a real Prometheus; the dashboard's and alerts' expressions checked against the exporter."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from agents import TRAIN_LOOP, start_agent
from conftest import need_binary
from harness import ROOT, TAG_VAR, Proc, tagged_processes, wait_until
from prometheus_client import CollectorRegistry, generate_latest

from elastic.agent.collectors import GpuCollector, GpuSample, WorkerCollector, WorkerProc
from elastic.agent.etcd_server import EtcdServer
from elastic.agent.metrics import AgentMetrics, MetricsError, MetricsServer
from rendezvous.net import free_port

DEPLOY = ROOT / "deploy"


class FakeNvml:
    """Shaped like NvmlSource: two GPUs, one running a worker of the job."""

    def __init__(self, available: bool = True) -> None:
        self.available = available

    def samples(self) -> list[GpuSample]:
        return [
            GpuSample(0, "GPU-aaaa", 0.75, 8e9, 80e9, 300.0, 65.0, {4242: 7e9, 999: 1e9}),
            GpuSample(1, "GPU-bbbb", 0.0, 1e6, 80e9, None, None, {}),
        ]


def scrape_registry(*collectors: object) -> str:
    r = CollectorRegistry()
    for c in collectors:
        r.register(c)  # type: ignore[arg-type]
    return generate_latest(r).decode()


def test_gpu_collector_with_a_fake_nvml() -> None:
    workers = [WorkerProc(rank=3, local_rank=1, pid=4242, alive=True)]
    text = scrape_registry(GpuCollector(FakeNvml(), lambda: workers, "j", "n"))
    assert (
        'elastic_run_gpu_utilization_ratio{gpu="0",job="j",node="n",uuid="GPU-aaaa"} 0.75' in text
    )
    assert 'elastic_run_gpu_memory_total_bytes{gpu="1",job="j",node="n",uuid="GPU-bbbb"}' in text
    assert 'elastic_run_gpu_power_watts{gpu="0",job="j",node="n",uuid="GPU-aaaa"} 300.0' in text
    assert 'gpu="1"' not in text.split("elastic_run_gpu_power_watts")[1].split("# HELP")[0]
    proc = [
        line
        for line in text.splitlines()
        if line.startswith("elastic_run_gpu_process_memory_bytes{")
    ]
    assert proc == [
        'elastic_run_gpu_process_memory_bytes{gpu="0",job="j",local_rank="1",'
        'node="n",rank="3",uuid="GPU-aaaa"} 7e+09'
    ]  # pid 999 is not ours


def test_no_nvml_means_no_gpu_series_and_no_error() -> None:
    text = scrape_registry(GpuCollector(FakeNvml(available=False), list, "j", "n"))
    assert "gpu" not in text


def test_worker_collector_reads_real_processes() -> None:
    me = WorkerProc(rank=0, local_rank=0, pid=os.getpid(), alive=True)
    gone = WorkerProc(rank=1, local_rank=1, pid=1, alive=False)
    text = scrape_registry(WorkerCollector(lambda: [me, gone], "j", "n"))
    labels = 'job="j",local_rank="0",node="n",rank="0"'
    assert re.search(rf"elastic_run_worker_cpu_seconds_total{{{labels}}} [0-9.e+]+", text)
    rss = re.search(rf"elastic_run_worker_resident_memory_bytes{{{labels}}} ([0-9.e+]+)", text)
    assert rss and float(rss.group(1)) > 10e6
    assert 'elastic_run_worker_up{job="j",local_rank="1",node="n",rank="1"} 0.0' in text
    assert 'rank="1"' not in text.split("elastic_run_worker_threads")[1].split("# HELP")[0]


def test_a_worker_file_caught_half_made_leaves_the_scrape_whole(tmp_path: Path) -> None:
    """A worker's metrics file as prometheus-client writes it (a real process), beside
    one just created and still empty, as a starting worker's is for a moment: the scrape
    has the first and leaves the second out (prometheus-client alone raises: a 500)."""
    from prometheus_client.multiprocess import MultiProcessCollector

    from elastic.agent.collectors import WorkerFiles

    code = "from prometheus_client import Counter; Counter('steps', 'steps').inc(7)"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    (tmp_path / "counter_4242.db").touch()  # half made
    with pytest.raises(struct.error):
        list(MultiProcessCollector(None, path=str(tmp_path)).collect())
    registry = CollectorRegistry()
    WorkerFiles(registry, path=str(tmp_path))
    assert "steps_total 7.0" in generate_latest(registry).decode()


def test_endpoint_healthz_and_port_errors() -> None:
    m = AgentMetrics("j", "n", 2, "1.0", workers=list, gpus=FakeNvml(available=False))
    health = {"state": "running", "alive": True}
    server = MetricsServer(m.registry, lambda: health)
    port = server.start("127.0.0.1", 0)

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}") as r:
                assert json.loads(r.read()) == health
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    try:
        assert status("/healthz") == status("/readyz") == 200
        health["state"] = "joining"  # alive, not ready: not training
        assert (status("/healthz"), status("/readyz")) == (200, 503)
        health["alive"] = False  # wedged: the liveness probe fails
        assert status("/healthz") == 503
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            body = r.read().decode()
        assert 'elastic_run_restart_budget_remaining{job="j",node="n"} 2.0' in body
        assert 'elastic_run_build_info{job="j",node="n",python=' in body
        other = MetricsServer(m.registry, dict)
        with pytest.raises(MetricsError, match=f"--metrics-port {port}: cannot listen"):
            other.start("127.0.0.1", port)
    finally:
        server.stop()


# -- a real agent ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def agent(etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One agent with two workers training, and its metrics port. It outlives single
    tests, so it carries a tag of its own (the per-test leak check would kill it)."""
    tag = f"metrics-{os.getpid()}"
    env = {TAG_VAR: tag}
    ckpt = tmp_path_factory.mktemp("ckpt")
    p = Proc(
        [
            sys.executable,
            "-m",
            "elastic",
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            etcd.endpoint,
            "--rdzv-id",
            "metrics-job",
            "--node-id",
            "metrics-node",
            "--local-addr",
            "127.0.0.1",
            "--metrics-addr",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "20",
            str(ROOT / "examples" / "train_ddp.py"),
            "--epochs",
            "1000",
            "--step-time",
            "0.02",
        ],
        env=env,
        name="agent",
    )
    try:
        line = p.wait_output("metrics on http://", timeout=60)
        port = int(re.search(r":(\d+)/metrics", line).group(1))
        url = f"http://127.0.0.1:{port}/metrics"
        wait_until(
            lambda: b"elastic_run_snapshot_interval_steps{" in urllib.request.urlopen(url).read(),
            60,
            "workers to report steps and the snapshot interval they chose",
        )
        yield {"port": port, "url": url, "proc": p}
    finally:
        p.kill_tree()
        for leftover in tagged_processes(tag):
            leftover.kill()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url) as r:
        return r.read().decode()


@pytest.mark.slow
def test_promtool_accepts_a_real_scrape(agent: dict) -> None:
    promtool = need_binary("promtool")
    text = scrape(agent["url"])
    for name in (
        "elastic_run_world_size",
        "elastic_run_worker_cpu_seconds_total",
        "elastic_run_training_step",
        "elastic_run_training_loss",
        "elastic_run_snapshot_seconds_bucket",
        "elastic_run_snapshot_interval_steps",
        "elastic_run_snapshot_steps_at_risk",
        "elastic_run_snapshot_cost_seconds",
        "elastic_run_training_samples_total",
    ):
        assert name in text, name
    assert "_created" not in text  # creation times, as series of their own: none wanted
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr


@contextlib.contextmanager
def prometheus(targets: list[int], tmp_path: Path) -> Iterator[Callable[[str], list[dict]]]:
    """A real Prometheus scraping agents on these ports every second; yields query()."""
    binary = need_binary("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "elastic-run",
                        "honor_labels": True,
                        "static_configs": [{"targets": [f"127.0.0.1:{t}" for t in targets]}],
                    }
                ],
            }
        )
    )
    server = Proc(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path}/db",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        name="prometheus",
    )

    def query(q: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return list(json.loads(r.read())["data"]["result"])
        except OSError:
            return []

    try:
        yield query
    finally:
        server.kill_tree()


@pytest.mark.slow
def test_prometheus_scrapes_the_agent(agent: dict, tmp_path: Path) -> None:
    with prometheus([agent["port"]], tmp_path) as query:
        got = wait_until(
            lambda: query('elastic_run_world_size{job="metrics-job"}'),
            30,
            "Prometheus to scrape the agent",
        )
        assert got[0]["value"][1] == "2" and got[0]["metric"]["node"] == "metrics-node"
        up = wait_until(lambda: query("sum(elastic_run_worker_up)"), 10, "worker series")
        assert up[0]["value"][1] == "2"
        steps = wait_until(lambda: query("elastic_run_training_step > 0"), 10, "step series")
        assert {s["metric"]["rank"] for s in steps} == {"0", "1"}
        assert wait_until(lambda: query("elastic_run_training_loss"), 10, "loss series")
        # with honor_labels, build_info lands under the job like every other series
        info = query('elastic_run_build_info{job="metrics-job",node="metrics-node"}')
        assert info and info[0]["metric"]["version"]


@pytest.mark.slow
def test_prometheus_sees_the_job_fail(
    etcd: EtcdServer, run_id: str, procs: list[Proc], tmp_path: Path
) -> None:
    """The agent exits right after the job fails; it waits for one more scrape first, so
    the failed state reaches Prometheus and the alert rule sees it."""
    port = free_port()
    with prometheus([port], tmp_path) as query:
        metrics = ("--metrics-addr", "127.0.0.1", "--metrics-port", str(port))
        p = start_agent(
            procs, etcd.endpoint, run_id, "doomed", TRAIN_LOOP, "--steps", "1000",
            "--crash-rank", "0", "--crash-step", "80", nnodes="1", extra=metrics,
            env={"RESULT_DIR": str(tmp_path)},
        )  # fmt: skip
        assert p.wait(120) == 1, p.transcript()
        assert any("letting Prometheus see that the job failed" in line for line in p.err)
        rule = 'max by (job) (max_over_time(elastic_run_agent_state{state="failed"}[15m])) == 1'
        got = wait_until(lambda: query(rule), 10, "the failed state in Prometheus")
        assert got[0]["metric"]["job"] == run_id


# -- the dashboard and the alerts -----------------------------------------------------------
def dashboard_exprs() -> list[str]:
    d = json.loads((DEPLOY / "grafana" / "elastic-run.json").read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def concrete(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$job", "j").replace("$node", ".*")


def test_dashboard_is_grafana_shaped() -> None:
    d = json.loads((DEPLOY / "grafana" / "elastic-run.json").read_text())
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"job", "node"} <= set(variables)
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    titles = " ".join(p["title"] for p in d["panels"]).lower()
    for topic in (
        "world size",
        "restarts",
        "goodput",
        "cpu",
        "memory",
        "gpu utilisation",
        "gpu memory",
        "power",
        "step",
        "loss",
        "snapshot",
        "checkpoint",
    ):
        assert topic in titles, topic


def test_every_expression_parses(tmp_path: Path) -> None:
    promtool = need_binary("promtool")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr{i}", "expr": concrete(e)}
                    for i, e in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    for file in (path, DEPLOY / "prometheus" / "alerts.yml"):
        done = subprocess.run(
            [promtool, "check", "rules", str(file)], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_passing_unit_test() -> None:
    promtool = need_binary("promtool")
    alerts = {
        r["alert"]
        for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())["tests"]
    firing = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    assert alerts == firing, f"alerts without a firing test: {alerts - firing}"
    done = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=DEPLOY / "prometheus",
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_expressions_name_only_metrics_the_exporter_produces(agent: dict) -> None:
    text = scrape(agent["url"]) + scrape_registry(
        GpuCollector(FakeNvml(), lambda: [WorkerProc(0, 0, 4242, True)], "j", "n")
    )
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    for expr in dashboard_exprs() + alert_exprs():
        for name in re.findall(r"\belastic_run_[a-z_]+", expr):
            assert name in exported, f"{name} (in {expr!r}) is not exported"


def test_scrape_config_example_is_valid() -> None:
    promtool = need_binary("promtool")
    done = subprocess.run(
        [promtool, "check", "config", "scrape.yml"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=DEPLOY / "prometheus",
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("0.0.0.0", port))
    except OSError:
        return False
    sock.listen()
    return True


def test_two_agents_side_by_side_do_not_fight_for_the_port(
    etcd: EtcdServer, run_id: str, procs: list[Proc]
) -> None:
    """The default port falls back to a free one when another agent has it."""
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # held here for the whole test: another agent of this machine (a test beside this
        # one) may have it now, but only for its own short run
        wait_until(lambda: _bound(busy, 9400), 120, "the default metrics port to be free")
        p = Proc(
            [
                sys.executable,
                "-m",
                "elastic",
                "--rdzv-endpoint",
                etcd.endpoint,
                "--rdzv-id",
                run_id,
                "--local-addr",
                "127.0.0.1",
                str(ROOT / "tests" / "scripts" / "echo.py"),
            ],
            name="agent",
        )
        procs.append(p)
        assert p.wait(60) == 0, p.transcript()
        line = next(x for x in p.err if "metrics on http://" in x)
        assert "(port 9400 is taken)" in line  # the default falls back to a free port
        assert "http://127.0.0.1:" in line and "this host only: --metrics-addr 0.0.0.0" in line
        explicit = Proc(
            [
                sys.executable,
                "-m",
                "elastic",
                "--metrics-port",
                "9400",
                "--rdzv-endpoint",
                etcd.endpoint,
                "--rdzv-id",
                run_id + "x",
                str(ROOT / "tests" / "scripts" / "echo.py"),
            ],
            name="explicit",
        )
        procs.append(explicit)
        assert explicit.wait(60) == 1
        errors = [line for line in explicit.err if "error:" in line]
        assert errors and "--metrics-port 9400: cannot listen on 127.0.0.1:9400" in errors[0]


def test_progress_metrics_are_written_at_most_every_so_often_and_lose_nothing(
    tmp_path: Path,
) -> None:
    """A step may come every millisecond: the step metrics take the latest figures once
    per ``METRICS_EVERY`` (the first report writes at once), and ``flush`` (State.close,
    a re-formation's relabel, the process's exit) writes what was held back: no sample is
    left uncounted."""
    code = """
import json
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from elastic.worker import progress

progress.METRICS_EVERY = 3600.0  # one write, then held back for the test's whole length

def seen():
    r = CollectorRegistry()
    MultiProcessCollector(r)
    return {s.name: s.value for m in r.collect() for s in m.samples}

for i in range(1, 1001):
    progress.report(i, 0.5, 3)
held = seen()
progress.flush()
print(json.dumps([held, seen()]))
for i in range(1001, 1011):
    progress.report(i, None, 3)  # and the process exits: an atexit flush writes them
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    held, flushed = json.loads(done.stdout)
    assert (
        held["elastic_run_training_step"] == 1 and held["elastic_run_training_samples_total"] == 3
    )
    assert flushed["elastic_run_training_step"] == 1000
    assert flushed["elastic_run_training_samples_total"] == 3000
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    total = [
        s.value
        for m in registry.collect()
        for s in m.samples
        if s.name == "elastic_run_training_samples_total"
    ]
    assert total == [3030.0]
