"""Why the notebook kernel went away, as far as the job's supervisor can tell.

The supervisor sees the kernel's end only as EOF on its stdin (the lifeline): not the exit status, which
goes to the kernel's own parent. Two pieces of evidence say more: the memory cgroup's count of OOM kills
(the kernel's OOM killer fired as the kernel went: it was the victim unless one of our tasks was), and the
server's memory use sampled a second earlier against its limit (the hub's watchdog kills at the limit).
"""

from __future__ import annotations

import os
from pathlib import Path

from tfdist.job.vocab import Reason
from tfdist.memfit import Budget, GiB, memory_cgroup_dirs

# Memory use (share of the limit) a second before the kernel vanished that makes "out of memory" likely.
NEARLY_FULL = 0.85


def _count(path: Path, key: str = "oom_kill") -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        return None
    return None


def oom_kills(proc_cgroup: str | None = None, root: str = "/sys/fs/cgroup") -> int | None:
    """OOM kills in this process's memory cgroup and below: v2's memory.events counts the subtree, v1's
    memory.oom_control each cgroup's own (a kernel moved into a child cgroup is counted there)."""
    for version, d in memory_cgroup_dirs(proc_cgroup, root):
        n = _count(d / ("memory.events" if version == 2 else "memory.oom_control"))
        if n is not None and version == 1:
            return sum(_count(Path(sub) / "memory.oom_control") or 0 for sub, _, _ in os.walk(d))
        if n is not None:
            return n
    return None


def kernel_gone(
    oom_before: int | None, oom_after: int | None, task_deaths: int, last: Budget | None
) -> tuple[Reason, str]:
    """The reason and the sentence for a job whose kernel went away.

    `task_deaths` counts our tasks that died before (each may have been an OOM kill of its own), `last`
    is the server's memory as last sampled.
    """
    limit = f" (its limit is {last.limit / GiB:.1f} GiB)" if last else ""
    if oom_before is not None and oom_after is not None and oom_after - oom_before > task_deaths:
        return Reason.KERNEL_OOM, Reason.KERNEL_OOM.sentence() + limit
    if last is not None and last.limit > 0 and last.used >= NEARLY_FULL * last.limit:
        return (
            Reason.KERNEL_GONE_MEMORY,
            f"{Reason.KERNEL_GONE_MEMORY.sentence()[:-1]}: {last.used / GiB:.2f} of the server's "
            f"{last.limit / GiB:.2f} GiB were in use a second before)",
        )
    return Reason.KERNEL_GONE, Reason.KERNEL_GONE.sentence()
