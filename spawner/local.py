"""The embedded spawner: the GPU form on one machine, with servers as local processes.

Why: a team with one multi-GPU box should get the same form and rules as on Kubernetes without a cluster.
GPUs come from NVML (or a configured inventory) and are handed out exclusively through
``CUDA_VISIBLE_DEVICES`` (a GPU in MIG mode as its MIG instances, by UUID); CPU cores by affinity; memory
by a cgroup v2 limit where one is writable, else the watchdog fallback (see limits.py). Servers run as the
hub's own Unix user (SimpleLocalProcessSpawner): this mode is for a team that trusts each other on a shared
machine, not for isolating strangers.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from jupyterhub.spawner import SimpleLocalProcessSpawner
from tornado.ioloop import PeriodicCallback
from traitlets import Any as AnyTrait
from traitlets import Bool, Enum, Float, Unicode, default

from tfdist import settings
from tfdist.gpus import GpuInventory, NvmlInventory
from tfdist.procid import ProcessId, start_time

from .allocator import CorePicker, DeviceKey, GpuAllocator, GpuShortage, ModelAvailability, device_key
from .base import GpuFormMixin, user_error
from .limits import CgroupV2, enforce_once, find_cgroup_parent, kill_recorded, record_tree
from .profiles import Profile, ProfilesConfig
from .validation import Choice

__all__ = ["TfdistLocalSpawner", "safe_dirname"]

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


def saved_process(ident: ProcessId) -> dict[str, Any]:
    """The server process as the hub's saved state names it: a PID alone may name another process later."""
    return {"pid": ident.pid, "tfdist_started": ident.started, "tfdist_boot": ident.boot}


class TfdistLocalSpawner(GpuFormMixin, SimpleLocalProcessSpawner):
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
        True, config=True, help="Set CUDA_VISIBLE_DEVICES='' for a 0-GPU server so it cannot touch any GPU."
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

    def make_preexec_fn(self, name: str) -> Callable[[], None]:
        base = super().make_preexec_fn(name)
        cores = list(getattr(self, "_tfdist_core_list", []) or [])
        join = CgroupV2.join_fn(self._tfdist_cgroup_path) if self._tfdist_cgroup_path else None

        def preexec() -> None:
            base()
            if join is not None:
                join()
            if cores:
                os.sched_setaffinity(0, cores)

        return preexec

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

    def _tfdist_record_tree(self) -> None:
        """Remember the server's process tree (pids + create times), to end it once the server is gone."""
        if not self.pid:
            return
        if self._tfdist_tree is None:
            self._tfdist_tree = {}
        if self._tfdist_server_created is None:
            self._tfdist_server_created = start_time(self.pid)
        record_tree(self.pid, self._tfdist_tree, self._tfdist_server_created)

    def _start_watchdog(self, limit: int) -> None:
        if self._tfdist_watchdog is not None:
            self._tfdist_watchdog.stop()

        def check() -> None:
            if self.pid:
                self._tfdist_record_tree()
                enforce_once(self.pid, limit, self.log)

        self._tfdist_watchdog = PeriodicCallback(check, self.memory_check_interval * 1000)
        self._tfdist_watchdog.start()

    def _tfdist_kill_leftovers(self) -> None:
        """End what the server left behind (recorded while it ran), before its GPUs go to someone else."""
        tree = self._tfdist_tree or {}
        self._tfdist_tree = {}
        self._tfdist_server_created = None
        killed = kill_recorded(tree)
        if killed:
            self.log.warning(
                "tfdist: ended %d process(es) %s/%s left behind: pids %s",
                len(killed),
                self.user.name,
                self.name,
                killed,
            )

    def _tfdist_release(self) -> None:
        owner = self.tfdist_owner
        if self._tfdist_watchdog is not None:
            self._tfdist_watchdog.stop()
            self._tfdist_watchdog = None
        self._tfdist_kill_leftovers()
        if self._tfdist_cgroup_path is not None:
            CgroupV2.remove_path(self._tfdist_cgroup_path)  # cgroup.kill: ends all left in it
        self.tfdist_allocator().release(owner)
        self.tfdist_cores().release(owner)
        self._tfdist_cgroup_path = None
        self._tfdist_mem_limit = None
        self._tfdist_gpu_indices = []
        self._tfdist_core_list = []

    async def poll(self) -> int | None:
        """The base class asks only whether the PID exists; it must also still be the server."""
        if self.proc is None and self.pid and self._tfdist_saved_pid_gone():
            self.clear_state()  # adopted after a hub restart (no Popen): the start time is all we have
            return 0
        return await super().poll()  # our own child: Popen knows (and reaps it)

    def _tfdist_saved_pid_gone(self) -> bool:
        """The saved pid no longer names the server it was saved for (its start time differs)."""
        started = self._tfdist_server_created
        return started is not None and not ProcessId(self.pid, started).alive()

    async def _signal(self, sig: int) -> bool:
        """Signal the server process, and nothing else.

        The base class calls os.kill(self.pid, sig), and a pid of 0 there means the hub's whole process
        group: whatever started the hub (a terminal's shell, a test runner) would get the SIGTERM or SIGKILL
        meant for one server. So: our own child while it is not reaped (its pid cannot be reused), else the
        saved pid only while it is still the server (start time), else nothing."""
        if self.proc is not None:
            if self.proc.poll() is not None:
                return False
            pid = self.proc.pid
        else:
            if self.pid <= 0 or self._tfdist_saved_pid_gone():
                return False
            pid = self.pid
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    async def stop(self, now: bool = False) -> None:
        # kernels run in sessions of their own; remember them to end any the server leaves behind
        self._tfdist_record_tree()
        try:
            await super().stop(now=now)
        finally:
            self._tfdist_release()

    # ---- state: GPUs held by a server that outlives a hub restart -------------------------------------

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        if self.pid and getattr(self, "_tfdist_gpu_indices", None):
            state["tfdist_gpus"] = list(self._tfdist_gpu_indices)
        if self.pid and getattr(self, "_tfdist_core_list", None):
            state["tfdist_cores"] = list(self._tfdist_core_list)
        if self.pid and self._tfdist_cgroup_path is not None:
            state["tfdist_cgroup"] = str(self._tfdist_cgroup_path)
        if self.pid and self._tfdist_mem_limit:
            state["tfdist_memory"] = int(self._tfdist_mem_limit)
        if self.pid:
            started = self._tfdist_server_created
            ident = ProcessId(self.pid, started) if started is not None else ProcessId.of(self.pid)
            if ident is not None:
                state.update(saved_process(ident))
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Adopt a server that outlived a hub restart: its GPUs, cores, cgroup or watchdog come back."""
        super().load_state(state)
        if not self.pid:
            return
        started, boot = state.get("tfdist_started"), state.get("tfdist_boot")
        if not isinstance(started, (int, float)) or not isinstance(boot, str):
            # saved by an older version or by hand: nothing proves the PID is still that server
            self.log.warning(
                "tfdist: %s's saved server pid %s has no start time; not adopted", self.tfdist_owner, self.pid
            )
            self.pid = 0
            return
        if not ProcessId(self.pid, float(started), boot).alive():
            # the server is gone and its PID may now be someone else's process: never adopt (or signal) it
            self.log.warning(
                "tfdist: %s's saved server pid %s is not that server any more", self.tfdist_owner, self.pid
            )
            self.pid = 0
            return
        # even for a server that died meanwhile: release (clear_state) then ends what is left in the cgroup
        self._tfdist_cgroup_path = self._tfdist_saved_cgroup(state.get("tfdist_cgroup"))
        if not psutil.pid_exists(self.pid):
            return
        owner = self.tfdist_owner
        gpus = [i for i in state.get("tfdist_gpus") or [] if _saved_device(i)]
        self._tfdist_gpu_indices = self.tfdist_allocator().adopt(owner, gpus, self.log)
        cores = [int(c) for c in state.get("tfdist_cores") or [] if isinstance(c, int)]
        self.tfdist_cores().adopt(owner, cores)
        self._tfdist_core_list = cores
        mem = state.get("tfdist_memory")
        if not isinstance(mem, int) and self.tfdist_choice is not None:
            mem = self.tfdist_choice.memory_bytes
        self._tfdist_mem_limit = mem if isinstance(mem, int) and mem > 0 else None
        self._tfdist_tree = {}
        self._tfdist_server_created = None
        self._tfdist_record_tree()
        if self._tfdist_cgroup_path is None and self.memory_check_interval > 0:
            if self._tfdist_mem_limit:
                self._start_watchdog(self._tfdist_mem_limit)
            else:
                self.log.warning("tfdist: no memory limit known for adopted server %s; no watchdog", owner)
        self.log.info(
            "Adopted %s: GPUs %s, cores %s, %s",
            owner,
            self._tfdist_gpu_indices or "none",
            cores,
            f"cgroup {self._tfdist_cgroup_path}" if self._tfdist_cgroup_path else "watchdog",
        )

    def _tfdist_saved_cgroup(self, saved: Any) -> Path | None:
        """The cgroup path from saved state, if it is this server's (state is data: never trust a path)."""
        if not isinstance(saved, str) or not saved:
            return None
        path = Path(saved)
        if not path.is_absolute() or ".." in path.parts or path.name != CgroupV2.name_for(self.tfdist_owner):
            self.log.warning("tfdist: ignoring saved cgroup %r of %s", saved, self.tfdist_owner)
            return None
        return path

    def clear_state(self) -> None:
        had_pid = bool(self.pid)
        super().clear_state()
        if had_pid:
            self._tfdist_release()


def _saved_device(v: Any) -> bool:
    """A device key from saved state (data: it goes into CUDA_VISIBLE_DEVICES, so nothing but an index or
    a MIG UUID)."""
    return (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or (
        isinstance(v, str) and re.fullmatch(r"MIG-[0-9A-Za-z-]+(/[0-9]+/[0-9]+)?", v) is not None
    )


def _default_inventory() -> GpuInventory:
    global _nvml
    if _nvml is None:
        _nvml = NvmlInventory()
    return _nvml


_nvml: GpuInventory | None = None
