"""A job's events as small typed records and their wire codec: the one module of the job protocol's
messages, shared by every producer (the supervisor, the coordinator, the pod runtime, the Kubernetes state
derivation, the queue watcher) and the one consumer that folds them (`tfdist.job.view.JobView`, read by
the cell's monitor, `%tfdist list/status` and the lab panel).

On the wire an event stays what it always was: one JSON object with a "type" key on one line, so pods of
an older image and the coordinator agent, which relays lines it does not read, keep working. `encode(ev)`
writes that line (`to_wire(ev)` the object, `dumps` any object); `decode(line)` and `parse(obj)` are the
way back and the only one: events cross process and network boundaries (a pod may be broken or hostile),
so they refuse anything malformed with one `EventError` (missing or mistyped fields, an unknown type, NaN
or infinite numbers, strings or lists beyond generous bounds) instead of letting a KeyError reach the
kernel. Unknown extra keys are ignored: a newer producer may say more than this reader knows.

The bounded field types and the typed dicts the records share with the view (samples, task and error
records) are `tfdist.job.shapes`. Job images run `tfdist.events` and `tfdist.runtime.events`: both stay,
as re-exports of this module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    ValidationError,
    model_serializer,
)

from .shapes import (
    GPUS_MAX,
    KEYS_MAX,
    LINE_MAX,
    LINES_MAX,
    TASKS_MAX,
    TRACEBACK_MAX,
    Count,
    Line,
    Name,
    Num,
    Task,
    TaskName,
    TaskSample,
    Text,
    Time,
)
from .vocab import JobState

JOB_STATES = tuple(s.value for s in JobState)

_STRICT = ConfigDict(frozen=True, allow_inf_nan=False, extra="ignore")


class EventError(ValueError):
    """An event that cannot be read: what was wrong, in one line (never the offending value itself)."""


class _Record(BaseModel):
    """A record whose unset (None) fields are left off the wire, as the dict producers always did. Read
    by attribute (`ev.state`); the wire form is `to_wire(ev)`, written once where it leaves the process."""

    model_config = _STRICT

    @model_serializer(mode="wrap")
    def _without_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ErrorInfo(_Record):
    """Why a job failed: the error type, its message and the cell's traceback (`Reason` when known)."""

    type: Name = ""
    message: Text = ""
    traceback: Annotated[str, StringConstraints(strict=True, max_length=TRACEBACK_MAX)] = ""
    reason: Name | None = None


class StateEvent(_Record):
    """The job's state changed; a terminal one carries its `reason` (a `jobview.Reason` value) and error."""

    type: Literal["state"] = "state"
    state: JobState
    message: Text | None = None  # None: keep the message shown so far
    t: Time | None = None
    reason: Name | None = None
    error: ErrorInfo | None = None


class TaskEvent(_Record):
    """One task's state (pending, starting, running, restarting, exited-ok, failed, ...)."""

    type: Literal["task"] = "task"
    task: Task
    state: Name
    pid: Count | None = None
    restarts: Count | None = None
    gpus: Annotated[tuple[Name, ...], Field(max_length=GPUS_MAX)] | None = None
    exit_code: StrictInt | None = None
    node: Name | None = None  # the Kubernetes node of the task's pod


class ProgressEvent(_Record):
    """The coordinator's progress: a phase, the fit's epoch and step, and a finished epoch's logs."""

    type: Literal["progress"] = "progress"
    phase: Name | None = None
    epoch: Count | None = None
    epochs: Count | None = None
    step: Count | None = None
    steps: Count | None = None
    logs: Annotated[dict[Name, Num | None], Field(max_length=KEYS_MAX)] | None = None
    t: Time | None = None


class MetricsEvent(_Record):
    """One sample of every task's CPU, memory and GPUs."""

    type: Literal["metrics"] = "metrics"
    t: Time
    tasks: Annotated[dict[TaskName, TaskSample], Field(max_length=TASKS_MAX)]


class LogEvent(_Record):
    """Log lines, each (task, line); the task may also be "tfdist" (tfdist's own words)."""

    type: Literal["log"] = "log"
    lines: Annotated[tuple[tuple[Name, Line], ...], Field(max_length=LINES_MAX)]


class QueueInfo(BaseModel):
    """Where a job waits in the cluster's queue (Kueue) before it is admitted: its place in line (1 is
    next) and, when the queue says, which queue, how many workloads are ahead and the estimated wait."""

    model_config = _STRICT  # a plain model (unset fields are null): its JSON Schema is the panel's type

    position: Annotated[StrictInt, Field(ge=1)]
    queue: Name | None = None  # the LocalQueue (or ClusterQueue) it waits in
    ahead: Count | None = None  # workloads admitted before it (a cohort may count more than position-1)
    wait_s: Annotated[float, Field(ge=0)] | None = None  # estimated seconds until it is admitted
    # what `position` counts: "queue", every job of the queue (Kueue's visibility API); "own", only the
    # user's own, where the cluster does not serve that API (other users' jobs may be ahead)
    scope: Literal["queue", "own"] | None = None

    def sentence(self) -> str:
        """What the cell, `%tfdist list` and the panel say: "queued: 3rd in team-a, about 20 min"; where
        only the user's own jobs could be counted, "queued: 1st of your jobs in team-a (...)"."""
        where = f" in {self.queue}" if self.queue else " in line"
        wait = f", about {_duration(self.wait_s)}" if self.wait_s is not None else ""
        if self.scope == "own":
            return (
                f"queued: {_ordinal(self.position)} of your jobs{where}{wait} (other users' jobs in the "
                "queue are not visible to you: Kueue's visibility API does not answer)"
            )
        return f"queued: {_ordinal(self.position)}{where}{wait}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return "1 min"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"{minutes} min"
    return f"{round(seconds / 1800) / 2:g} h"


class QueueEvent(QueueInfo):
    """The job's place in the cluster's queue changed (tfdist.kube.queueing watches Kueue's workloads).
    Folded into `view.queue` while the job waits; the job's admission (a `starting` or later state)
    clears it."""

    type: Literal["queue"] = "queue"

    def info(self) -> QueueInfo:
        return QueueInfo.model_validate(self.model_dump(exclude={"type"}))


def _view(value: dict[str, Any]) -> dict[str, Any]:
    """A snapshot's view checked against `JobView`'s own fields (the one definition of its shape), then
    kept as sent: the snapshot is `JobView.to_dict()`."""
    from .view import check_view

    check_view(value)
    return value


class SnapshotEvent(_Record):
    """A whole `JobView` (its `to_dict()`): what a late subscriber starts from."""

    type: Literal["snapshot"] = "snapshot"
    view: Annotated[dict[str, Any], AfterValidator(_view)]


Event = StateEvent | TaskEvent | ProgressEvent | MetricsEvent | LogEvent | SnapshotEvent | QueueEvent
EVENT_TYPES = (StateEvent, TaskEvent, ProgressEvent, MetricsEvent, LogEvent, SnapshotEvent, QueueEvent)
_BY_TYPE: dict[str, type[BaseModel]] = {cls.model_fields["type"].default: cls for cls in EVENT_TYPES}


def error_info(error: dict[str, Any] | None) -> ErrorInfo | None:
    """A job's error (error.json, written by the user's cell) as a record; one that cannot be one (broken,
    too long) is cut down to one that can, so it still ends the job with what it said."""
    if not error:
        return None
    try:
        return ErrorInfo.model_validate(error)
    except ValueError:
        text = {k: str(error.get(k) or "")[:65536] for k in ("type", "message", "traceback")}
        return ErrorInfo(
            type=text["type"][:200] or "Error", message=text["message"], traceback=text["traceback"]
        )


def to_wire(ev: Event) -> dict[str, Any]:
    """The event as its JSON object (what `dumps` writes)."""
    return ev.model_dump(mode="json", by_alias=True)


def encode(ev: Event) -> bytes:
    """The event as its wire line."""
    return dumps(to_wire(ev))


def decode(line: bytes | str) -> Event:
    """The record of one wire line; `EventError` when it is not JSON or not an event."""
    try:
        data = loads(line)
    except ValueError as exc:  # JSONDecodeError, bad UTF-8
        raise EventError(f"an event line is not JSON ({str(exc)[:120]})") from None
    return parse(data)


class Reader:
    """One untrusted stream's events as records (a job's socket, its agent's relay): a malformed event is
    dropped and the first of them said in the job's log, so neither the stream nor the cell breaks."""

    def __init__(self, source: str) -> None:
        self.source = source  # "the job's supervisor", "the job's agent": where the bad event came from
        self.dropped = 0

    def line(self, line: bytes | str) -> list[Event]:
        """The events of one wire line: its record, or at most one log record saying it was dropped."""
        try:
            return [decode(line)]
        except EventError as exc:
            return self._drop(exc)

    def obj(self, data: Any) -> list[Event]:
        """As `line`, for an already decoded JSON object."""
        try:
            return [parse(data)]
        except EventError as exc:
            return self._drop(exc)

    def _drop(self, exc: EventError) -> list[Event]:
        self.dropped += 1
        if self.dropped > 1:
            return []
        why = f"tfdist: ignored a malformed event from {self.source} ({exc}); later ones are dropped silently"
        return [LogEvent(lines=(("tfdist", why[:LINE_MAX]),))]


def dumps(obj: Mapping[str, Any]) -> bytes:
    """Any JSON object as one wire line (events, and the control requests beside them). Numpy numbers
    become plain ones, NaN and infinities refused."""
    return (json.dumps(obj, default=_default, allow_nan=False, separators=(",", ":")) + "\n").encode()


def loads(line: bytes | str) -> dict[str, Any]:
    """One wire line as its JSON object (unchecked: `parse` makes an event of it)."""
    return json.loads(line)


def clean_number(x: Any) -> float | None:
    """A finite float, or None (a metric that is NaN, infinite or not a number)."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy scalars
        return clean_number(obj.item())
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def parse(data: Any) -> Event:
    """The record of one wire event (a record passes through); `EventError` when it is malformed."""
    if isinstance(data, EVENT_TYPES):
        return data
    if not isinstance(data, dict):
        raise EventError(f"an event is a JSON object, not {type(data).__name__}")
    kind = data.get("type")
    cls = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if cls is None:
        shown = repr(kind)[:40] if isinstance(kind, str) else type(kind).__name__
        raise EventError(f"unknown event type {shown} (known: {', '.join(_BY_TYPE)})")
    try:
        return cls.model_validate(data)  # type: ignore[return-value]
    except ValidationError as exc:
        raise EventError(f"malformed {kind} event: {_describe(exc)}") from None
    except RecursionError:
        raise EventError(f"malformed {kind} event: nested too deeply") from None


def _describe(exc: ValidationError) -> str:
    """The first few problems, each as `field.path: what is wrong`, bounded (a key may be huge). A number
    tried as int, then float, is one problem: the last word (the float's) is kept."""
    found: dict[str, str] = {}
    for err in exc.errors(include_input=False, include_url=False):
        loc = err["loc"][:-1] if err["loc"][-1:] in (("int",), ("float",)) else err["loc"]
        where = ".".join(str(p) if len(str(p)) <= 40 else f"<{len(str(p))} characters>" for p in loc)
        found[where or "event"] = err["msg"][:160]
    parts = [f"{where}: {msg}" for where, msg in list(found.items())[:3]]
    more = len(found) - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
