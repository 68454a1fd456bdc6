"""What is known about one job, rebuilt from its event stream.

The supervisor keeps one to answer late subscribers with a snapshot; the cell's monitor, `%tfdist status`
and the lab panel fold the same events into their own copy. A pure reducer: no I/O, easy to test.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import events
from .events import Event, LogEvent, MetricsEvent, ProgressEvent, SnapshotEvent, StateEvent, TaskEvent
from .job.vocab import (
    LIVE_TASK_STATES,
    SENTENCES,
    STARTED_TASK_STATES,
    TERMINAL,
    FailureKind,
    JobState,
    Reason,
    TaskState,
)
from .jobrecords import JobSummary

__all__ = ["LIVE_TASK_STATES", "SENTENCES", "TERMINAL", "JobView", "Reason", "final_task_state", "reason_for"]

METRICS_KEEP = 600  # ten minutes at 1 Hz
LOG_KEEP = 400


def reason_for(state: str, error: dict[str, Any] | None = None, stop: Reason | None = None) -> Reason:
    """The reason of a terminal state when the event did not name one."""
    if state == JobState.SUCCEEDED:
        return Reason.FINISHED
    if state == JobState.STOPPED:
        return stop or Reason.STOPPED
    err = error or {}
    named = Reason.parse(err.get("reason"))
    if named is not None:
        return named
    kind = FailureKind.parse(err.get("type"))
    if kind is not None and kind.reason is not None:
        return kind.reason
    return Reason.CELL_ERROR if err.get("traceback") else Reason.LOST


def final_task_state(job_state: str, task_state: str) -> str:
    """What a task that was still live is once its job has ended: never "running" in a finished job."""
    if task_state not in LIVE_TASK_STATES:
        return task_state
    if task_state == TaskState.PENDING:
        return TaskState.NOT_STARTED.value
    return (TaskState.EXITED if job_state == JobState.SUCCEEDED else TaskState.STOPPED).value


@dataclass
class JobView:
    name: str = ""
    user: str = ""
    backend: str = "local"
    state: str = "pending"  # pending -> starting -> running -> succeeded | failed | stopped
    message: str = ""
    reason: str = ""  # a Reason value once the job has ended
    created: float = field(default_factory=time.time)
    ended: float | None = None
    total_tasks: int = 0
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {state, restarts, gpus}
    phase: str = ""
    epoch: int = 0
    epochs: int | None = None
    step: int = 0  # training steps done in the current fit (the coordinator's heartbeat)
    epoch_logs: list[dict[str, Any]] = field(default_factory=list)  # one dict per finished epoch (+ "t")
    metrics: collections.deque = field(default_factory=lambda: collections.deque(maxlen=METRICS_KEEP))
    logs: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LOG_KEEP))
    error: dict[str, Any] | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    dropped: int = 0  # malformed events ignored (JobView.apply)

    @property
    def started_tasks(self) -> int:
        return sum(1 for t in self.tasks.values() if t.get("state") in STARTED_TASK_STATES)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def apply(self, ev: Event | Mapping[str, Any]) -> bool:
        """Fold one event in; False when it was malformed and dropped.

        Takes a record or its wire dict. The dict form is parsed here, at the one place every stream
        meets (the local supervisor's socket, the Kubernetes pods and the agent relaying the coordinator,
        through the backends' `watch()` and the kernel's portal), so no source can feed this reducer
        anything unchecked, and a bad event costs neither the monitor nor the job: it is dropped, said
        once in the log tail and counted in `dropped`.
        """
        if not isinstance(ev, events.EVENT_TYPES):
            try:
                ev = events.parse(ev)
            except events.EventError as exc:
                self._drop(exc)
                return False
        if isinstance(ev, SnapshotEvent):
            dropped = self.dropped
            self.__dict__.update(JobView.from_dict(ev.view).__dict__)
            self.dropped = max(dropped, self.dropped)
        elif isinstance(ev, StateEvent):
            self._apply_state(ev)
        elif isinstance(ev, TaskEvent):
            rec = self.tasks.setdefault(str(ev.task), {"state": "pending", "restarts": 0, "gpus": []})
            rec["state"] = ev.state
            for k in ("restarts", "exit_code", "pid"):
                if getattr(ev, k) is not None:
                    rec[k] = getattr(ev, k)
            if ev.gpus is not None:
                rec["gpus"] = list(ev.gpus)
            if self.finished:
                rec["state"] = final_task_state(self.state, rec.get("state", ""))
        elif isinstance(ev, ProgressEvent):
            if ev.phase is not None:
                self.phase = ev.phase
            if ev.epochs is not None:
                self.epochs = ev.epochs
            if ev.epoch is not None:
                self.epoch = ev.epoch
            if ev.step is not None:
                self.step = ev.step
            if ev.logs is not None:
                self.epoch_logs.append({**ev.logs, "epoch": ev.epoch, "t": ev.t})
        elif isinstance(ev, MetricsEvent):
            self.metrics.append({"t": ev.t, "tasks": ev.tasks})
        elif isinstance(ev, LogEvent):
            self.logs.extend(ev.lines)
        return True

    def _apply_state(self, ev: StateEvent) -> None:
        if self.finished and ev.state not in TERMINAL:
            return  # a late event of a live state cannot revive a finished job
        self.state = ev.state
        if ev.message is not None:
            self.message = ev.message
        if ev.error is not None:
            self.error = ev.error.model_dump(mode="json")
        if self.finished:
            if self.ended is None:
                self.ended = ev.t if ev.t is not None else time.time()
            self.reason = (Reason.parse(ev.reason) or reason_for(self.state, self.error)).value
            if not self.message:
                self.message = Reason(self.reason).sentence()
            self._finalize_tasks()

    def _drop(self, exc: events.EventError) -> None:
        """A malformed event: said once in the log tail (the monitor shows it), then only counted."""
        self.dropped += 1
        if self.dropped == 1:
            self.logs.append(("tfdist", f"tfdist: ignored a malformed event ({exc}); later ones are counted"))

    def _finalize_tasks(self) -> None:
        for rec in self.tasks.values():
            rec["state"] = final_task_state(self.state, rec.get("state", ""))

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["metrics"] = list(self.metrics)
        d["logs"] = [list(x) for x in self.logs]
        return d

    def summary(self) -> dict[str, Any]:
        """The small form for lists (the lab panel, `%tfdist list`)."""
        last = self.metrics[-1]["tasks"] if self.metrics else {}
        gpu_util = [
            g["util (%)"] for t in last.values() for g in t.get("gpus", []) if g.get("util (%)") is not None
        ]
        return JobSummary(
            name=self.name,
            user=self.user,
            backend=self.backend,
            state=self.state,
            message=self.message,
            reason=self.reason,
            created=self.created,
            ended=self.ended,
            tasks_started=self.started_tasks,
            tasks_total=self.total_tasks,
            epoch=self.epoch,
            epochs=self.epochs,
            step=self.step,
            gpu_util=gpu_util,
            cpu_total=sum((t.get("cpu (%)") or 0.0) for t in last.values()),
        ).model_dump(exclude_unset=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobView:
        v = cls()
        for k, val in d.items():
            if k == "metrics":
                v.metrics.extend(val)
            elif k == "logs":
                v.logs.extend(tuple(x) for x in val)
            elif k in v.__dict__:
                setattr(v, k, val)
        return v
