"""CPU utilisation and memory of a server's whole process tree, sampled on a background thread.

A serving engine is several processes (frontend, engine core, workers), so one process's ``cpu_percent`` misses
most of the work. Every ``interval`` seconds the sampler walks the tree under the root pid (children found anew
each time, since workers start late), sums their CPU percent (100 = one core busy) and resident memory, and keeps
the mean and peak of each. ``find_listening_pid`` finds a local server's root by its port.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import psutil


@dataclass
class CpuStats:
    mean_cpu_percent: float = 0.0  # over samples; 100 = one core
    peak_cpu_percent: float = 0.0
    peak_rss_mb: float = 0.0
    num_samples: int = 0
    num_cores: int = field(default_factory=lambda: psutil.cpu_count() or 1)

    def as_dict(self) -> dict[str, float | int]:
        return {"mean_cpu_percent": self.mean_cpu_percent, "peak_cpu_percent": self.peak_cpu_percent,
                "peak_rss_mb": self.peak_rss_mb, "cpu_samples": self.num_samples, "cpu_cores": self.num_cores}


def find_listening_pid(port: int) -> int | None:
    """The pid of the process listening on TCP ``port`` on this machine (a server's frontend, the root of its
    tree: engine cores and workers are its children), or None."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


class TreeSampler:
    """Samples the tree under ``pid`` from ``start()`` to ``stop()``; also usable as a context manager."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._cpu_sum = 0.0
        self.stats = CpuStats()

    def _tree(self) -> list[psutil.Process]:
        try:
            current = [self.root] + self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        # Keep the Process objects across samples: cpu_percent measures since the previous call on the object.
        for proc in current:
            self._procs.setdefault(proc.pid, proc)
        return [self._procs[p.pid] for p in current]

    def sample(self) -> None:
        cpu = rss = 0.0
        for proc in self._tree():
            try:
                cpu += proc.cpu_percent(None)
                rss += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.stats.num_samples += 1
        self._cpu_sum += cpu
        self.stats.mean_cpu_percent = self._cpu_sum / self.stats.num_samples
        self.stats.peak_cpu_percent = max(self.stats.peak_cpu_percent, cpu)
        self.stats.peak_rss_mb = max(self.stats.peak_rss_mb, rss / 2**20)

    def _run(self) -> None:
        for proc in self._tree():  # prime cpu_percent so the first real sample covers one interval
            try:
                proc.cpu_percent(None)
            except psutil.Error:
                pass
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "TreeSampler":
        self._thread.start()
        return self

    def stop(self) -> CpuStats:
        self._stop.set()
        self._thread.join()
        return self.stats

    def __enter__(self) -> "TreeSampler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

