"""Which GPUs this process may use, read from NVML and narrowed by CUDA_VISIBLE_DEVICES.

One small interface (`GpuInventory`) so that the embedded hub, the magic and the samplers ask the same
question the same way, and tests can swap in a named double where no GPU exists.
"""

from __future__ import annotations

import os
from typing import Protocol

from .nvml import GpuInfo, Nvml

__all__ = ["GpuInfo", "GpuInventory", "NvmlInventory", "parse_visible_devices", "visible_gpus"]


class GpuInventory(Protocol):
    def gpus(self) -> list[GpuInfo]: ...


class NvmlInventory:
    """The real inventory. No NVML library (no driver) means no GPUs, not an error. A GPU in MIG mode is
    listed as its MIG instances (`GpuInfo.mig_profile`), since CUDA cannot use it whole."""

    def gpus(self) -> list[GpuInfo]:
        with Nvml() as nvml:
            return nvml.devices()


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
    """The GPUs this server was given: NVML's list narrowed by CUDA_VISIBLE_DEVICES (indices or UUIDs; an
    index of a GPU in MIG mode stands for all its MIG instances, a MIG-... UUID for one)."""
    env = os.environ if environ is None else environ
    allgpus = (inventory or NvmlInventory()).gpus()
    tokens = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    if tokens is None:
        return allgpus
    chosen: list[GpuInfo] = []
    for tok in tokens:
        for g in allgpus:
            if (tok == str(g.index) or tok == g.uuid) and g not in chosen:
                chosen.append(g)
                if not g.mig_profile:
                    break
    return chosen
