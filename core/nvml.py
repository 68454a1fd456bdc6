"""The one wrapper around NVML (nvidia-ml-py) that the GPU inventory and the samplers share.

Why one: both need "no driver means no GPUs, not an error", bytes-or-str names, and handles opened once;
written twice they drifted. Every NVML call of the project goes through `Nvml`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML index on this machine (what CUDA_VISIBLE_DEVICES names)
    name: str  # model, e.g. "NVIDIA H100 80GB HBM3"
    uuid: str
    memory_total_mib: float


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Nvml:
    """An NVML session: `with Nvml() as n:` or open()/close(). Without a driver it holds no devices."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._handles: dict[int, Any] = {}

    def open(self) -> Nvml:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no library, no driver, no device: an empty session
            return self
        self._lib = pynvml
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                self._handles[i] = pynvml.nvmlDeviceGetHandleByIndex(i)
        except Exception:
            self._handles = {}
        return self

    def close(self) -> None:
        if self._lib is not None:
            try:
                self._lib.nvmlShutdown()
            except Exception:
                pass
        self._lib, self._handles = None, {}

    def __enter__(self) -> Nvml:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def indices(self) -> list[int]:
        return sorted(self._handles)

    def info(self, index: int) -> GpuInfo | None:
        h = self._handles.get(index)
        if h is None:
            return None
        try:
            mem = self._lib.nvmlDeviceGetMemoryInfo(h)
            return GpuInfo(
                index=index,
                name=_text(self._lib.nvmlDeviceGetName(h)),
                uuid=_text(self._lib.nvmlDeviceGetUUID(h)),
                memory_total_mib=mem.total / 2**20,
            )
        except Exception:
            return None

    def usage(self, index: int) -> dict[str, float | None]:
        """Utilization and memory now (nvidia-smi's utilization.gpu, memory.used, memory.total)."""
        out: dict[str, float | None] = {
            "util (%)": None,
            "mem_used (MiB)": None,
            "mem_total (MiB)": None,
        }
        h = self._handles.get(index)
        if h is None:
            return out
        try:
            util = self._lib.nvmlDeviceGetUtilizationRates(h)
            mem = self._lib.nvmlDeviceGetMemoryInfo(h)
        except Exception:
            return out
        return {
            "util (%)": float(util.gpu),
            "mem_used (MiB)": mem.used / 2**20,
            "mem_total (MiB)": mem.total / 2**20,
        }
