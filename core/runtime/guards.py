"""What ends a local job from outside its cell: a task over `--memory`, the notebook server's memory nearly
full, and the kernel's lifeline (EOF on the supervisor's stdin).

Why here and not in the supervisor: each guard decides from a sample or an event alone; the supervisor
only hands it what it saw and acts on the verdict (stop the job with its reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from tfdist import memfit, tf_config
from tfdist.job.events import MetricsEvent
from tfdist.job.vocab import FailureKind, Reason
from tfdist.runtime import lifeline
from tfdist.runtime.spawn import PendingLines, Task

# why the job stopped, its code in the shared vocabulary, and the failure record when it was not the cell
Stop = Callable[[str, Reason, "dict[str, str] | None"], None]


class MemoryGuard:
    """Per task: kill one that is over --memory. Per server: stop the job before the server's limit (at the
    limit the kernel may be the one killed). Also remembers each role's peak for the next job's estimate."""

    def __init__(self, limit_bytes: int | None, server_pid: int | None, pending: PendingLines) -> None:
        self.limit = limit_bytes
        self.server_pid = server_pid
        self.pending = pending
        self.last_budget: memfit.Budget | None = None  # the server's memory as last sampled
        self.peaks_mib: dict[str, float] = {}  # per role, remembered for the next job's memory estimate

    def check(self, sample: MetricsEvent, tasks: Mapping[str, Task], stopping: bool, stop: Stop) -> None:
        for name, rec in sample.tasks.items():
            rss = rec.get("rss (MiB)")
            if rss is not None:
                role = tf_config.split_task(name)[0]
                self.peaks_mib[role] = max(self.peaks_mib.get(role, 0.0), float(rss))
        self._guard_server(stopping, stop)
        if not self.limit:
            return
        for name, rec in sample.tasks.items():
            rss = rec.get("rss (MiB)")
            task = tasks.get(name)
            if rss is not None and rss * 2**20 > self.limit and task and task.alive:
                task.killed_for = f"it used {rss:.0f} MiB, over --memory {self.limit / 2**20:.0f} MiB"
                self.pending.add(name, f"tfdist: {name} killed: {task.killed_for}")
                with contextlib.suppress(ProcessLookupError):
                    task.proc.kill()

    def _guard_server(self, stopping: bool, stop: Stop) -> None:
        if self.server_pid is None or stopping:
            return
        budget = self.last_budget = memfit.server_budget(self.server_pid)
        if budget is None or budget.used < budget.limit * memfit.GUARD_SHARE:
            return
        why = (
            f"the notebook server's memory is nearly full ({budget.used / 2**30:.2f} of its "
            f"{budget.limit / 2**30:.2f} GiB limit, kernel and job together): the job was stopped so that "
            "the kernel survives; use fewer tasks or start your server with more memory"
        )
        self.pending.add("tfdist", "tfdist: " + why)
        stop(why, Reason.STOPPED, {"type": FailureKind.OUT_OF_MEMORY.value, "message": why, "traceback": ""})


class Lifeline:
    """Stdin is a pipe from the launching kernel: EOF means the kernel is gone, and the job goes with it."""

    def __init__(self) -> None:
        self.oom_base = lifeline.oom_kills()

    async def watch(self, deaths: Callable[[], int], budget: Callable[[], Any], stop: Stop) -> None:
        """Until EOF; then stop with why the kernel went, as far as `deaths()` (our tasks that died before)
        and the server's memory as last sampled (`budget()`) tell."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        with contextlib.suppress(Exception):
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
            await reader.read()
            code, why = lifeline.kernel_gone(self.oom_base, lifeline.oom_kills(), deaths(), budget())
            stop(why, code, None)
