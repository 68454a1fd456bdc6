"""How a Kubernetes job's state is derived from its pods: one place for `watch()` and `status()`. Pure.

A task is `<role>-<index>` (the role label, and the Job controller's completion index on Indexed pods).
While the Job controller replaces a failed worker, the task has two pods: the newest one speaks for it.
"""

from __future__ import annotations

import time
from typing import Any

from ..job.events import ErrorInfo, Event, LogEvent, StateEvent, TaskEvent
from ..job.vocab import FailureKind, JobState, Reason, TaskState
from ..jobspec import JobSpec
from ..jobview import JobView
from ..tf_config import TaskId
from . import names as kn
from . import preemption

TaskStates = dict[str, tuple[str, str]]  # task -> (state, message)
ADMISSION_WAIT = "waiting to be admitted"
TEXT_MAX = 4096  # of the cluster's words kept in an event (a pod's status message, a Job's condition)


def _text(value: Any) -> str:
    return str(value)[:TEXT_MAX]


def pod_task(pod: dict[str, Any]) -> str | None:
    labels = pod.get("metadata", {}).get("labels") or {}
    if labels.get(kn.L_TASK):
        return labels[kn.L_TASK]
    role = labels.get(kn.L_ROLE)
    if not role:
        return None
    index = labels.get(kn.L_INDEX) or (pod["metadata"].get("annotations") or {}).get(kn.L_INDEX) or "0"
    return f"{role}-{index}"


def pod_task_state(pod: dict[str, Any]) -> tuple[str, str]:
    """(state, message) of one task pod, with the scheduler's words while it waits for a node."""
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return TaskState.TERMINATING, ""
    if phase == "Pending":
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                if c.get("reason") == "SchedulingGated":  # held by Kueue until the job is admitted:
                    return TaskState.PENDING, ADMISSION_WAIT  # its place in line is the job's word
                return TaskState.UNSCHEDULABLE, c.get("message") or c.get("reason") or "not scheduled"
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
                return TaskState.IMAGE_ERROR, f"{waiting['reason']}: {waiting.get('message', '')}".strip()
        return TaskState.PENDING, "scheduled" if (pod.get("spec") or {}).get(
            "nodeName"
        ) else "waiting for a node"
    if phase == "Running":
        restarts = sum(cs.get("restartCount", 0) for cs in status.get("containerStatuses") or [])
        return TaskState.RUNNING, f"restarts: {restarts}" if restarts else ""
    if phase == "Succeeded":
        return TaskState.EXITED_OK, ""
    if phase == "Failed":
        why = status.get("reason") or status.get("message") or "failed"
        if (pod.get("metadata", {}).get("annotations") or {}).get(kn.A_PS_RESTARTS):
            # --checkpoint-every: the PS Job replaces it and the coordinator pod resumes; when it has no
            # restart left the coordinator fails, and says so
            return TaskState.RESTARTING, f"lost ({why}); being replaced"
        return TaskState.FAILED, why
    return phase.lower(), ""


def newest_per_task(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A task may briefly have its failed pod and its replacement: keep the newest."""
    newest: dict[str, dict[str, Any]] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
        task = pod_task(pod)
        if task:
            newest[task] = pod
    return list(newest.values())


def task_events(pods: list[dict[str, Any]], tasks: TaskStates) -> list[Event]:
    """Events (records, as `watch()` yields them) for the task states that changed; `tasks` is updated
    in place. A pod whose labels name no task (chief-0, worker-N, ps-N) is not one of the job's tasks."""
    out: list[Event] = []
    for pod in pods:
        task = pod_task(pod)
        try:
            TaskId.parse(task or "")
        except ValueError:
            continue
        st = pod_task_state(pod)
        if tasks.get(task) == st:
            continue
        tasks[task] = st
        node = (pod.get("spec") or {}).get("nodeName")
        out.append(TaskEvent(task=task, state=_text(st[0])[:200], node=_text(node)[:200] if node else None))
        if st[1] and st[0] in (TaskState.UNSCHEDULABLE, TaskState.IMAGE_ERROR, TaskState.FAILED):
            out.append(StateEvent(state=JobState.STARTING, message=_text(f"{task}: {st[1]}")))
            out.append(LogEvent(lines=[(task, _text(st[1]))]))
    return out


def servers_running(tasks: TaskStates, expected: int | None = None) -> bool:
    if expected is not None and len(tasks) < expected:
        return False
    return bool(tasks) and all(s[0] in (TaskState.RUNNING, TaskState.EXITED_OK) for s in tasks.values())


def outcome(tasks: TaskStates, strategy: str = "ps") -> StateEvent | None:
    """The final state event once the tasks say the job ended: the coordinator succeeded, or the
    coordinator or a PS failed (a failed PS worker is the Job controller's to replace). Under all-reduce a
    failed worker ends the job: the other replicas cannot finish a step without it (no replacement)."""
    chief = tasks.get("chief-0")
    if chief and chief[0] == TaskState.EXITED_OK:
        return _final(JobState.SUCCEEDED, "finished")
    failed = {
        t: m
        for t, (s, m) in tasks.items()
        if s == TaskState.FAILED and (strategy == "allreduce" or not t.startswith("worker"))
    }
    lost = sorted(t for t in failed if t.startswith("worker")) if strategy == "allreduce" else []
    if lost and not (chief and chief[0] == TaskState.FAILED):
        detail = f" ({failed[lost[0]]})" if failed[lost[0]] not in ("", "failed") else ""
        why = (
            f"all-reduce worker {lost[0]} failed{detail}; the other workers cannot finish a step without it "
            "(its log says why)"
        )
        return _final(
            JobState.FAILED,
            why,
            ErrorInfo(type=FailureKind.WORKER_LOST, message=_text(why), reason=Reason.TASK_FAILED),
        )
    if failed or (chief and chief[0] == TaskState.FAILED):
        why = "; ".join(f"{t}: {m}" for t, m in sorted(failed.items()))
        if chief and chief[1] == "DeadlineExceeded":
            why = "the notebook's kernel stopped renewing the job's lifeline; the cluster ended it"
        return _final(
            JobState.FAILED,
            why or "the coordinator failed",
            ErrorInfo(type=FailureKind.POD_FAILED, message=_text(why)),
        )
    return None


def root_outcome(root: dict[str, Any] | None) -> StateEvent | None:
    """The root Job's own verdict (it outlives its pods for FINISHED_TTL_S)."""
    for c in ((root or {}).get("status") or {}).get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return _final(JobState.SUCCEEDED, "finished")
        if c.get("type") == "Failed":
            why = c.get("message") or c.get("reason") or "failed"
            if c.get("reason") == "DeadlineExceeded":
                why = "the notebook's kernel stopped renewing the job's lifeline; the cluster ended it"
            kind = _text(c.get("reason") or FailureKind.JOB_FAILED)[:200]
            return _final(JobState.FAILED, why, ErrorInfo(type=kind, message=_text(why)))
    return None


def _final(state: JobState, message: str, error: ErrorInfo | None = None) -> StateEvent:
    """A final state event as `watch()` yields it."""
    return StateEvent(state=state, message=_text(message), t=time.time(), error=error)


def view(
    name: str, spec: JobSpec | None, pods: list[dict[str, Any]], root: dict[str, Any] | None, created: float
) -> JobView:
    """The job as `status()` shows it and `watch()` starts from."""
    v = JobView(
        name=name,
        backend="kubernetes",
        user=spec.user if spec else "",
        total_tasks=spec.task_count if spec else len(pods),
        spec=spec_dict(spec),
    )
    v.created = created
    tasks: TaskStates = {}
    for ev in task_events(newest_per_task(pods), tasks):
        v.apply(ev)
    done = outcome(tasks, spec.strategy if spec else "ps") or root_outcome(root)
    if done:
        v.apply(done)
    elif root is None:  # deleted first (stop, TTL): its pods only wait for the garbage collector
        v.state = JobState.STOPPED
        v.message = "the cluster is removing its pods" if pods else "no objects left"
    elif servers_running(tasks, spec.task_count if spec else None):
        v.state, v.message = JobState.RUNNING, "all tasks running"
    else:
        v.state = JobState.STARTING
    if v.state in (JobState.PENDING, JobState.STARTING) and preemption.resubmitted(root):
        v.reason = Reason.PREEMPTED.value  # "preempted, waiting to be readmitted" (JobView.state_word)
    return v


def spec_dict(spec: JobSpec | None) -> dict[str, Any]:
    import json

    return json.loads(spec.to_json()) if spec else {}
