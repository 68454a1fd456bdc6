"""The embedded spawner's saved state: GPUs, cores, cgroup and memory limit of a server that outlives a hub
restart, written with its process identity so that a reused PID is never adopted or signalled.

Why a module of its own: saved state is data from disk, checked before it is trusted (a path, a device name,
a PID); `TfdistLocalSpawner` mixes it in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psutil

from tfdist.procid import ProcessId

from .limits import CgroupV2


def saved_process(ident: ProcessId) -> dict[str, Any]:
    """The server process as the hub's saved state names it: a PID alone may name another process later."""
    return {"pid": ident.pid, "tfdist_started": ident.started, "tfdist_boot": ident.boot}


class LocalServerState:
    """get_state/load_state/clear_state of `TfdistLocalSpawner`."""

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
            # the server is gone and its PID may now be someone else's process: never adopt (or signal) it.
            # What it left in its cgroup (a detached job runs in a session of its own) ends now: its GPUs
            # are free for the next spawn from here on
            self.log.warning(
                "tfdist: %s's saved server pid %s is not that server any more", self.tfdist_owner, self.pid
            )
            self.pid = 0
            leftover = self._tfdist_saved_cgroup(state.get("tfdist_cgroup"))
            if leftover is not None:
                CgroupV2.remove_path(leftover)
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
