"""The stall watchdog of a running `%%tfdist` cell.

`--timeout` covers start-up only; once training runs, a job that deadlocks (too few threads, a lost
connection TensorFlow keeps retrying) would wait forever. Progress is any change of phase, epoch or step
(the coordinator's heartbeat); without one for `limit_s`, the cell says once that the job looks stuck,
with each task's CPU (near 0% everywhere: waiting for something that will not come) and how to stop it.
The job is not ended: a long evaluation or a loop that reports nothing may be fine. Once the cell's code
is done ("returning": the coordinator writes the results back) there is no training left to stall, so a
slow write-back under load is not called stuck.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..jobview import JobView

NOT_TRAINING = {"returning"}  # coordinator phases after the cell's code ended


def _duration(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 120 else f"{s:.0f} s"


def cpu_line(view: JobView) -> str:
    last = view.metrics[-1]["tasks"] if view.metrics else {}
    parts = []
    for task in sorted(last):
        cpu = last[task].get("cpu (%)") if isinstance(last[task], dict) else None
        parts.append(f"{task} {cpu:.0f}%" if isinstance(cpu, (int, float)) else f"{task} -")
    return ", ".join(parts) or "no samples yet"


class StallWatch:
    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit_s = limit_s
        self.clock = clock
        self._mark: Any = None
        self._since = clock()
        self.stalled = False

    def check(self, view: JobView) -> str | None:
        """A message when the job starts to look stuck or moves again, else None."""
        now = self.clock()
        mark = (view.state, view.phase, view.epoch, view.step, len(view.epoch_logs))
        if mark != self._mark:
            self._mark, self._since = mark, now
            if self.stalled:
                self.stalled = False
                return f"tfdist: job {view.name} is making progress again"
            return None
        if (
            self.stalled
            or view.state != "running"
            or view.phase in NOT_TRAINING
            or now - self._since < self.limit_s
        ):
            return None
        self.stalled = True
        where = f"{view.phase or 'running'}, epoch {view.epoch}/{view.epochs or '?'}, step {view.step}"
        return (
            f"tfdist: job {view.name} looks stuck: no training progress for {_duration(now - self._since)} "
            f"(at {where}). CPU now: {cpu_line(view)}. If every task stays near 0%, it is waiting for "
            "something that will not come: interrupt the kernel (the stop button) to end the job and all "
            "its processes, or use Stop in the Distributed jobs panel. "
            f"(--stall-timeout {self.limit_s:g} sets when this warning comes; the job goes on.)"
        )
