"""Prometheus collectors for a node's workers (psutil), GPUs (NVML) and the metrics the
workers write themselves (prometheus-client's multiprocess files).

Like prometheus client_python's own process collector, each takes its data source as an
argument, so tests feed it fixtures: the worker collector a function listing the worker
processes, the GPU collector an object shaped like ``NvmlSource``.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

log = logging.getLogger("elastic.metrics")


@dataclass(frozen=True)
class WorkerProc:
    rank: int
    local_rank: int
    pid: int
    alive: bool


def _tree(pid: int) -> list[psutil.Process]:
    """A worker and its children (DataLoader workers count as the worker's)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class WorkerFiles(MultiProcessCollector):
    """The workers' own metrics, as prometheus-client merges them, except that a file it
    cannot read (a worker's, caught half-made as the worker starts, or removed as it
    ends) is left out of this scrape instead of failing all of it with a 500."""

    def collect(self) -> Iterable[Metric]:
        files = glob.glob(os.path.join(self._path, "*.db"))
        try:
            return list(self.merge(files, accumulate=True))
        except Exception:  # whatever a half-written file makes the reader raise
            readable = [f for f in files if _readable(f)]
            log.debug("left %d unreadable worker file(s) out", len(files) - len(readable))
            try:
                return list(self.merge(readable, accumulate=True))
            except Exception as e:  # changed again meanwhile: the next scrape has them
                log.debug("worker metrics left out of this scrape: %s", e)
                return []


def _readable(path: str) -> bool:
    try:
        MmapedDict.read_all_values_from_file(path)
    except Exception:
        return False
    return True


class WorkerCollector(Collector):
    """CPU seconds, memory, threads, file descriptors and liveness of each worker."""

    def __init__(
        self,
        source: Callable[[], Iterable[WorkerProc]],
        job: str,
        node: str,
        tree: Callable[[int], list] = _tree,
    ) -> None:
        self._source = source
        self._base = [job, node]
        self._tree = tree

    def collect(self) -> Iterator[Metric]:
        names = ["job", "node", "rank", "local_rank"]
        cpu = CounterMetricFamily(
            "elastic_run_worker_cpu_seconds", "CPU time of a worker and its children", labels=names
        )
        rss = GaugeMetricFamily(
            "elastic_run_worker_resident_memory_bytes",
            "Resident memory of a worker and its children",
            labels=names,
        )
        threads = GaugeMetricFamily(
            "elastic_run_worker_threads", "Threads of a worker and its children", labels=names
        )
        fds = GaugeMetricFamily(
            "elastic_run_worker_open_fds",
            "Open file descriptors of a worker and its children",
            labels=names,
        )
        up = GaugeMetricFamily(
            "elastic_run_worker_up",
            "1 while the worker process runs, 0 once it exited",
            labels=names,
        )
        for w in self._source():
            labels = [*self._base, str(w.rank), str(w.local_rank)]
            up.add_metric(labels, 1.0 if w.alive else 0.0)
            if not w.alive:
                continue
            totals = {"cpu": 0.0, "rss": 0.0, "threads": 0.0, "fds": 0.0}
            for p in self._tree(w.pid):
                with contextlib.suppress(psutil.Error), p.oneshot():
                    t = p.cpu_times()
                    totals["cpu"] += t.user + t.system
                    totals["rss"] += p.memory_info().rss
                    totals["threads"] += p.num_threads()
                    totals["fds"] += p.num_fds()
            cpu.add_metric(labels, totals["cpu"])
            rss.add_metric(labels, totals["rss"])
            threads.add_metric(labels, totals["threads"])
            fds.add_metric(labels, totals["fds"])
        yield from (cpu, rss, threads, fds, up)


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    utilization: float  # 0..1
    memory_used: float  # bytes
    memory_total: float
    power: float | None  # watts
    temperature: float | None  # celsius
    processes: dict[int, float] = field(default_factory=dict)  # pid -> bytes


class NvmlSource:
    """The GPUs of this machine through NVML (nvidia-ml-py), imported when first needed.
    No library, no driver or no GPU: ``available`` is False, and no error is raised."""

    def __init__(self) -> None:
        self._nvml: Any = None  # the pynvml module, once it works
        self._tried = False

    @property
    def available(self) -> bool:
        if not self._tried:
            self._tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                if pynvml.nvmlDeviceGetCount() > 0:
                    self._nvml = pynvml
                else:
                    log.info("NVML found no GPU: no GPU metrics")
            except Exception as e:  # ImportError, NVMLError (no driver), OSError
                log.info("no NVML here (%s): no GPU metrics", type(e).__name__)
        return self._nvml is not None

    def samples(self) -> list[GpuSample]:
        n = self._nvml
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            mem = _memory(n, h)
            power = temp = None
            with contextlib.suppress(n.NVMLError):
                power = n.nvmlDeviceGetPowerUsage(h) / 1000.0
            with contextlib.suppress(n.NVMLError):
                temp = float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
            procs: dict[int, float] = {}
            with contextlib.suppress(n.NVMLError):
                for p in n.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.usedGpuMemory is not None:
                        procs[p.pid] = float(p.usedGpuMemory)
            uuid = n.nvmlDeviceGetUUID(h)
            out.append(
                GpuSample(
                    i,
                    uuid.decode() if isinstance(uuid, bytes) else uuid,
                    n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
                    float(mem.used),
                    float(mem.total),
                    power,
                    temp,
                    procs,
                )
            )
        return out


def _memory(nvml: Any, handle: Any) -> Any:
    """Memory as nvidia-smi reports it: the v2 query, whose ``used`` leaves out what the
    driver reserves (v1 counts it: about 480 MiB more on an H100); v1 on old drivers."""
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        with contextlib.suppress(nvml.NVMLError, TypeError):
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
    return nvml.nvmlDeviceGetMemoryInfo(handle)


class GpuCollector(Collector):
    """Utilisation, memory, power and temperature per GPU, and the GPU memory of this
    job's workers. Without NVML it yields nothing."""

    def __init__(
        self, source: NvmlSource, workers: Callable[[], Iterable[WorkerProc]], job: str, node: str
    ) -> None:
        self._source = source
        self._workers = workers
        self._base = [job, node]

    def collect(self) -> Iterator[Metric]:
        if not self._source.available:
            return
        names = ["job", "node", "gpu", "uuid"]
        fams = {
            "util": GaugeMetricFamily(
                "elastic_run_gpu_utilization_ratio",
                "Fraction of time the GPU was busy",
                labels=names,
            ),
            "used": GaugeMetricFamily(
                "elastic_run_gpu_memory_used_bytes", "GPU memory in use", labels=names
            ),
            "total": GaugeMetricFamily(
                "elastic_run_gpu_memory_total_bytes", "GPU memory in all", labels=names
            ),
            "power": GaugeMetricFamily(
                "elastic_run_gpu_power_watts", "GPU power draw", labels=names
            ),
            "temp": GaugeMetricFamily(
                "elastic_run_gpu_temperature_celsius", "GPU temperature", labels=names
            ),
        }
        proc = GaugeMetricFamily(
            "elastic_run_gpu_process_memory_bytes",
            "GPU memory used by a worker of this job",
            labels=[*names, "rank", "local_rank"],
        )
        ranks = {w.pid: w for w in self._workers() if w.alive}
        try:
            samples = self._source.samples()
        except Exception as e:  # a GPU fell off the bus: log, keep exporting the rest
            log.warning("reading GPUs through NVML failed: %s", e)
            return
        for g in samples:
            labels = [*self._base, str(g.index), g.uuid]
            fams["util"].add_metric(labels, g.utilization)
            fams["used"].add_metric(labels, g.memory_used)
            fams["total"].add_metric(labels, g.memory_total)
            if g.power is not None:
                fams["power"].add_metric(labels, g.power)
            if g.temperature is not None:
                fams["temp"].add_metric(labels, g.temperature)
            for pid, used in g.processes.items():
                w = ranks.get(pid)
                if w is not None:
                    proc.add_metric([*labels, str(w.rank), str(w.local_rank)], used)
        yield from fams.values()
        yield proc
