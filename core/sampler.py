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

from .nvml import Nvml


@dataclass
class TaskProcess:
    name: str  # "worker-0"
    pid: int
    gpu_indices: list[int] = field(default_factory=list)  # NVML indices this task was given


class GpuReader:
    """NVML handles opened once for the sampler's life; a missing driver makes it an empty reader."""

    def __init__(self) -> None:
        self._nvml = Nvml().open()

    @property
    def available(self) -> bool:
        return bool(self._nvml.indices())

    def indices(self) -> list[int]:
        return self._nvml.indices()

    def read(self, index: int) -> dict[str, float | None]:
        return {"index": index, **self._nvml.usage(index)}

    def close(self) -> None:
        self._nvml.close()


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
