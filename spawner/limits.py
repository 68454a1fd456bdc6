"""Memory (and CPU time) limits for embedded-mode servers: a cgroup v2 child where we may write one,
otherwise a documented fallback.

cgroup v2 (preferred): each server gets ``<parent>/tfdist-<owner>`` with ``memory.max`` (and
``memory.swap.max`` 0, so the limit is not escaped into swap) and ``cpu.max`` from the CPU choice; the server
process joins it before exec, so kernels it starts inherit it and the kernel OOM killer enforces the limit.
The parent is ``TfdistLocalSpawner.cgroup_parent`` when set (e.g. a systemd unit with ``Delegate=yes``), else
the hub's own cgroup when it is delegated (systemd Delegate=yes, or a container's own cgroup namespace).
Because cgroup v2 forbids processes in a cgroup that hands controllers to children
("no internal processes"), the hub first moves the processes of its own cgroup into a ``tfdist-hub`` leaf, as
container init systems do.

Fallback (cgroup v1 hosts, read-only /sys/fs/cgroup, no delegation): a watchdog in the hub sums the resident
memory of each server's process tree every few seconds and, above the limit, kills the largest process
of the tree that is not the server itself (normally the kernel that grew), else the server. It is coarser
than the kernel's OOM killer (a fast allocation can overshoot between checks), and the hub log says so.
Each check also records the server's process tree (pids with their start times, `record_tree`): kernels
run in sessions of their own and outlive a server that dies, so once the server is found gone the hub ends
the recorded processes still running (`kill_recorded`) before its GPUs go to the next user. What starts and
detaches between two checks is not seen; a cgroup (cgroup.kill) has no such gap.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from tfdist.procid import start_time

__all__ = [
    "CgroupV2",
    "cgroup2_mount",
    "find_cgroup_parent",
    "kill_recorded",
    "own_cgroup_path",
    "pick_victim",
    "record_tree",
    "tree_rss",
]

log = logging.getLogger(__name__)
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]")


def cgroup2_mount(mounts_text: str) -> str | None:
    """The cgroup2 mount point from /proc/self/mounts text (None on a cgroup v1-only host)."""
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return parts[1]
    return None


def own_cgroup_path(proc_cgroup_text: str) -> str | None:
    """The unified-hierarchy path of this process from /proc/self/cgroup (the ``0::`` line)."""
    for line in proc_cgroup_text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def _delegated(cgroup: Path, own: str | None) -> bool:
    """May the hub reorganise this cgroup? Yes in a container's own cgroup namespace (it sees itself at
    "/"), or when systemd marked it delegated (Delegate=yes sets the trusted.delegate/user.delegate xattr).
    Never a login session's scope, whose other processes the hub would otherwise move."""
    if own == "/":
        return True
    for attr in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError, AttributeError):
            if os.getxattr(cgroup, attr) == b"1":
                return True
    return False


def _read(p: Path) -> str:
    return p.read_text().strip()


def _enable_controllers(parent: Path, wanted: Iterable[str]) -> set[str]:
    """Enable controllers for the children of `parent`; returns those now enabled there."""
    available = set(_read(parent / "cgroup.controllers").split())
    for c in wanted:
        if c in available and c not in _read(parent / "cgroup.subtree_control").split():
            (parent / "cgroup.subtree_control").write_text(f"+{c}")
    return set(_read(parent / "cgroup.subtree_control").split())


def find_cgroup_parent(
    configured: str | None,
    *,
    mounts_text: str | None = None,
    proc_cgroup_text: str | None = None,
    move_hub: bool = True,
) -> tuple[CgroupV2 | None, str]:
    """A usable cgroup v2 parent and why, or (None, reason) for the fallback."""
    try:
        own = None
        if configured:
            parent = Path(configured)
        else:
            mounts = mounts_text if mounts_text is not None else Path("/proc/self/mounts").read_text()
            mount = cgroup2_mount(mounts)
            if mount is None:
                return None, "no cgroup v2 hierarchy is mounted (cgroup v1 host)"
            procs = (
                proc_cgroup_text if proc_cgroup_text is not None else Path("/proc/self/cgroup").read_text()
            )
            own = own_cgroup_path(procs)
            if own is None:
                return None, "this process is not in the cgroup v2 hierarchy"
            parent = Path(mount) / own.lstrip("/")
        if not (parent / "cgroup.controllers").exists():
            return None, f"{parent} is not a cgroup v2 directory"
        if "memory" not in _read(parent / "cgroup.controllers").split():
            return None, f"the memory controller is not delegated to {parent}"
        try:
            enabled = _enable_controllers(parent, ("memory", "cpu"))
        except OSError as e:
            if e.errno != errno.EBUSY or not move_hub:
                raise
            if not configured and not _delegated(parent, own):
                return None, (
                    f"{parent} is not delegated to the hub (run it in a unit with Delegate=yes, "
                    "or set TfdistLocalSpawner.cgroup_parent)"
                )
            # "no internal processes": move everything in `parent` into a leaf, then enable.
            leaf = parent / "tfdist-hub"
            leaf.mkdir(exist_ok=True)
            for pid in _read(parent / "cgroup.procs").split():
                with contextlib.suppress(ProcessLookupError, OSError):
                    (leaf / "cgroup.procs").write_text(pid)
            enabled = _enable_controllers(parent, ("memory", "cpu"))
        if "memory" not in enabled:
            return None, f"could not enable the memory controller below {parent}"
        return CgroupV2(parent, cpu="cpu" in enabled), f"cgroup v2 below {parent}"
    except OSError as e:
        return None, f"cgroup v2 is not writable here ({e.strerror or e})"


@dataclass
class CgroupV2:
    """Creates, fills and removes one child cgroup per server below `parent`."""

    parent: Path
    cpu: bool = True

    @staticmethod
    def name_for(owner: str) -> str:
        # readable, and one-to-one (the hash): "a+b/" and "a_b/" must not share a cgroup
        digest = hashlib.sha256(owner.encode()).hexdigest()[:12]
        return f"tfdist-{_NAME_BAD.sub('_', owner)[:40]}-{digest}"

    def path_for(self, owner: str) -> Path:
        return self.parent / self.name_for(owner)

    def create(self, owner: str, memory_bytes: int, cpu: float | None) -> Path:
        path = self.path_for(owner)
        path.mkdir(exist_ok=True)
        try:
            (path / "memory.max").write_text(str(int(memory_bytes)))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
            if self.cpu and cpu and (path / "cpu.max").exists():
                period = 100_000
                (path / "cpu.max").write_text(f"{max(1000, round(cpu * period))} {period}")
        except OSError:
            # a cgroup without its limit must not be left behind (the caller never learns its path)
            with contextlib.suppress(OSError):
                path.rmdir()
            raise
        return path

    @staticmethod
    def join_fn(path: Path) -> Callable[[], None]:
        """For preexec_fn: move the child into the cgroup before exec (one write, nothing else)."""
        procs = str(path / "cgroup.procs")

        def join() -> None:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

        return join

    def remove(self, owner: str) -> None:
        self.remove_path(self.path_for(owner))

    @staticmethod
    def remove_path(path: Path) -> None:
        """Kill whatever still runs in the cgroup at `path` and below it (cgroup.kill), then remove it and
        its children, deepest first, once the kernel says they are empty: the kill is asynchronous, and a
        cgroup with a process left in it cannot be removed. Called from the hub's event loop, so it waits
        KILL_WAIT_S at most; a process slower to die (a CUDA context) is waited for in a thread."""
        if not path.exists():
            return
        kill = path / "cgroup.kill"
        with contextlib.suppress(OSError):
            if kill.exists():
                kill.write_text("1")
        if _emptied(path, KILL_WAIT_S, 0.01):
            _rmdir_tree(path)
            return
        threading.Thread(
            target=_remove_when_empty, args=(path,), name="tfdist-cgroup-rm", daemon=True
        ).start()


KILL_WAIT_S = 0.25  # how long remove_path blocks for cgroup.kill's victims to be gone
SLOW_KILL_WAIT_S = 60.0  # then how long a thread waits for them before it says the cgroup leaks


def _rmdir_tree(path: Path) -> None:
    """rmdir a cgroup and the cgroups below it, deepest first (their files go with each directory)."""
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("tfdist: cgroup %s not removed: %s", path, exc.strerror)


def _remove_when_empty(path: Path) -> None:
    if not _emptied(path, SLOW_KILL_WAIT_S, 0.1):
        log.warning("tfdist: processes in cgroup %s outlived cgroup.kill for %.0f s", path, SLOW_KILL_WAIT_S)
        return
    _rmdir_tree(path)


def _emptied(path: Path, seconds: float, every: float) -> bool:
    """Whether the cgroup is (or within `seconds` becomes) empty of processes."""
    deadline = time.monotonic() + seconds
    while _populated(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)
    return True


def _populated(path: Path) -> bool:
    """cgroup.events' `populated`: a process is left in the cgroup or below it (False when unreadable)."""
    try:
        return "populated 1" in (path / "cgroup.events").read_text()
    except OSError:
        return False


def tree_rss(pid: int) -> list[tuple[int, int]]:
    """(pid, resident bytes) for a process and all its descendants; empty if it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            out.append((p.pid, p.memory_info().rss))
    return out


def record_tree(
    server_pid: int, seen: dict[int, float], server_created: float | None = None
) -> dict[int, float]:
    """Add the server's live process tree to `seen` ({pid: start time since boot}); returns `seen`.

    For the fallback (no cgroup): kernels run in sessions of their own and are re-parented when the server
    dies, so the tree must be known *before* it dies to end what it leaves behind (see `kill_recorded`).
    Entries whose process is gone (or whose pid now names another process) are dropped, so the record stays
    small. With `server_created`, nothing is added when `server_pid` now names another process.
    """
    for pid, created in list(seen.items()):
        if not _same_process(pid, created):
            del seen[pid]
    try:
        if server_created is not None and start_time(server_pid) != server_created:
            return seen
        root = psutil.Process(server_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return seen
    for p in procs:
        started = start_time(p.pid)
        if started is not None:
            seen[p.pid] = started
    return seen


def _same_process(pid: int, created: float) -> bool:
    return start_time(pid) == created


def kill_recorded(seen: dict[int, float], wait: float = 1.0) -> list[int]:
    """SIGKILL each recorded process that still runs (same pid *and* start time); returns their pids.

    Waits up to `wait` seconds for them to be gone, so GPUs they held are free before they are handed on.
    """
    killed: list[tuple[psutil.Process, bool]] = []
    for pid, created in seen.items():
        if pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if not _same_process(pid, created):
                continue
            ours = p.ppid() == os.getpid()  # the hub's own child: its Popen reaps it, not us
            p.kill()
            killed.append((p, ours))
    others = [p for p, ours in killed if not ours]
    if others and wait > 0:
        with contextlib.suppress(psutil.Error):
            psutil.wait_procs(others, timeout=wait)
    return [p.pid for p, _ in killed]


def pick_victim(
    tree: list[tuple[int, int]], server_pid: int, limit_bytes: int, expendable: Iterable[int] = ()
) -> int | None:
    """Fallback policy: over the limit, the largest expendable process (a %%tfdist task, which marks
    itself with a positive oom_score_adj as the kernel's OOM killer would see it), else the largest
    non-server process of the tree, else the server. A job's task goes before the kernel that holds
    the user's work."""
    if sum(rss for _, rss in tree) <= limit_bytes:
        return None
    spare = set(expendable)
    marked = [(rss, pid) for pid, rss in tree if pid in spare and pid != server_pid]
    if marked:
        return max(marked)[1]
    others = [(rss, pid) for pid, rss in tree if pid != server_pid]
    if others:
        return max(others)[1]
    return server_pid


def oom_score_adj(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/oom_score_adj") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def enforce_once(
    server_pid: int, limit_bytes: int, logger: logging.Logger | logging.LoggerAdapter = log
) -> int | None:
    """One watchdog pass; returns the pid it killed, if any."""
    tree = tree_rss(server_pid)
    if sum(rss for _, rss in tree) <= limit_bytes:
        return None
    victim = pick_victim(tree, server_pid, limit_bytes, [pid for pid, _ in tree if oom_score_adj(pid) > 0])
    if victim is None:
        return None
    used = sum(rss for _, rss in tree)
    logger.warning(
        "tfdist memory watchdog: server pid %s uses %.0f MiB > limit %.0f MiB; killing pid %s",
        server_pid,
        used / 2**20,
        limit_bytes / 2**20,
        victim,
    )
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(victim, signal.SIGKILL)
    return victim
