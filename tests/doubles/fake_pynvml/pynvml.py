"""A stand-in `pynvml` module (nvidia-ml-py's import name) for processes the tests start on a machine
without a GPU: notebook servers and the hub's GPU admin service.

Named, one behaviour: it answers the NVML calls `tfdist.nvml.Nvml` makes from a JSON file named by
``TFDIST_FAKE_NVML`` and re-reads the file on every utilization/memory call, so a test makes a GPU busy or
idle by rewriting the file. Put this folder first on PYTHONPATH of the process to fool; everything above
the NVML calls (visible_gpus, CUDA_VISIBLE_DEVICES narrowing, the samplers) is the production code.

File: ``{"gpus": [{"name": "...", "uuid": "GPU-...", "memory_total_mib": 81559, "util": 0,
"mem_used_mib": 0}, ...]}``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


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


def nvmlDeviceGetName(h: int) -> str:
    return str(_devices()[h]["name"])


def nvmlDeviceGetUUID(h: int) -> str:
    return str(_devices()[h]["uuid"])


def nvmlDeviceGetMemoryInfo(h: int) -> SimpleNamespace:
    d = _devices()[h]
    total = float(d.get("memory_total_mib", 81559.0)) * 2**20
    used = float(d.get("mem_used_mib", 0.0)) * 2**20
    return SimpleNamespace(total=int(total), used=int(used), free=int(total - used))


def nvmlDeviceGetUtilizationRates(h: int) -> SimpleNamespace:
    d = _devices()[h]
    return SimpleNamespace(gpu=int(d.get("util", 0)), memory=0)
