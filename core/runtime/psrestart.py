"""A parameter server that comes back (`--checkpoint-every N`), supervisor side.

A lost PS takes the fit's variables with it, and TensorFlow's coordinator cannot reconnect to a new one:
so the supervisor restarts the PS (same address) and the coordinator, which runs the cell again and
resumes its fit from the last checkpoint (tfdist.runtime.psrecovery). Workers stay: the new coordinator
registers the cluster afresh. At most the restart policy's PS limit (tfdist.job.restart); after that a PS
loss ends the job as before. The supervisor is reached through `TaskHost`, its public side for this.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from tfdist.job.events import Event, TaskEvent
from tfdist.job.restart import PS_RESTARTS, RestartPolicy
from tfdist.job.vocab import TaskState
from tfdist.jobspec import JobSpec
from tfdist.runtime.psrecovery import checkpoint_env
from tfdist.tf_config import TaskId

if TYPE_CHECKING:  # the coordinator pod (runtime.pspod) imports this module: none of the local spawning
    from tfdist.runtime.spawn import Task

MAX_PS_RESTARTS = PS_RESTARTS  # the restart policy's (tfdist.job.restart), as the pods and messages name it


class TaskHost(Protocol):
    """What a PS's comeback needs of the local supervisor (tfdist.runtime.supervisor.Supervisor)."""

    @property
    def tasks(self) -> Mapping[str, Task]: ...

    def emit(self, ev: Event) -> None:
        """Fold an event into the job's view and send it to the watchers."""

    def log(self, task: str, line: str) -> None:
        """A line in the job's log, as from `task`."""

    async def respawn(self, task: Task) -> None:
        """Start the task's server again, at its address."""

    def forget(self, task: str) -> None:
        """Stop sampling the task's process (it ended)."""


def restart_line(task: str, how: str, every: int, restarts: int) -> str:
    """What the job's log says when a PS is lost and comes back (local supervisor and coordinator pod)."""
    return (
        f"tfdist: parameter server {task} {how}; restarting it and the coordinator, which "
        f"resumes from the last checkpoint (every {every} steps) ({restarts}/{MAX_PS_RESTARTS})"
    )


def clear_leftovers(jobdir: str) -> None:
    """A coordinator that died with its PS may have left its error: the next run's outcome is its own."""
    for leftover in ("error.json", "result.bin"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(jobdir, leftover))


class PsRestart:
    def __init__(self, spec: JobSpec, jobdir: str):
        self.policy = RestartPolicy.for_spec(spec)
        self.enabled = self.policy.ps_comes_back
        self.every = spec.checkpoint_every or 0
        self.jobdir = jobdir
        self.restarts = 0
        self.resume_pending = False

    def coordinator_env(self) -> dict[str, str]:
        if not self.enabled:
            return {}
        return checkpoint_env(self.every, self.jobdir)

    def can_restart(self) -> bool:
        return self.enabled and self.restarts < self.policy.limit("ps")

    async def ps_lost(self, sup: TaskHost, task: Task, how: str) -> None:
        """Restart the PS at its address, then end the coordinator: the job's loop starts a new one."""
        self.restarts += 1
        line = restart_line(task.name, how, self.every, self.restarts)
        sup.log(task.name, line)
        if task.log is not None:  # `%tfdist logs` shows it with the PS's own output
            task.log.write(line.encode() + b"\n")
        sup.emit(TaskEvent(task=task.name, state=TaskState.RESTARTING, restarts=self.restarts))
        task.restarts += 1
        task.killed_for = None
        await sup.respawn(task)
        self.resume_pending = True
        chief = sup.tasks["chief-0"]
        if chief.proc is not None and chief.proc.returncode is None:
            chief.killed_for = f"restarting after the loss of {task.name}"
            with contextlib.suppress(ProcessLookupError):
                chief.proc.kill()

    async def should_resume(self, sup: TaskHost) -> bool:
        """The coordinator ended: is that a PS loss to recover from (and not the cell's own end)?"""
        if not self.enabled:
            return False
        chief = sup.tasks["chief-0"]
        if not self.resume_pending and chief.proc is not None and chief.proc.returncode != 0:
            # the coordinator may see the PS go before the server watcher does
            for _ in range(10):
                dead = [
                    t
                    for n, t in sup.tasks.items()
                    if TaskId.parse(n).role == "ps" and t.proc is not None and t.proc.returncode is not None
                ]
                if dead:
                    break
                await asyncio.sleep(0.1)
            for t in dead:
                if not self.can_restart():
                    return False
                sup.forget(t.name)
                await self.ps_lost(sup, t, f"exited with code {t.proc.returncode}")
        if not self.resume_pending:
            return False
        self.resume_pending = False
        clear_leftovers(self.jobdir)
        sup.forget("chief-0")
        chief.restarts += 1
        chief.killed_for = None
        sup.emit(TaskEvent(task="chief-0", state=TaskState.RESTARTING, restarts=chief.restarts))
        return True
