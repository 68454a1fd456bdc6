"""A stand-in `pynvml` module (nvidia-ml-py's import name) for processes the tests start on a machine
without a GPU: notebook servers and the hub's GPU admin service.

Named, one behaviour: it answers the NVML calls `tfdist.nvml.Nvml` makes from a JSON file named by
``TFDIST_FAKE_NVML`` and re-reads the file on every utilization/memory call, so a test makes a GPU busy or
idle by rewriting the file. Put this folder first on PYTHONPATH of the process to fool; everything above
the NVML calls (visible_gpus, CUDA_VISIBLE_DEVICES narrowing, the samplers) is the production code.

File: ``{"gpus": [{"name": "...", "uuid": "GPU-...", "memory_total_mib": 81559, "util": 0,
"mem_used_mib": 0}, ...]}``. A GPU in MIG mode adds ``"mig": [{"profile": "1g.10gb", "uuid": "MIG-...",
"memory_total_mib": 9728}, null, ...]`` (null: an empty slot), answered as NVML answers for MIG devices
(name "<GPU name> MIG <profile>", or without the profile where ``"name_has_profile": false``, for the
attributes fallback; no utilization). ``"mig_mode": 0`` is a MIG-capable GPU with MIG off; a GPU without
either key is one without MIG support (NVML says "Not Supported").
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    pass


Handle = int | tuple[int, int]  # a GPU by index; a MIG device by (GPU index, slot)


def _dev(h: Handle) -> dict[str, Any]:
    """The JSON entry of a GPU, or of a MIG device (with its parent's name)."""
    devs = _devices()
    if isinstance(h, tuple):
        gpu, slot = h
        mig = dict(devs[gpu]["mig"][slot])
        mig["name"] = devs[gpu]["name"]
        if mig.get("name_has_profile", True):
            mig["name"] += f" MIG {mig['profile']}"
        mig["is_mig"] = True
        return mig
    return devs[h]


def _devices() -> list[dict[str, Any]]:
    path = os.environ.get("TFDIST_FAKE_NVML")
    if not path:
        raise NVMLError("TFDIST_FAKE_NVML is not set")
    with open(path) as f:
        return list(json.load(f)["gpus"])


def nvmlInit() -> None:
    _devices()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_devices())


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    if not 0 <= i < len(_devices()):
        raise NVMLError(f"no device {i}")
    return i


def nvmlDeviceGetName(h: Handle) -> str:
    return str(_dev(h)["name"])


def nvmlDeviceGetUUID(h: Handle) -> str:
    return str(_dev(h)["uuid"])


def nvmlDeviceGetMemoryInfo(h: Handle) -> SimpleNamespace:
    d = _dev(h)
    total = float(d.get("memory_total_mib", 81559.0)) * 2**20
    used = float(d.get("mem_used_mib", 0.0)) * 2**20
    return SimpleNamespace(total=int(total), used=int(used), free=int(total - used))


def nvmlDeviceGetUtilizationRates(h: Handle) -> SimpleNamespace:
    d = _dev(h)
    if d.get("is_mig"):
        raise NVMLError("Not Supported")  # NVML has no utilization per MIG device
    return SimpleNamespace(gpu=int(d.get("util", 0)), memory=0)


def nvmlDeviceGetMigMode(h: int) -> list[int]:
    d = _devices()[h]
    if "mig_mode" not in d and "mig" not in d:
        raise NVMLError("Not Supported")
    mode = int(d.get("mig_mode", NVML_DEVICE_MIG_ENABLE))
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(h: int) -> int:
    return int(_devices()[h].get("mig_slots", 7))


def nvmlDeviceGetMigDeviceHandleByIndex(h: int, slot: int) -> tuple[int, int]:
    migs = _devices()[h].get("mig") or []
    if not 0 <= slot < len(migs) or migs[slot] is None:
        raise NVMLError("Not Found")
    return (h, slot)


def nvmlDeviceGetAttributes(h: tuple[int, int]) -> SimpleNamespace:
    d = _dev(h)
    return SimpleNamespace(
        gpuInstanceSliceCount=int(d["profile"].split("g.")[0]), memorySizeMB=int(d["memory_total_mib"])
    )
