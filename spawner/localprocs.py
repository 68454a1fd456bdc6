"""The embedded spawner's server processes: the cgroup and cores they start in, the memory watchdog where no
cgroup can be had, signals sent only to the server itself, and every process it leaves behind ended before
its GPUs go to someone else.

Why a module of its own: this is the part that can kill the wrong process; it is kept apart from the form
and the environment so that it can be read alone. `TfdistLocalSpawner` mixes it in.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tornado.ioloop import PeriodicCallback

from tfdist.procid import ProcessId, start_time

from .limits import CgroupV2, enforce_once, kill_recorded, record_tree


class LocalServerProcesses:
    """Process handling of `TfdistLocalSpawner` (a SimpleLocalProcessSpawner with the tfdist traits)."""

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
