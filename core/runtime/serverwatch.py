"""What becomes of a local job's server (a PS or a worker) whose process ended: the job's restart policy
(tfdist.job.restart) says restart it, bring the PS and the coordinator back (runtime.psrestart), call it
done, or end the job with the failure named.

Why apart from the supervisor: this is the one place that reads an exit against the policy; the supervisor
only starts the watch and hears the verdict through its `Stop` callback (runtime.guards), like a guard's.
"""

from __future__ import annotations

import asyncio

from tfdist.job.events import TaskEvent
from tfdist.job.restart import Action, RestartPolicy
from tfdist.job.vocab import FailureKind, Reason, TaskState
from tfdist.jobspec import JobSpec
from tfdist.runtime import allreduce
from tfdist.runtime.guards import Stop
from tfdist.runtime.psrestart import PsRestart, TaskHost
from tfdist.runtime.spawn import Task, ended
from tfdist.tf_config import TaskId

POLL_S = 0.2


class ServerWatch:
    """The restart policy applied to every server of the job that ended (the coordinator's end is the
    cell's, and not watched here)."""

    def __init__(
        self,
        spec: JobSpec,
        jobdir: str,
        policy: RestartPolicy,
        recovery: PsRestart,
        host: TaskHost,
        stop: Stop,
    ) -> None:
        self.spec = spec
        self.jobdir = jobdir
        self.policy = policy
        self.recovery = recovery
        self.host = host
        self.stop = stop

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            for task in self.host.tasks.values():
                if task.name == "chief-0" or task.proc is None or task.proc.returncode is None:
                    continue
                await self.ended(task, task.proc.returncode)

    async def ended(self, task: Task, code: int) -> None:
        self.host.forget(task.name)
        role = TaskId.parse(task.name).role
        restarts = self.recovery.restarts if role == "ps" else task.restarts
        action = self.policy.after_exit(role, code, restarts)
        if action is Action.RESUME:  # runtime.psrestart: the PS and the coordinator come back
            await self.recovery.ps_lost(self.host, task, ended(task, code))
        elif action is Action.RESTART:  # the coordinator re-sends the worker's work
            task.restarts += 1
            limit = self.policy.limit(role)
            self.host.log(
                task.name, f"tfdist: {task.name} {ended(task, code)}; restarting ({task.restarts}/{limit})"
            )
            self.host.emit(
                TaskEvent(task=task.name, state=TaskState.RESTARTING, exit_code=code, restarts=task.restarts)
            )
            task.killed_for = None
            await self.host.respawn(task)
        elif action is Action.DONE:
            task.proc = None
            self.host.emit(TaskEvent(task=task.name, state=TaskState.EXITED_OK, exit_code=0))
        else:
            self._failed(task, code, role)

    def _failed(self, task: Task, code: int, role: str) -> None:
        how = ended(task, code)
        task.proc = None
        self.host.emit(TaskEvent(task=task.name, state=TaskState.FAILED, exit_code=code))
        if not self.policy.ends_job(role):
            return
        if self.spec.strategy == "allreduce":
            # MWMS cannot take one worker back mid-step: every collective stalls, the job ends with it named
            failure = allreduce.worker_failure(self.jobdir, task.name, how)
        else:
            why = (
                f"parameter server {task.name} {how}; the fit cannot go on without it "
                "(restart from a checkpoint)"
            )
            failure = {"type": FailureKind.PS_LOST.value, "message": why, "traceback": ""}
        self.host.log(task.name, "tfdist: " + failure["message"])
        self.stop(failure["message"], Reason.STOPPED, failure)
