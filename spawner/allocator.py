"""Exclusive GPU handout and CPU core placement for the embedded (single-machine) hub.

Why: on one shared machine two notebook servers must never get the same GPU, and the free count the form
shows must be the one the spawn checks. One `GpuAllocator` per hub process holds the truth; taking GPUs is a
synchronous check-and-take, so two spawns racing on the hub's event loop cannot both win the last GPU.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tfdist.gpus import GpuInfo, GpuInventory, visible_gpus

from .mig import mig_profile
from .profiles import GpuModel

__all__ = ["CorePicker", "DeviceKey", "GpuAllocator", "GpuShortage", "ModelAvailability", "device_key"]

#: a handed-out device: a whole GPU by NVML index, a MIG instance by its UUID ("MIG-...")
DeviceKey = int | str

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelAvailability:
    """Free and total GPUs of one model (embedded: on this machine; Kubernetes: in the cluster).

    `max_on_node`: the most GPUs of the model free on any one schedulable node (Kubernetes), i.e. the
    largest request that can be placed now, since one pod's GPUs are all on one node; None where the
    question does not arise (the embedded hub is one machine, so `free` is already that number).
    """

    free: int
    total: int
    max_on_node: int | None = None


class GpuShortage(Exception):
    """Fewer matching GPUs are free than asked for; `free` says how many are."""

    def __init__(self, model: str, asked: int, free: int) -> None:
        super().__init__(f"{model}: asked for {asked}, only {free} free")
        self.model = model
        self.asked = asked
        self.free = free


def device_key(g: GpuInfo) -> DeviceKey:
    """How the allocator and the saved server state name a device: whole GPUs by index (as CUDA numbers
    them), MIG instances by UUID (the only name CUDA accepts for them, and stable across reboots)."""
    return g.uuid if g.mig_profile else g.index


def _order(k: DeviceKey) -> tuple[bool, int, str]:
    return (isinstance(k, str), k if isinstance(k, int) else 0, str(k))


class GpuAllocator:
    """Which server holds which GPU (index) or MIG instance (UUID) on this machine.

    A GPU model whose resource names a MIG profile (``nvidia.com/mig-1g.10gb``) is served by MIG instances
    of that profile, each exclusive like a whole GPU; every other model by whole GPUs not in MIG mode.

    Owners are opaque strings (``user/server``). The inventory is read once and cached: GPUs do not come and
    go while the hub runs, and NVML calls cost milliseconds a form render should not pay.

    Only the GPUs the hub process itself may see are handed out: when the hub runs with
    ``CUDA_VISIBLE_DEVICES`` set (NVML indices or UUIDs), the inventory is narrowed to those, so an admin
    can keep GPUs away from the hub's users. `environ` defaults to the hub's own environment.
    """

    def __init__(self, inventory: GpuInventory, environ: Mapping[str, str] | None = None) -> None:
        self._inventory = inventory
        self._environ = environ
        self._gpus: list[GpuInfo] | None = None
        self._held: dict[DeviceKey, str] = {}
        self._lock = threading.Lock()

    def gpus(self) -> list[GpuInfo]:
        if self._gpus is None:
            env = dict(os.environ if self._environ is None else self._environ)
            self._gpus = sorted(visible_gpus(self._inventory, env), key=lambda g: g.index)
        return self._gpus

    def _matching(self, model: GpuModel) -> list[GpuInfo]:
        profile = mig_profile(model.resource)
        return [g for g in self.gpus() if g.mig_profile == profile and model.matches_nvml(g.name)]

    def availability(self, models: Mapping[str, GpuModel]) -> dict[str, ModelAvailability]:
        with self._lock:
            out = {}
            for key, model in models.items():
                match = self._matching(model)
                out[key] = ModelAvailability(
                    free=sum(1 for g in match if device_key(g) not in self._held), total=len(match)
                )
            return out

    def reserve(self, owner: str, model_key: str, model: GpuModel, count: int) -> list[GpuInfo]:
        """Take `count` free GPUs (or MIG instances) of `model` for `owner` (lowest indices first), or
        raise GpuShortage."""
        if count <= 0:
            return []
        with self._lock:
            free = [g for g in self._matching(model) if device_key(g) not in self._held]
            if len(free) < count:
                raise GpuShortage(model_key, count, len(free))
            taken = free[:count]
            for g in taken:
                self._held[device_key(g)] = owner
            return taken

    def adopt(
        self,
        owner: str,
        indices: Iterable[DeviceKey],
        logger: logging.Logger | logging.LoggerAdapter = log,
    ) -> list[DeviceKey]:
        """Re-register GPUs a still-running server held before a hub restart; returns those now held.

        An index another owner holds already is not taken (it stays with that owner), but the server still
        runs with it in its CUDA_VISIBLE_DEVICES: that sharing is logged as a warning for the admin.
        """
        with self._lock:
            ok = []
            for i in indices:
                other = self._held.get(i, owner)
                if other == owner:
                    self._held[i] = owner
                    ok.append(i)
                else:
                    logger.warning(
                        "tfdist: %s held GPU %s before the hub restart, but %s holds it now; "
                        "both servers may use that GPU until one of them stops",
                        owner,
                        i,
                        other,
                    )
            return ok

    def release(self, owner: str) -> None:
        with self._lock:
            for i in [i for i, o in self._held.items() if o == owner]:
                del self._held[i]

    def held_by(self, owner: str) -> list[DeviceKey]:
        with self._lock:
            return sorted((i for i, o in self._held.items() if o == owner), key=_order)


class CorePicker:
    """CPU cores for a server's affinity: the least-used cores of the hub's own set.

    Cores are shared when the machine is oversubscribed (CPU time, unlike a GPU, can be shared); affinity
    keeps one user's 2-core server on 2 cores instead of spreading BLAS threads over all of them.
    """

    def __init__(self, cores: Iterable[int] | None = None) -> None:
        self._cores = sorted(cores if cores is not None else _hub_cores())
        self._use: dict[int, int] = {c: 0 for c in self._cores}
        self._owners: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def cores(self) -> list[int]:
        return list(self._cores)

    def pick(self, owner: str, cpu: float) -> list[int]:
        want = max(1, min(len(self._cores), math.ceil(cpu - 1e-9)))
        with self._lock:
            self._release_locked(owner)
            chosen = sorted(sorted(self._cores, key=lambda c: (self._use[c], c))[:want])
            for c in chosen:
                self._use[c] += 1
            self._owners[owner] = chosen
            return chosen

    def adopt(self, owner: str, cores: Iterable[int]) -> list[int]:
        """Re-register the cores a still-running server was pinned to before a hub restart.

        Cores are shared, so there is no conflict; cores this hub may not use are dropped from the count
        (the server keeps its affinity; the kernel, not this picker, enforces it). Returns those counted.
        """
        with self._lock:
            self._release_locked(owner)
            chosen = sorted({int(c) for c in cores if int(c) in self._use})
            for c in chosen:
                self._use[c] += 1
            self._owners[owner] = chosen
            return chosen

    def release(self, owner: str) -> None:
        with self._lock:
            self._release_locked(owner)

    def _release_locked(self, owner: str) -> None:
        for c in self._owners.pop(owner, []):
            self._use[c] = max(0, self._use[c] - 1)


def _hub_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))
