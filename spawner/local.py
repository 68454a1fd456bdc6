"""The embedded spawner: the GPU form on one machine, with servers as local processes.

Why: a team with one multi-GPU box should get the same form and rules as on Kubernetes without a cluster.
GPUs come from NVML (or a configured inventory) and are handed out exclusively through
``CUDA_VISIBLE_DEVICES`` (a GPU in MIG mode as its MIG instances, by UUID); CPU cores by affinity; memory
by a cgroup v2 limit where one is writable, else the watchdog fallback (see limits.py). Servers run as the
hub's own Unix user (SimpleLocalProcessSpawner): this mode is for a team that trusts each other on a shared
machine, not for isolating strangers.

This module is the spawner's traits, the form's choice applied and the server's environment; the server's
processes (cgroup, affinity, watchdog, what it leaves behind) are `localprocs`, and adopting a server
after a hub restart is `localstate`.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from jupyterhub.spawner import SimpleLocalProcessSpawner
from tornado.ioloop import PeriodicCallback
from traitlets import Any as AnyTrait
from traitlets import Bool, Enum, Float, Unicode, default

from tfdist import settings
from tfdist.gpus import GpuInventory, NvmlInventory

from .allocator import CorePicker, DeviceKey, GpuAllocator, GpuShortage, ModelAvailability, device_key
from .base import GpuFormMixin, user_error
from .limits import CgroupV2, find_cgroup_parent
from .localprocs import LocalServerProcesses
from .localstate import LocalServerState, saved_process
from .profiles import Profile, ProfilesConfig
from .validation import Choice

__all__ = ["TfdistLocalSpawner", "safe_dirname", "saved_process"]

# One allocator and one core picker per hub process, shared by all spawners. Keyed by the inventory's class,
# not the object: traitlets deep-copies config values into each spawner, so every spawner has its own copy.
_allocators: dict[str, GpuAllocator] = {}
_cores: CorePicker | None = None
_cgroup: tuple[CgroupV2 | None, str] | None = None


def safe_dirname(name: str) -> str:
    """A user name as a single safe path component (hub user names may contain '/', '..', spaces)."""
    # one-to-one: '-' is escaped too, so "a+" and "a-2b-" stay apart (and so do "A" and "a")
    out = re.sub(r"[^a-z0-9_.]", lambda m: f"-{ord(m.group()):x}-", name)
    return out if out.strip(".") else f"-{out}"


class TfdistLocalSpawner(LocalServerState, LocalServerProcesses, GpuFormMixin, SimpleLocalProcessSpawner):
    """Local-process spawner with the tfdist GPU form, exclusive GPUs and resource limits."""

    gpu_inventory = AnyTrait(
        None,
        allow_none=True,
        config=True,
        help="""Object with a gpus() -> list[tfdist.gpus.GpuInfo] method; default: NVML
        (tfdist.gpus.NvmlInventory). Tests put a named fake here.""",
    )
    example_dir = Unicode(
        "",
        config=True,
        help="Folder copied into each user's folder as 'examples' on first start (empty: none).",
    )
    example_notebook = Unicode(
        "digits.ipynb",
        config=True,
        help="Notebook inside example_dir that each server opens (sets default_url).",
    )
    cgroup_mode = Enum(
        ["auto", "off"],
        "auto",
        config=True,
        help="""'auto': memory/CPU limits by cgroup v2 where writable, else the watchdog fallback;
        'off': watchdog only.""",
    )
    cgroup_parent = Unicode(
        "",
        config=True,
        help="cgroup v2 directory for server cgroups (e.g. of a Delegate=yes unit); default: the hub's own.",
    )
    memory_check_interval = Float(
        5.0,
        config=True,
        help="Seconds between fallback watchdog checks of each server's memory (cgroup-less).",
    )
    hide_gpus_when_none = Bool(
        True,
        config=True,
        help=(
            "Set CUDA_VISIBLE_DEVICES='' for a 0-GPU server, so its frameworks see no GPU (not a boundary: "
            "servers run as the hub's user; docs/security.md)."
        ),
    )

    _tfdist_gpu_indices: list[DeviceKey]  # GPU indices and MIG instance UUIDs
    _tfdist_core_list: list[int]
    _tfdist_watchdog: PeriodicCallback | None = None
    _tfdist_cgroup_path: Path | None = None
    _tfdist_mem_limit: int | None = None
    # the server's process tree as last seen, {pid: create_time}: what to end once the server is gone
    _tfdist_tree: dict[int, float] | None = None
    _tfdist_server_created: float | None = None

    @default("home_dir_template")
    def _home_dir_template_default(self) -> str:
        base = settings.HubSettings().state_base()
        return os.path.join(base, "users", "{username}")

    @default("home_dir")
    def _home_dir_default(self) -> str:
        return self.home_dir_template.format(username=safe_dirname(self.user.name))

    @default("cmd")
    def _cmd_default(self) -> list[str]:
        import sys

        # the hub's own environment, whether or not its bin/ is on PATH
        return [sys.executable, "-m", "jupyterhub.singleuser"]

    @default("default_url")
    def _default_url_default(self) -> str:
        if self.example_dir and self.example_notebook:
            return f"/lab/tree/examples/{self.example_notebook}"
        return ""

    # ---- shared per-hub objects ----------------------------------------------------------------------

    def tfdist_allocator(self) -> GpuAllocator:
        inv: GpuInventory = self.gpu_inventory if self.gpu_inventory is not None else _default_inventory()
        key = f"{type(inv).__module__}.{type(inv).__qualname__}"
        alloc = _allocators.get(key)
        if alloc is None:
            alloc = _allocators[key] = GpuAllocator(inv)
        return alloc

    @staticmethod
    def tfdist_cores() -> CorePicker:
        global _cores
        if _cores is None:
            _cores = CorePicker()
        return _cores

    def tfdist_cgroup(self) -> CgroupV2 | None:
        global _cgroup
        if self.cgroup_mode == "off":
            return None
        if _cgroup is None:
            _cgroup = find_cgroup_parent(self.cgroup_parent or None)
            how = "cgroup v2" if _cgroup[0] else "watchdog fallback"
            self.log.info("tfdist memory limits: %s (%s)", how, _cgroup[1])
        return _cgroup[0]

    @property
    def tfdist_owner(self) -> str:
        return f"{self.user.name}/{self.name}"

    # ---- GpuFormMixin hooks ---------------------------------------------------------------------------

    async def gpu_availability(self) -> dict[str, ModelAvailability] | None:
        return self.tfdist_allocator().availability(self.tfdist_profiles().gpu_models)

    def apply_choice(self, choice: Choice, profile: Profile, cfg: ProfilesConfig) -> None:
        self.cpu_limit = choice.cpu
        self.cpu_guarantee = choice.cpu
        self.mem_limit = choice.memory_bytes
        self.mem_guarantee = choice.memory_bytes

    # ---- process lifecycle ----------------------------------------------------------------------------

    def _prepare_home(self) -> None:
        home = Path(self.home_dir)
        home.mkdir(parents=True, exist_ok=True)
        if self.example_dir and Path(self.example_dir).is_dir():
            dest = home / "examples"
            if not dest.exists():
                shutil.copytree(self.example_dir, dest)

    async def start(self) -> Any:
        choice = await self.tfdist_ensure_applied()
        cfg = self.tfdist_profiles()
        owner = self.tfdist_owner
        alloc = self.tfdist_allocator()
        alloc.release(owner)
        gpus = []
        if choice.gpus and choice.gpu_model:
            model = cfg.gpu_models[choice.gpu_model]
            try:
                gpus = alloc.reserve(owner, choice.gpu_model, model, choice.gpus)
            except GpuShortage as e:
                raise user_error(
                    f"{model.display_name}: you asked for {e.asked} GPU{'s' if e.asked != 1 else ''} "
                    f"but only {e.free} free right now."
                ) from None
        self._tfdist_gpu_indices = [device_key(g) for g in gpus]
        self._tfdist_core_list = self.tfdist_cores().pick(owner, choice.cpu)
        self._tfdist_mem_limit = choice.memory_bytes
        self._tfdist_tree = {}
        self._tfdist_server_created = None
        try:
            self._prepare_home()
            cg = self.tfdist_cgroup()
            self._tfdist_cgroup_path = cg.create(owner, choice.memory_bytes, choice.cpu) if cg else None
            result = await super().start()
        except BaseException:
            self._tfdist_release()
            raise
        self._tfdist_record_tree()
        if self._tfdist_cgroup_path is None and self.memory_check_interval > 0:
            self._start_watchdog(choice.memory_bytes)
        self.log.info(
            "Started %s: GPUs %s, cores %s, %.3g GiB (%s)",
            owner,
            self._tfdist_gpu_indices or "none",
            self._tfdist_core_list,
            choice.memory_gib,
            "cgroup v2" if self._tfdist_cgroup_path else "watchdog",
        )
        return result

    def get_args(self) -> list[str]:
        args = list(super().get_args())
        if os.geteuid() == 0 and "--allow-root" not in args:
            args.append("--allow-root")  # servers run as the hub's user; in containers that is often root
        return args

    def get_env(self) -> dict[str, str]:
        env = super().get_env()
        choice = self.tfdist_choice
        indices = list(getattr(self, "_tfdist_gpu_indices", []) or [])
        if indices or self.hide_gpus_when_none:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in indices)
        # NVML index order == PCI bus order; make CUDA number devices the same way
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # TensorFlow's C++ start-up chatter (info/warning) would show as red stderr in the first cells
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env[settings.ENV_BACKEND] = "local"
        env[settings.ENV_GPUS] = str(len(indices))
        env[settings.ENV_USER] = self.user.name
        # servers here share one Unix user: each hub user's jobs live apart (names, sockets, logs)
        env[settings.ENV_STATE_DIR] = os.path.join(self.home_dir, ".tfdist", "jobs")
        if choice is not None and choice.gpu_model:
            env[settings.ENV_GPU_MODEL] = choice.gpu_model
        if choice is not None:
            env["MEM_LIMIT"] = str(choice.memory_bytes)  # jupyter-resource-usage shows it
            env["CPU_LIMIT"] = f"{choice.cpu:g}"
        return env


def _default_inventory() -> GpuInventory:
    global _nvml
    if _nvml is None:
        _nvml = NvmlInventory()
    return _nvml


_nvml: GpuInventory | None = None
