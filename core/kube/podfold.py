"""From a job's pods to its task events and its verdict: the fold that tfdist.kube.podwatch feeds. Pure.

Why apart from the watch: what a pod means (a task's state, a replacement by the Job controller, the job's
end) does not depend on how the pods arrive (a list, a watch, a relist after 410); kept apart, it is
tested with plain pod dicts, no API server. Events are records (tfdist.job.events), as the backend yields
them; tfdist.kube.status derives each task's state.
"""

from __future__ import annotations

import time
from typing import Any

from ..job.events import ErrorInfo, Event, LogEvent, StateEvent, TaskEvent
from ..job.vocab import LIVE_TASK_STATES, FailureKind, JobState, Reason, TaskState
from . import status as st
from .preemption import Preemption, eviction

Pod = dict[str, Any]

DELETED_MESSAGE = (
    "the job was deleted in the cluster (with its notebook server, or by someone else); nothing of it is left"
)


class PodFold:
    """The job's tasks as its pods say, folded one list or watch event at a time.

    `expected`: the job's task count (all of them running is the job running); `strategy`: under
    all-reduce a failed worker ends the job (tfdist.kube.status.outcome)."""

    def __init__(self, expected: int, strategy: str = "ps") -> None:
        self.expected = expected
        self.strategy = strategy
        self.tasks: st.TaskStates = {}
        self.started_all = False
        self.current: dict[str, str] = {}  # task -> name of its newest pod
        self.restarts: dict[str, int] = {}
        self.preempted: Preemption | None = None  # Kueue evicted the job's pods (its pod condition says)
        self.evicted: set[str] = set()  # tasks whose pod Kueue stopped while it ran

    @staticmethod
    def relevant(pod: Pod) -> bool:
        """A pod whose labels name a task (others are no concern of the job's)."""
        return bool(st.pod_task(pod))

    def listed(self, pods: list[Pod]) -> list[Event]:
        """A (re)list of the job's pods: replacements seen since, then the tasks whose state changed."""
        pods = st.newest_per_task(pods)
        for p in pods:
            self._evicted(p)
        out: list[Event] = []
        for p in pods:
            out += self._replaced(st.pod_task(p) or "", p["metadata"]["name"])
        return out + st.task_events(pods, self.tasks)

    def changed(self, kind: str, pod: Pod) -> list[Event]:
        """One watch event (ADDED, MODIFIED, DELETED) of a job's pod; an older pod of a task that has a
        newer one says nothing about the task."""
        task = st.pod_task(pod)
        if not task:
            return []
        name = pod["metadata"]["name"]
        self._evicted(pod)
        out: list[Event] = self._replaced(task, name) if kind == "ADDED" else []
        if self.current.get(task, name) == name:
            if kind == "DELETED":
                self.tasks.pop(task, None)
            out += st.task_events([pod] if kind != "DELETED" else [], self.tasks)
        return out

    @property
    def empty(self) -> bool:
        """No task has a pod (every one deleted)."""
        return not self.tasks

    def verdict(self) -> StateEvent | None:
        """The final state event once the tasks say the job ended, else None. Tasks that failed because
        Kueue evicted the job are its preemption, not a failure of the job's own."""
        done = st.outcome(self.tasks, self.strategy)
        # Kueue deleted every pod: the Job controllers bring none back. A coordinator that exited 0 on the
        # eviction's SIGTERM did not finish the fit either.
        ended = done is not None and (done.state == JobState.FAILED or "chief-0" in self.evicted)
        # Nor does anything of the run go on once the coordinator's evicted pod is over or gone. Waiting for
        # the other tasks held the verdict until the root's TTL took the evicted run's PS and worker Jobs
        # (15 s after the eviction on the real node), while those replaced their pods (the Job controller's
        # backoff, 9 s after it): "pod replaced by the cluster" lines, and the new run 15 s later.
        chief = self.tasks.get("chief-0")
        stopped = "chief-0" in self.evicted and (chief is None or chief[0] not in LIVE_TASK_STATES)
        if self.preempted is not None and (self.empty or ended or stopped):
            return self._preempted()
        return done

    def gone(self, listed: bool) -> StateEvent:
        """The verdict for a job with neither pods nor root (`gone`), unless Kueue evicted it first: its
        root Job failed with the coordinator's pod and was deleted after its TTL."""
        return self._preempted() or gone(listed)

    def _preempted(self) -> StateEvent | None:
        if self.preempted is None:
            return None
        said = self.preempted.sentence()
        return (
            StateEvent(  # the kernel that holds the job's cell submits it again (tfdist.backends.kubewatch)
                state=JobState.FAILED,
                t=time.time(),
                message=f"{said}; the kernel that ran its cell submits it again, if it is still there",
                error=ErrorInfo(type=FailureKind.PREEMPTED.value, message=said, reason=Reason.PREEMPTED),
            )
        )

    def _evicted(self, pod: Pod) -> None:
        found = eviction(pod)
        if found is not None:
            self.preempted = self.preempted or found
            self.evicted.add(st.pod_task(pod) or "")

    def running(self) -> list[Event]:
        """The job's "running" event, once: when every expected task runs (or has finished)."""
        if not self.started_all and st.servers_running(self.tasks, self.expected):
            self.started_all = True
            return [StateEvent(state=JobState.RUNNING, message="all tasks running")]
        return []

    def not_running(self) -> str:
        """Why tasks are not running: each one's words (the scheduler's, the image puller's)."""
        return "; ".join(
            f"{t}: {m}" for t, (s, m) in sorted(self.tasks.items()) if s != TaskState.RUNNING and m
        )

    def _replaced(self, task: str, pod_name: str) -> list[Event]:
        """The Job controller replaced a task's pod: say so once per replacement."""
        old = self.current.get(task)
        self.current[task] = pod_name
        if old is None or old == pod_name:
            return []
        n = self.restarts[task] = self.restarts.get(task, 0) + 1
        try:
            return [
                TaskEvent(task=task, state=TaskState.RESTARTING, restarts=n),
                LogEvent(lines=((task, f"tfdist: {task} pod replaced by the cluster ({n})"),)),
            ]
        except ValueError:  # a pod labelled with no task name of ours: nothing to say about it
            return []


def gone(listed: bool) -> StateEvent:
    """The verdict for a job with neither pods nor root: found so on a list, or deleted while watched."""
    message = "no objects left" if listed else DELETED_MESSAGE
    return StateEvent(state=JobState.STOPPED, message=message, t=time.time())


def timed_out(timeout_s: float, reasons: str) -> StateEvent:
    """The verdict for a job whose tasks were not all running within --timeout (the backend deleted it)."""
    return StateEvent(
        state=JobState.FAILED,
        t=time.time(),
        message=f"not running within --timeout {timeout_s:g}s; deleted. {reasons}".strip(),
        error=ErrorInfo(type=FailureKind.UNSCHEDULABLE.value, message=reasons),
    )
