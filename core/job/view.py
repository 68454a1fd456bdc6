"""What is known about one job, rebuilt from its event stream.

The supervisor keeps one to answer late subscribers with a snapshot; the cell's monitor, `%tfdist status`
and the lab panel fold the same events into their own copy. A pure reducer: no I/O, easy to test.

`JobView`'s fields are the one definition of a view: a snapshot is checked against them (`check_view`,
with the bounds of the event records), and a field marked `summary(...)` also becomes a field of the
job's summary (`tfdist.jobrecords.JobSummary`), hence of `%tfdist list`, the lab server's JSON and the
panel's generated TypeScript types, with no other edit.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, Field, TypeAdapter

from . import events
from .events import (
    Event,
    LogEvent,
    MetricsEvent,
    ProgressEvent,
    QueueEvent,
    QueueInfo,
    SnapshotEvent,
    StateEvent,
    TaskEvent,
)
from .shapes import (
    Count,
    EpochLogs,
    ErrorRecord,
    LogLine,
    MetricsSample,
    Name,
    TaskName,
    TaskRecord,
    Text,
    Time,
)
from .vocab import (
    LIVE_TASK_STATES,
    SENTENCES,
    STARTED_TASK_STATES,
    TERMINAL,
    FailureKind,
    JobState,
    Reason,
    TaskState,
)

__all__ = [
    "LIVE_TASK_STATES",
    "SENTENCES",
    "TERMINAL",
    "JobView",
    "Reason",
    "check_view",
    "final_task_state",
    "reason_for",
    "state_word",
    "summary_fields",
]

QUEUED = "queued"  # a word for people, not a state on the wire: the job is pending with a `queue`
PREEMPTED_WAITING = "preempted, waiting to be readmitted"  # pending again after Kueue evicted it
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


def state_word(state: str, queued: bool, reason: str = "") -> str:
    """A job's state for people: "queued" for one not yet admitted by the cluster's queue, "preempted,
    waiting to be readmitted" for one Kueue evicted and the kernel submitted again (reason `preempted`
    while it waits)."""
    if state not in (JobState.PENDING, JobState.STARTING):
        return str(state)
    if reason == Reason.PREEMPTED:
        return PREEMPTED_WAITING
    return QUEUED if queued else str(state)


def final_task_state(job_state: str, task_state: str) -> str:
    """What a task that was still live is once its job has ended: never "running" in a finished job."""
    if task_state not in LIVE_TASK_STATES:
        return task_state
    if task_state == TaskState.PENDING:
        return TaskState.NOT_STARTED.value
    return (TaskState.EXITED if job_state == JobState.SUCCEEDED else TaskState.STOPPED).value


def summary(description: str) -> dict[str, str]:
    """Field metadata: this view field is also a field of the job's summary (`%tfdist list`, the lab
    server's JSON, the panel's TypeScript type), described so in the committed JSON Schema."""
    return {"summary": description}


@dataclass
class JobView:
    """One job as its events made it. Annotated with the bounds a snapshot must keep (`check_view`)."""

    name: Name = ""
    user: Name = ""
    backend: Name = "local"
    state: JobState = JobState.PENDING  # pending -> starting -> running -> succeeded | failed | stopped
    message: Text = ""
    reason: Name = ""  # a Reason value once the job has ended; `preempted` while it waits to be readmitted
    created: Time = field(default_factory=time.time)
    ended: Time | None = None
    total_tasks: Count = 0
    tasks: dict[TaskName, TaskRecord] = field(default_factory=dict)  # name -> {state, restarts, gpus}
    phase: Name = ""
    epoch: Count = 0
    epochs: Count | None = None
    step: Count = 0  # training steps done in the current fit (the coordinator's heartbeat)
    epoch_logs: list[EpochLogs] = field(default_factory=list)  # one dict per finished epoch (+ "t")
    metrics: collections.deque[MetricsSample] = field(
        default_factory=lambda: collections.deque(maxlen=METRICS_KEEP)
    )
    logs: collections.deque[LogLine] = field(default_factory=lambda: collections.deque(maxlen=LOG_KEEP))
    error: ErrorRecord | None = None
    spec: dict[Name, Any] = field(default_factory=dict)
    dropped: Count = 0  # malformed events ignored (JobView.apply)
    queue: QueueInfo | None = field(
        default=None,
        metadata=summary(
            "where the job waits in the cluster's queue (Kueue) until admitted; null once it runs"
        ),
    )

    __pydantic_config__ = ConfigDict(allow_inf_nan=False, extra="ignore")

    @property
    def started_tasks(self) -> int:
        return sum(1 for t in self.tasks.values() if t.get("state") in STARTED_TASK_STATES)

    @property
    def state_word(self) -> str:
        """The state as the cell, `%tfdist list` and the panel name it: "queued" while the cluster's queue
        holds the job (the message then says where and for how long)."""
        return state_word(self.state, self.queue is not None, self.reason)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def apply(self, ev: Event | Mapping[str, Any]) -> bool:
        """Fold one event in; False when it was malformed and dropped.

        Takes a record (what the backends' `watch()` yields: they decode their streams with
        `events.Reader`) or a wire dict (a snapshot handed over, a state file's word). The dict form is
        parsed here, so nothing unchecked reaches this reducer, and a bad event costs neither the
        monitor nor the job: it is dropped, said once in the log tail and counted in `dropped`.
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
            new: TaskRecord = {"state": TaskState.PENDING.value, "restarts": 0, "gpus": []}
            rec = self.tasks.setdefault(str(ev.task), new)
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
        elif isinstance(ev, QueueEvent):
            self._apply_queue(ev)
        return True

    def _apply_queue(self, ev: QueueEvent) -> None:
        """Waiting in the cluster's queue: its place is the job's message until it is admitted."""
        if self.finished or self.state == JobState.RUNNING:
            return  # a late word of the queue about a job that already runs or ended
        self.queue = ev.info()
        self.message = self.queue.sentence()

    def _apply_state(self, ev: StateEvent) -> None:
        if self.finished and ev.state not in TERMINAL:
            return  # a late event of a live state cannot revive a finished job
        self.state = ev.state
        if self.queue is not None and (self.finished or ev.state == JobState.RUNNING):
            self.queue = None  # admitted (or ended while it waited)
        if ev.message is not None:
            self.message = ev.message
        if ev.error is not None:
            self.error = ev.error.model_dump(mode="json")
        if not self.finished:  # preempted and submitted again: said until it runs (state_word)
            if ev.state == JobState.RUNNING:
                self.reason = ""
            elif Reason.parse(ev.reason) == Reason.PREEMPTED:
                self.reason = Reason.PREEMPTED.value
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
        d["queue"] = self.queue.model_dump(mode="json") if self.queue is not None else None
        return d

    def summary(self) -> dict[str, Any]:
        """The small form for lists (the lab panel, `%tfdist list`)."""
        from ..jobrecords import JobSummary

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
            **{k: getattr(self, k) for k in summary_fields() if getattr(self, k) is not None},
        ).model_dump(exclude_unset=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobView:
        v = cls()
        for k, val in d.items():
            if k == "metrics":
                v.metrics.extend(val)
            elif k == "logs":
                v.logs.extend(tuple(x) for x in val)
            elif k == "queue":
                v.queue = QueueInfo.model_validate(val) if val else None
            elif k in v.__dict__:
                setattr(v, k, val)
        return v


@functools.cache
def _view_adapter() -> TypeAdapter[JobView]:
    return TypeAdapter(JobView)


def check_view(value: Any) -> None:
    """Refuse (ValueError) a snapshot's view that does not fit `JobView`'s fields and bounds."""
    _view_adapter().validate_python(value)


@functools.cache
def summary_fields() -> dict[str, tuple[Any, Any]]:
    """The view fields marked `summary(...)`, as pydantic field definitions (annotation, FieldInfo) for
    `tfdist.jobrecords.JobSummary`."""
    hints = typing.get_type_hints(JobView, include_extras=True)
    return {
        f.name: (hints[f.name], Field(None, description=f.metadata["summary"]))
        for f in dataclasses.fields(JobView)
        if "summary" in f.metadata
    }
