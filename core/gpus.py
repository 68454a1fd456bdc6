"""Which GPUs this process may use, read from NVML and narrowed by CUDA_VISIBLE_DEVICES.

One small interface (`GpuInventory`) so that the embedded hub, the magic and the samplers ask the same
question the same way, and tests can swap in a named double where no GPU exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML index on this machine (what CUDA_VISIBLE_DEVICES names)
    name: str  # model, e.g. "NVIDIA H100 80GB HBM3"
    uuid: str
    memory_total_mib: float


class GpuInventory(Protocol):
    def gpus(self) -> list[GpuInfo]: ...


class NvmlInventory:
    """The real inventory. No NVML library (no driver) means no GPUs, not an error."""

    def gpus(self) -> list[GpuInfo]:
        try:
            import pynvml
        except ImportError:
            return []
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return []
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                out.append(
                    GpuInfo(
                        index=i,
                        name=name.decode() if isinstance(name, bytes) else name,
                        uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                        memory_total_mib=mem.total / 2**20,
                    )
                )
            return out
        finally:
            pynvml.nvmlShutdown()


def parse_visible_devices(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of tokens; None when unset (all GPUs visible)."""
    if value is None:
        return None
    value = value.strip()
    if value in ("", "-1", "none", "NoDevFiles"):
        return []
    return [tok.strip() for tok in value.split(",") if tok.strip()]


def visible_gpus(
    inventory: GpuInventory | None = None, environ: dict[str, str] | None = None
) -> list[GpuInfo]:
    """The GPUs this server was given: NVML's list narrowed by CUDA_VISIBLE_DEVICES (indices or UUIDs)."""
    env = os.environ if environ is None else environ
    allgpus = (inventory or NvmlInventory()).gpus()
    tokens = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    if tokens is None:
        return allgpus
    chosen = []
    for tok in tokens:
        for g in allgpus:
            if tok == str(g.index) or tok == g.uuid:
                chosen.append(g)
                break
    return chosen
