"""One sampler for all tasks of a job: CPU and memory of each task (psutil), utilization and memory of
each GPU (NVML). One `sample()` call makes one record for every task, so the notebook gets one message
per tick however many workers there are.

Key layout follows nvitop's collector: a task's record holds plain numbers with units in their names,
and None where a value is not available (no GPU, process gone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import psutil


@dataclass
class TaskProcess:
    name: str  # "worker-0"
    pid: int
    gpu_indices: list[int] = field(default_factory=list)  # NVML indices this task was given


class GpuReader:
    """NVML handles opened once; a missing driver makes it an empty reader, not an error."""

    def __init__(self) -> None:
        self._handles: dict[int, Any] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            for i in range(pynvml.nvmlDeviceGetCount()):
                self._handles[i] = pynvml.nvmlDeviceGetHandleByIndex(i)
        except Exception:
            self._nvml = None

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def indices(self) -> list[int]:
        return sorted(self._handles)

    def read(self, index: int) -> dict[str, float | None]:
        h = self._handles.get(index)
        if h is None or self._nvml is None:
            return {"index": index, "util (%)": None, "mem_used (MiB)": None, "mem_total (MiB)": None}
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(h)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
            return {
                "index": index,
                "util (%)": float(util.gpu),
                "mem_used (MiB)": mem.used / 2**20,
                "mem_total (MiB)": mem.total / 2**20,
            }
        except Exception:
            return {"index": index, "util (%)": None, "mem_used (MiB)": None, "mem_total (MiB)": None}

    def close(self) -> None:
        if self._nvml is not None and self._handles:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._handles = {}


class TaskSampler:
    def __init__(self, gpus: GpuReader | None = None) -> None:
        self._procs: dict[str, tuple[int, psutil.Process]] = {}
        self._tasks: dict[str, TaskProcess] = {}
        self.gpus = gpus if gpus is not None else GpuReader()

    def track(self, task: TaskProcess) -> None:
        self._tasks[task.name] = task
        try:
            proc = psutil.Process(task.pid)
            proc.cpu_percent(None)  # prime: the first call has no interval to measure over
            self._procs[task.name] = (task.pid, proc)
        except psutil.Error:
            self._procs.pop(task.name, None)

    def forget(self, name: str) -> None:
        self._tasks.pop(name, None)
        self._procs.pop(name, None)

    def sample(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, task in list(self._tasks.items()):
            rec: dict[str, Any] = {"cpu (%)": None, "rss (MiB)": None, "gpus": []}
            entry = self._procs.get(name)
            if entry is not None:
                try:
                    with entry[1].oneshot():
                        rec["cpu (%)"] = entry[1].cpu_percent(None)
                        rec["rss (MiB)"] = entry[1].memory_info().rss / 2**20
                except psutil.Error:
                    pass
            rec["gpus"] = [self.gpus.read(i) for i in task.gpu_indices]
            out[name] = rec
        return {"type": "metrics", "t": time.time(), "tasks": out}
