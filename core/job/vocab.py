"""The job protocol's words: job states, task states, why a job ended and how it failed, as enums.

Why enums: these were free strings in a dozen modules ("OutOfMemory", "WorkerLost" looked like exception
classes that do not exist, a typo was a silent new state). Each value is exactly the string the wire has
always carried, and every member *is* that string (a `str` subclass), so `TaskState.RUNNING == "running"`,
JSON, f-strings and older readers see no change. Pure: no imports beyond the standard library, because job
images import this module too.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

__all__ = [
    "LIVE_TASK_STATES",
    "SENTENCES",
    "STARTED_TASK_STATES",
    "TERMINAL",
    "FailureKind",
    "JobState",
    "Reason",
    "Strategy",
    "TaskState",
    "WireEnum",
]

_E = TypeVar("_E", bound="WireEnum")


class WireEnum(str, enum.Enum):
    """A string enum whose members print and format as their wire value (enum.StrEnum is 3.11+; job
    images may run 3.10)."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def parse(cls: type[_E], value: Any, default: _E | None = None) -> _E | None:
        """The member named by a wire value, or `default` for anything else (a newer producer's word)."""
        try:
            return cls(value)
        except ValueError:
            return default


class JobState(WireEnum):
    """A job's state: pending -> starting -> running -> succeeded | failed | stopped."""

    PENDING = "pending"  # accepted, nothing started yet (a queued job is pending with a `view.queue`)
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED})


class TaskState(WireEnum):
    """One task's state, as the supervisor and the pods' derivation report it."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    UNSCHEDULABLE = "unschedulable"  # Kubernetes: no node fits (yet)
    IMAGE_ERROR = "image-error"  # Kubernetes: the image cannot be pulled
    TERMINATING = "terminating"  # Kubernetes: the pod is being deleted
    EXITED_OK = "exited-ok"  # the task's process exited 0 (the coordinator finished)
    EXITED = "exited"  # still live when its job succeeded: ended with it
    FAILED = "failed"
    STOPPED = "stopped"  # still live when its job failed or was stopped
    NOT_STARTED = "not started"  # still pending when its job ended


# A task in one of these is alive (or may still become so); a finished job has none of them left.
LIVE_TASK_STATES = frozenset(
    {
        TaskState.PENDING,
        TaskState.STARTING,
        TaskState.RUNNING,
        TaskState.RESTARTING,
        TaskState.UNSCHEDULABLE,
        TaskState.IMAGE_ERROR,
    }
)
# A task in one of these got as far as running (the "tasks started" count).
STARTED_TASK_STATES = frozenset(
    {TaskState.RUNNING, TaskState.RESTARTING, TaskState.EXITED_OK, TaskState.EXITED, TaskState.STOPPED}
)


class Strategy(WireEnum):
    """How a job trains: `ps` is ParameterServerStrategy (a coordinator, workers, parameter servers);
    `allreduce` is MultiWorkerMirroredStrategy (workers only; the first, chief-0, returns the results)."""

    PS = "ps"
    ALLREDUCE = "allreduce"


class Reason(WireEnum):
    """Why a job ended: one vocabulary for the cell's monitor, `%tfdist list/status` and the lab panel.

    Carried as `reason` in the final state event and in state.json; `sentence()` is what users read.
    """

    FINISHED = "finished"
    INTERRUPTED = "interrupted"  # the cell was interrupted (the kernel stopped the job)
    STOPPED = "stopped"  # %tfdist stop, the jobs panel's Stop
    SIGNALLED = "signalled"  # the supervisor got SIGTERM/SIGINT/SIGHUP (the server shutting down)
    KERNEL_GONE = "kernel-gone"
    KERNEL_GONE_MEMORY = "kernel-gone-memory"  # gone while the server's memory was nearly full
    KERNEL_OOM = "kernel-oom"  # the memory cgroup's OOM killer fired as the kernel went
    STARTUP_TIMEOUT = "startup-timeout"
    STARTUP_FAILED = "startup-failed"
    CELL_ERROR = "cell-error"
    COORDINATOR_DIED = "coordinator-died"
    PS_LOST = "ps-lost"
    TASK_FAILED = "task-failed"
    OUT_OF_MEMORY = "out-of-memory"  # the job was stopped before the server's memory limit
    LOST = "lost"  # nobody recorded how it ended (the supervisor died, the watch broke)
    INTERNAL = "internal-error"
    PREEMPTED = "preempted"  # Kueue evicted the job: its queue had borrowed GPUs another queue took back

    def sentence(self) -> str:
        return SENTENCES[self]


SENTENCES: dict[Reason, str] = {
    Reason.FINISHED: "finished",
    Reason.INTERRUPTED: "interrupted from the notebook",
    Reason.STOPPED: "stopped by request (%tfdist stop or Stop in the jobs panel)",
    Reason.SIGNALLED: "stopped: the job's supervisor was told to end (the server shutting down?)",
    Reason.KERNEL_GONE: "the notebook kernel that started this job went away",
    Reason.KERNEL_GONE_MEMORY: "the notebook kernel went away (it may have run out of memory)",
    Reason.KERNEL_OOM: "the notebook kernel was killed: the server ran out of memory",
    Reason.STARTUP_TIMEOUT: "not started within --timeout",
    Reason.STARTUP_FAILED: "a task failed while starting",
    Reason.CELL_ERROR: "the cell raised an exception on the coordinator",
    Reason.COORDINATOR_DIED: "the coordinator process died",
    Reason.PS_LOST: "a parameter server was lost",
    Reason.TASK_FAILED: "a task failed",
    Reason.OUT_OF_MEMORY: "stopped: the server's memory was nearly full",
    Reason.LOST: "the job ended without recording how",
    Reason.INTERNAL: "tfdist's own error",
    Reason.PREEMPTED: "preempted by Kueue: another queue took back the GPUs this job had borrowed",
}


class FailureKind(WireEnum):
    """The `type` of a failed job's error when tfdist (not the user's cell) names the failure.

    A cell's own exception keeps its class name (`ValueError`); these are the kinds tfdist writes.
    """

    STARTUP_ERROR = "StartupError"
    STARTUP_TIMEOUT = "StartupTimeout"
    UNSCHEDULABLE = "Unschedulable"
    PS_LOST = "ParameterServerLost"
    OUT_OF_MEMORY = "OutOfMemory"
    COORDINATOR_EXIT = "CoordinatorExit"
    POD_FAILED = "PodFailed"
    WORKER_LOST = "WorkerLost"  # an all-reduce worker failed: the others cannot finish a step
    JOB_FAILED = "JobFailed"  # the Kubernetes Job failed and named no reason
    PREEMPTED = "Preempted"  # Kueue evicted every pod of the job (tfdist.kube.preemption)

    @property
    def reason(self) -> Reason | None:
        """The reason an error of this kind gives a job that named none (older jobs' state.json)."""
        return _KIND_REASONS.get(self)


_KIND_REASONS: dict[FailureKind, Reason] = {
    FailureKind.STARTUP_ERROR: Reason.STARTUP_FAILED,
    FailureKind.STARTUP_TIMEOUT: Reason.STARTUP_TIMEOUT,
    FailureKind.UNSCHEDULABLE: Reason.STARTUP_TIMEOUT,
    FailureKind.PS_LOST: Reason.PS_LOST,
    FailureKind.OUT_OF_MEMORY: Reason.OUT_OF_MEMORY,
    FailureKind.COORDINATOR_EXIT: Reason.COORDINATOR_DIED,
    FailureKind.POD_FAILED: Reason.TASK_FAILED,
    FailureKind.WORKER_LOST: Reason.TASK_FAILED,
    FailureKind.PREEMPTED: Reason.PREEMPTED,
}
