"""Will a job fit in this server's memory? Estimated before anything starts, guarded while it runs.

Why: a notebook server has a memory limit (the hub's cgroup or watchdog, a pod's limit) that covers the
kernel *and* every local task process of its jobs. Each task imports TensorFlow (~0.4-0.7 GiB), so a
default job of four processes does not fit a 2 GiB server, and whoever is over the limit gets killed: often
the kernel, the largest process. The magic refuses such a job with the numbers; the supervisor stops a job
before the server's limit is reached, and task processes volunteer to be the OOM killer's first choice.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from tfdist.settings import ENV_SERVER_PID

GiB = 2**30
MiB = 2**20

# Peak RSS of one task of the example job on this project's CI machine (TF 2.21 CPU build, digits MLP;
# measured 669 / 681 / 675 MiB), rounded up: the floor used until a job of this user has been measured.
FLOOR_MIB = {"ps": 680.0, "worker": 700.0, "chief": 700.0}
FOOTPRINT_FILE = "footprint.json"
SERVER_PID_ENV = ENV_SERVER_PID  # the notebook server's process, for the supervisor's guard
# The job is stopped when the server's use crosses this share of its limit: the hub's watchdog and the
# kernel's OOM killer act only at the limit, so this leaves room for the kernel to receive the results.
GUARD_SHARE = 0.94
# What a job needs on top of its tasks: the kernel grows when results come back.
MARGIN_BYTES = 128 * MiB


def server_pid() -> int:
    """The notebook server this kernel belongs to: jupyter_client's JPY_PARENT_PID (the server that
    started the kernel, through any wrapper such as `conda run`), else the kernel's parent."""
    env = os.environ.get("JPY_PARENT_PID", "")
    return int(env) if env.isdigit() and int(env) > 1 else os.getppid()


@dataclass(frozen=True)
class Budget:
    """The server's memory: its limit and what its processes (kernel, server, jobs) use now."""

    limit: int
    used: int
    source: str  # "cgroup" or "server processes"

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class Footprint:
    """MiB per task role: measured peaks of this user's last job, else FLOOR_MIB."""

    ps: float = FLOOR_MIB["ps"]
    worker: float = FLOOR_MIB["worker"]
    chief: float = FLOOR_MIB["chief"]
    measured: bool = False

    def of(self, role: str) -> float:
        return float(getattr(self, role))


def job_need(workers: int, ps: int, fp: Footprint) -> int:
    """Bytes the job's processes will hold at their peak (coordinator included)."""
    mib = workers * fp.worker + ps * fp.ps + fp.chief
    return int(mib * MiB)


def refusal(workers: int, ps: int, budget: Budget, fp: Footprint) -> str | None:
    """The one-sentence reason a job cannot start in `budget`, or None when it fits."""
    need = job_need(workers, ps, fp)
    if need + MARGIN_BYTES <= budget.free:
        return None
    tasks = workers + ps + 1
    how = "measured on your last job" if fp.measured else "typical"
    hint = ""
    for w in range(workers - 1, 0, -1):  # the largest job of this shape that would fit
        if job_need(w, 1, fp) + MARGIN_BYTES <= budget.free:
            hint = f"--workers {w} --ps 1 would fit, or "
            break
    return (
        f"this job needs about {need / GiB:.1f} GiB ({tasks} TensorFlow processes: {workers} worker "
        f"x {fp.worker / 1024:.2f} + {ps} PS x {fp.ps / 1024:.2f} + coordinator {fp.chief / 1024:.2f} GiB, "
        f"{how}) but this server has {budget.free / GiB:.1f} GiB free ({budget.used / GiB:.1f} of its "
        f"{budget.limit / GiB:.1f} GiB limit in use by the kernel and server); {hint}"
        "start your server with more memory (File > Hub Control Panel > Stop My Server, then a bigger "
        "profile). Nothing was started."
    )


# ---------------------------------------------------------------------------------------------- I/O


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) is None


def memory_cgroup_dirs(
    proc_cgroup: str | None = None, root: str = "/sys/fs/cgroup"
) -> list[tuple[int, Path]]:
    """Where this process's memory cgroup may be: (version, directory), most specific first.

    Inside a container without a cgroup namespace, /proc/self/cgroup names the host's path while
    /sys/fs/cgroup is mounted at the container's own cgroup: ever shorter tails of the path are tried too.
    """
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return []
    out: list[tuple[int, Path]] = []
    for line in text.splitlines():
        hier, controllers, path = [*line.split(":", 2), "", ""][:3]
        parts = [p for p in path.split("/") if p]
        tails = [Path(*parts[i:]) if parts[i:] else Path() for i in range(len(parts) + 1)]
        if hier == "0" and controllers == "":
            out += [(2, base / t) for base in (Path(root), Path(root) / "unified") for t in tails]
        elif "memory" in controllers.split(","):
            out += [(1, Path(root) / "memory" / t) for t in tails]
    return out


def cgroup_memory(proc_cgroup: str | None = None, root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(limit, current) of this process's memory cgroup when it has a limit (v2, else v1)."""
    for version, d in memory_cgroup_dirs(proc_cgroup, root):
        if version == 2:
            limit, cur = _read_int(d / "memory.max"), _read_int(d / "memory.current")
        else:
            limit, cur = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            if limit is not None and limit >= 2**62:  # v1's "no limit"
                limit = None
        if limit is not None and cur is not None:
            return limit, cur
    return None


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants: what the hub's memory watchdog adds up."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def server_budget(server_pid: int, environ: dict[str, str] | None = None) -> Budget | None:
    """The memory of the notebook server whose process is `server_pid`; None when it has no limit.

    A cgroup limit (the hub's cgroup v2 mode, a pod) counts everything in the cgroup. Otherwise the limit
    the spawner announces in MEM_LIMIT is what the hub's watchdog enforces on the server's process tree.
    """
    env = os.environ if environ is None else environ
    announced = int(env["MEM_LIMIT"]) if env.get("MEM_LIMIT", "").isdigit() else None
    cg = cgroup_memory()
    if cg is not None and (announced is None or cg[0] <= announced * 1.05):
        return Budget(limit=cg[0], used=cg[1], source="cgroup")
    if announced:
        return Budget(limit=announced, used=tree_rss(server_pid), source="server processes")
    return None


def load_footprint(state_dir: str) -> Footprint:
    try:
        with open(os.path.join(state_dir, FOOTPRINT_FILE)) as f:
            data = json.load(f)
        return Footprint(
            **{r: max(float(data[r]), 64.0) for r in ("ps", "worker", "chief") if r in data},
            measured=True,
        )
    except (OSError, ValueError, TypeError):
        return Footprint()


def save_footprint(state_dir: str, peaks_mib: dict[str, float]) -> None:
    """Remember the peaks of a job that trained (every role seen), for the next estimate."""
    if not all(peaks_mib.get(r) for r in ("ps", "worker", "chief")):
        return
    data = {r: round(peaks_mib[r], 1) for r in ("ps", "worker", "chief")}
    tmp = os.path.join(state_dir, FOOTPRINT_FILE + ".tmp")
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, os.path.join(state_dir, FOOTPRINT_FILE))


def footprint_dict(fp: Footprint) -> dict[str, float]:
    return {k: v for k, v in asdict(fp).items() if k != "measured"}
