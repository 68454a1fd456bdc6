"""A stand-in `pynvml` module (nvidia-ml-py's import name) for processes the tests start on a machine
without a GPU: notebook servers, job supervisors and the hub's GPU admin service.

Named, one behaviour: it answers the NVML calls `tfdist.nvml.Nvml` makes from a JSON file named by
``TFDIST_FAKE_NVML`` and re-reads the file on every call, so a test makes a GPU busy or idle by rewriting
the file. Put this folder first on PYTHONPATH of the process to fool; everything above the NVML calls
(visible_gpus, CUDA_VISIBLE_DEVICES narrowing, the samplers) is the production code.

It fails as nvidia-ml-py does: `NVMLError(code)` becomes the code's subclass (`NVMLError_NotSupported`,
`NVMLError_NotFound`, ...) with `.value` the NVML_ERROR_* code and `str()` NVML's text. What it answers
follows NVML's documentation (nvml-api, device queries):

* `nvmlDeviceGetUtilizationRates`: NVML_ERROR_NOT_SUPPORTED on a GPU in MIG mode ("On MIG-enabled GPUs,
  querying device utilization rates is not currently supported") and on every MIG device handle: NVML has
  no per-instance activity (only DCGM's profiling metrics do).
* `nvmlDeviceGetMemoryInfo`: per MIG device, its own memory; on a GPU in MIG mode, the whole GPU (used: the
  instances' sum) only for a privileged caller, NVML_ERROR_NO_PERMISSION otherwise (``"privileged":
  false`` in the file).
* `nvmlDeviceGetMigMode`: NVML_ERROR_NOT_SUPPORTED on a GPU without MIG; INVALID_ARGUMENT on a MIG
  device handle.
* `nvmlDeviceGetMigDeviceHandleByIndex`: NVML_ERROR_NOT_FOUND for an empty slot; INVALID_ARGUMENT on a GPU
  not in MIG mode.
* `nvmlDeviceGetHandleByUUID`: a "MIG-..." UUID is accepted from driver 470 on (``"driver"`` in the file,
  default 550.54.15); older drivers answer NVML_ERROR_NOT_FOUND (their MIG UUIDs had another form).
* a GPU whose entry says ``"lost": true`` answers NVML_ERROR_GPU_IS_LOST to every query (a fallen-off GPU).

File: ``{"driver": "550.54.15", "gpus": [{"name": "...", "uuid": "GPU-...", "memory_total_mib": 81559,
"util": 0, "mem_used_mib": 0}, ...]}``. A GPU in MIG mode adds ``"mig": [{"profile": "1g.10gb", "uuid":
"MIG-...", "memory_total_mib": 9728, "mem_used_mib": 0}, null, ...]`` (null: an empty slot); a MIG device
is named "<GPU name> MIG <profile>" (without the profile where ``"name_has_profile": false``, as older
drivers did: found from its attributes). ``"mig_mode": 0`` is a MIG-capable GPU with MIG off; a GPU with
neither key has no MIG support. A "util" on a GPU in MIG mode is ignored: it cannot be read there.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """As nvidia-ml-py's: `NVMLError(code)` is an instance of that code's subclass."""

    _by_code: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._by_code.get(value, NVMLError)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return _TEXT.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, code: int) -> type[NVMLError]:
    cls = type(name, (NVMLError,), {"__new__": lambda c, *a: NVMLError.__new__(c, code)})
    NVMLError._by_code[code] = cls
    return cls


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _error_class("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)

Handle = int | tuple[int, int]  # a GPU by index; a MIG device by (GPU index, slot)


def _machine() -> dict[str, Any]:
    path = os.environ.get("TFDIST_FAKE_NVML")
    if not path:  # as on a machine without the driver's library
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    with open(path) as f:
        return dict(json.load(f))


def _devices() -> list[dict[str, Any]]:
    return list(_machine()["gpus"])


def _driver_major() -> int:
    return int(str(_machine().get("driver", "550.54.15")).split(".")[0])


def _gpu(h: Handle) -> dict[str, Any]:
    """The JSON entry of the GPU `h` is (or is a MIG device of); a lost GPU fails every query."""
    devs = _devices()
    i = h[0] if isinstance(h, tuple) else h
    if not isinstance(i, int) or not 0 <= i < len(devs):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if devs[i].get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return devs[i]


def _mig_on(d: dict[str, Any]) -> bool:
    return "mig" in d and int(d.get("mig_mode", NVML_DEVICE_MIG_ENABLE)) == NVML_DEVICE_MIG_ENABLE


def _dev(h: Handle) -> dict[str, Any]:
    """The JSON entry of a GPU, or of a MIG device (named after its parent)."""
    d = _gpu(h)
    if isinstance(h, tuple):
        slots = d.get("mig") or []
        if not _mig_on(d) or not 0 <= h[1] < len(slots) or slots[h[1]] is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # a handle that no longer names a device
        mig = dict(slots[h[1]])
        mig["name"] = d["name"] + (f" MIG {mig['profile']}" if mig.get("name_has_profile", True) else "")
        mig["is_mig"] = True
        return mig
    return d


def nvmlInit() -> None:
    _machine()


def nvmlShutdown() -> None:
    pass


def nvmlSystemGetDriverVersion() -> str:
    return str(_machine().get("driver", "550.54.15"))


def nvmlDeviceGetCount() -> int:
    return len(_devices())


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    if not 0 <= i < len(_devices()):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return i


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> Handle:
    u = uuid.decode() if isinstance(uuid, bytes) else uuid
    for i, d in enumerate(_devices()):
        if d["uuid"] == u:
            return i
        for slot, m in enumerate(d.get("mig") or []):
            if m and m["uuid"] == u and _mig_on(d) and _driver_major() >= 470:
                return (i, slot)
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetName(h: Handle) -> str:
    return str(_dev(h)["name"])


def nvmlDeviceGetUUID(h: Handle) -> str:
    return str(_dev(h)["uuid"])


def nvmlDeviceGetMemoryInfo(h: Handle) -> SimpleNamespace:
    d = _dev(h)
    total = float(d.get("memory_total_mib", 81559.0))
    used = float(d.get("mem_used_mib", 0.0))
    if not isinstance(h, tuple) and _mig_on(d):
        if not _machine().get("privileged", True):
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        used += sum(float(m.get("mem_used_mib", 0.0)) for m in d["mig"] if m)
    return SimpleNamespace(total=int(total * 2**20), used=int(used * 2**20), free=int((total - used) * 2**20))


def nvmlDeviceGetUtilizationRates(h: Handle) -> SimpleNamespace:
    d = _dev(h)
    if d.get("is_mig") or _mig_on(d):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return SimpleNamespace(gpu=int(d.get("util", 0)), memory=0)


def nvmlDeviceIsMigDeviceHandle(h: Handle) -> int:
    _dev(h)
    return int(isinstance(h, tuple))


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h: Handle) -> int:
    if not isinstance(h, tuple):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    _dev(h)
    return h[0]


def nvmlDeviceGetMigMode(h: Handle) -> list[int]:
    if isinstance(h, tuple):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    d = _gpu(h)
    if "mig_mode" not in d and "mig" not in d:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    mode = int(d.get("mig_mode", NVML_DEVICE_MIG_ENABLE))
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(h: Handle) -> int:
    d = _gpu(h)
    if "mig_mode" not in d and "mig" not in d:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return int(d.get("mig_slots", 7))


def nvmlDeviceGetMigDeviceHandleByIndex(h: Handle, slot: int) -> tuple[int, int]:
    if isinstance(h, tuple):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    d = _gpu(h)
    if not _mig_on(d):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    migs = d.get("mig") or []
    if not 0 <= slot < int(d.get("mig_slots", 7)):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if slot >= len(migs) or migs[slot] is None:
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return (h, slot)


def nvmlDeviceGetAttributes(h: Handle) -> SimpleNamespace:
    d = _dev(h)
    if not d.get("is_mig"):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # the double answers attributes of MIG devices only
    return SimpleNamespace(
        gpuInstanceSliceCount=int(d["profile"].split("g.")[0]), memorySizeMB=int(d["memory_total_mib"])
    )
