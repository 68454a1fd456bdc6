"""One sampler for all tasks of a job: CPU and memory of each task (psutil), utilization and memory of
each GPU (NVML). One `sample()` call makes one record for every task, so the notebook gets one message
per tick however many workers there are.

Key layout follows nvitop's collector: a task's record holds plain numbers with units in their names,
and None where a value is not available (no GPU, process gone). A GPU's utilization that cannot be
measured (a MIG instance) is None with ``util_missing`` saying why (`tfdist.nvml.GpuUsage`), never 0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from .nvml import NO_DEVICE, GpuInfo, GpuUsage, Nvml


@dataclass
class TaskProcess:
    name: str  # "worker-0"
    pid: int
    #: the GPUs this task was given as CUDA_VISIBLE_DEVICES names them: NVML indices, or UUIDs
    #: ("MIG-..." for a MIG instance, which CUDA names only so)
    gpu_indices: list[int | str] = field(default_factory=list)


def sampler_gpus(names: Sequence[str]) -> list[int | str]:
    """A task's GPUs as the sampler reads them: an NVML index as a number, a UUID as it is.

    CUDA_VISIBLE_DEVICES names a MIG instance only by its UUID ("MIG-..."), and may name a GPU by its
    ("GPU-..."): dropping those left a job on a MIG slice without GPU metrics (`GpuReader.device` resolves
    them). The local supervisor and a pod read CUDA_VISIBLE_DEVICES alike through this.
    """
    return [int(g) if g.isdigit() else g for g in names if g]


class GpuReader:
    """NVML handles opened once for the sampler's life; a missing driver makes it an empty reader."""

    def __init__(self) -> None:
        self._nvml = Nvml().open()
        self._by_uuid: dict[str, GpuInfo] | None = None

    @property
    def available(self) -> bool:
        return bool(self._nvml.indices())

    def indices(self) -> list[int]:
        return self._nvml.indices()

    def device(self, gpu: int | str | GpuInfo) -> int | GpuInfo | None:
        """What `gpu` names: an index (an int, or digits) or a device by its UUID ("GPU-...", "MIG-...")."""
        if isinstance(gpu, (int, GpuInfo)):
            return gpu
        if gpu.strip().isdigit():
            return int(gpu)
        if self._by_uuid is None:
            self._by_uuid = {g.uuid: g for g in self._nvml.devices()}
        return self._by_uuid.get(gpu.strip())

    def usage(self, gpu: int | str | GpuInfo) -> GpuUsage:
        dev = self.device(gpu)
        return NO_DEVICE if dev is None else self._nvml.read(dev)

    def read(self, gpu: int | str | GpuInfo) -> dict[str, Any]:
        """One device's sample: its index (the parent's, for a MIG instance), a MIG instance's UUID and
        profile, and `GpuUsage.record()`."""
        dev = self.device(gpu)
        if dev is None:
            raise LookupError(f"NVML lists no GPU {gpu!r}")
        out: dict[str, Any] = {"index": dev.index if isinstance(dev, GpuInfo) else dev}
        if isinstance(dev, GpuInfo) and dev.mig_profile:
            out["uuid"], out["mig_profile"] = dev.uuid, dev.mig_profile
        return {**out, **self._nvml.read(dev).record()}

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
            # a UUID NVML does not list (no driver here) has no index to show it under: left out
            rec["gpus"] = [self.gpus.read(g) for g in task.gpu_indices if self.gpus.device(g) is not None]
            out[name] = rec
        return {"type": "metrics", "t": time.time(), "tasks": out}
