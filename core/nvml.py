"""The one wrapper around NVML (nvidia-ml-py) that the GPU inventory and the samplers share.

Why one: both need "no driver means no GPUs, not an error", bytes-or-str names, and handles opened once;
written twice they drifted. Every NVML call of the project goes through `Nvml`.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class GpuInfo:
    """One device a server can be given: a whole GPU, or one MIG instance of a GPU in MIG mode."""

    index: int  # NVML index on this machine (of the parent GPU, for a MIG instance)
    name: str  # model, e.g. "NVIDIA H100 80GB HBM3" (the parent's, for a MIG instance)
    uuid: str  # "GPU-..." or, for a MIG instance, "MIG-..."
    memory_total_mib: float
    #: the MIG profile ("1g.10gb") of a MIG instance; "" for a whole GPU
    mig_profile: str = ""

    @property
    def cuda_id(self) -> str:
        """What CUDA_VISIBLE_DEVICES names it by: the index of a whole GPU, the UUID of a MIG instance
        (CUDA accepts only UUIDs for MIG devices)."""
        return self.uuid if self.mig_profile else str(self.index)


#: why a utilization is None: "mig" (a MIG instance, or a GPU in MIG mode: NVML answers NOT_SUPPORTED there,
#: per-instance activity exists only in DCGM's profiling metrics), "not-supported" (NVML says so for this
#: GPU), "error" (NVML failed: a lost GPU, a driver error), "no-device" (no such GPU or NVML at all)
UtilMissing = Literal["mig", "not-supported", "error", "no-device"]

#: what each reason means in words (the monitor, the admin page and the culler's notice say it so)
UTIL_MISSING_TEXT: dict[str, str] = {
    "mig": "not measurable on a MIG instance (NVML has no per-instance utilization)",
    "not-supported": "not measurable on this GPU (NVML: not supported)",
    "error": "not read (NVML error)",
    "no-device": "no such GPU",
}


@dataclass(frozen=True)
class GpuUsage:
    """One reading of one device. `util` is None exactly when `util_missing` says why: never a made-up 0,
    never the parent GPU's value for a MIG instance. Memory is read on its own (a MIG instance has it)."""

    util: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    util_missing: UtilMissing | None = None

    def record(self) -> dict[str, Any]:
        """The sample's JSON keys (nvitop's layout, units in the names); ``util_missing`` only when set."""
        out: dict[str, Any] = {
            "util (%)": self.util,
            "mem_used (MiB)": self.mem_used_mib,
            "mem_total (MiB)": self.mem_total_mib,
        }
        if self.util_missing is not None:
            out["util_missing"] = self.util_missing
        return out


NO_DEVICE = GpuUsage(None, None, None, "no-device")

# "NVIDIA A100-SXM4-80GB MIG 1g.10gb": what NVML names a MIG device
_MIG_NAME = re.compile(r"^(?P<parent>.*?)\s*MIG\s+(?P<profile>\d+g\.\d+gb)\b")


def _suppress() -> contextlib.suppress:
    return contextlib.suppress(Exception)


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

    def mig_instances(self, index: int) -> list[GpuInfo] | None:
        """The MIG instances of GPU `index` when it is in MIG mode (maybe none yet), else None.

        A GPU in MIG mode cannot be used whole: CUDA sees only its instances, each by its UUID."""
        h = self._handles.get(index)
        if h is None:
            return None
        lib = self._lib
        try:
            current, _pending = lib.nvmlDeviceGetMigMode(h)
        except Exception:  # no MIG support (most GPUs), or an old driver
            return None
        if current != getattr(lib, "NVML_DEVICE_MIG_ENABLE", 1):
            return None
        try:  # the name only: the whole GPU's memory needs privileges in MIG mode (NO_PERMISSION)
            parent = _text(lib.nvmlDeviceGetName(h))
        except Exception:
            return []
        out = []
        try:
            slots = lib.nvmlDeviceGetMaxMigDeviceCount(h)
        except Exception:
            return []
        for slot in range(slots):
            try:
                m = lib.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
            except Exception:  # an empty slot (NVML_ERROR_NOT_FOUND)
                continue
            try:
                uuid = _text(lib.nvmlDeviceGetUUID(m))
                mem = lib.nvmlDeviceGetMemoryInfo(m).total / 2**20
                profile = self._mig_profile(m)
            except Exception:
                continue
            if profile:
                out.append(GpuInfo(index, parent, uuid, mem, mig_profile=profile))
        return out

    def _mig_profile(self, mig: Any) -> str:
        """'1g.10gb' from the device's name; else from its slices and memory (the nearest known profile)."""
        from tfdist.spawner.mig import profile_for

        with _suppress():
            found = _MIG_NAME.match(_text(self._lib.nvmlDeviceGetName(mig)))
            if found:
                return found["profile"]
        with _suppress():
            attrs = self._lib.nvmlDeviceGetAttributes(mig)
            return profile_for(int(attrs.gpuInstanceSliceCount), float(attrs.memorySizeMB) / 1024)
        return ""

    def devices(self) -> list[GpuInfo]:
        """What can be handed out: every GPU not in MIG mode, and every MIG instance of those that are."""
        out: list[GpuInfo] = []
        for i in self.indices():
            migs = self.mig_instances(i)
            if migs is not None:
                out += migs
            elif (g := self.info(i)) is not None:
                out.append(g)
        return out

    def _mig_handle(self, device: GpuInfo) -> Any:
        """The NVML handle of MIG instance `device`, found among its parent's instances by UUID (works on
        every driver; nvmlDeviceGetHandleByUUID takes MIG UUIDs only from R470 on)."""
        h = self._handles.get(device.index)
        if h is None:
            return None
        lib = self._lib
        try:
            slots = lib.nvmlDeviceGetMaxMigDeviceCount(h)
        except Exception:
            return None
        for slot in range(slots):
            try:
                m = lib.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
                if _text(lib.nvmlDeviceGetUUID(m)) == device.uuid:
                    return m
            except Exception:
                continue
        return None

    def _is_mig_mode(self, h: Any) -> bool:
        try:
            current, _pending = self._lib.nvmlDeviceGetMigMode(h)
        except Exception:
            return False
        return bool(current == getattr(self._lib, "NVML_DEVICE_MIG_ENABLE", 1))

    def read(self, device: int | GpuInfo) -> GpuUsage:
        """Utilization and memory now (nvidia-smi's utilization.gpu, memory.used, memory.total) of a whole
        GPU (its index, or its GpuInfo) or of one MIG instance (its GpuInfo): memory is the instance's own,
        utilization is None with `util_missing` "mig", as NVML cannot measure it there."""
        mig = isinstance(device, GpuInfo) and bool(device.mig_profile)
        index = device.index if isinstance(device, GpuInfo) else device
        if self._lib is None or index not in self._handles:
            return NO_DEVICE
        h = self._mig_handle(device) if isinstance(device, GpuInfo) and mig else self._handles[index]
        if h is None:
            return NO_DEVICE
        used = total = None
        try:
            mem = self._lib.nvmlDeviceGetMemoryInfo(h)
            used, total = mem.used / 2**20, mem.total / 2**20
        except Exception:  # e.g. NO_PERMISSION on a GPU in MIG mode for an unprivileged caller
            pass
        if mig or self._is_mig_mode(h):
            return GpuUsage(None, used, total, "mig")
        try:
            return GpuUsage(float(self._lib.nvmlDeviceGetUtilizationRates(h).gpu), used, total)
        except Exception as e:
            code = getattr(e, "value", None)
            why: UtilMissing = (
                "not-supported" if code == getattr(self._lib, "NVML_ERROR_NOT_SUPPORTED", 3) else "error"
            )
            return GpuUsage(None, used, total, why)

    def usage(self, index: int) -> dict[str, Any]:
        """`read(index).record()`: the sample keys of a whole GPU by its index."""
        return self.read(index).record()
