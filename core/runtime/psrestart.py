"""A parameter server that comes back (`--checkpoint-every N`), supervisor side.

A lost PS takes the fit's variables with it, and TensorFlow's coordinator cannot reconnect to a new one:
so the supervisor restarts the PS (same address) and the coordinator, which runs the cell again and
resumes its fit from the last checkpoint (tfdist.runtime.psrecovery). Workers stay: the new coordinator
registers the cluster afresh. At most MAX_PS_RESTARTS; after that a PS loss ends the job as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from tfdist.events import TaskEvent
from tfdist.jobspec import JobSpec
from tfdist.runtime import psrecovery
from tfdist.tf_config import TaskId

MAX_PS_RESTARTS = 3
CKPT_DIR = "ckpt"


def checkpoint_env(every: int, jobdir: str) -> dict[str, str]:
    """The coordinator's checkpoint settings (psrecovery.settings): every N steps, into JOBDIR/ckpt."""
    return {psrecovery.ENV_EVERY: str(every), psrecovery.ENV_DIR: os.path.join(jobdir, CKPT_DIR)}


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
        self.enabled = spec.strategy == "ps" and bool(spec.checkpoint_every)
        self.every = spec.checkpoint_every or 0
        self.jobdir = jobdir
        self.restarts = 0
        self.resume_pending = False

    def coordinator_env(self) -> dict[str, str]:
        if not self.enabled:
            return {}
        return checkpoint_env(self.every, self.jobdir)

    def can_restart(self) -> bool:
        return self.enabled and self.restarts < MAX_PS_RESTARTS

    async def ps_lost(self, sup: Any, task: Any, how: str) -> None:
        """Restart the PS at its address, then end the coordinator: the job's loop starts a new one."""
        self.restarts += 1
        line = restart_line(task.name, how, self.every, self.restarts)
        sup.pending_logs.append((task.name, line))
        if task.log is not None:  # `%tfdist logs` shows it with the PS's own output
            task.log.write(line.encode() + b"\n")
        sup.emit(TaskEvent(task=task.name, state="restarting", restarts=self.restarts))
        task.restarts += 1
        task.killed_for = None
        await sup._spawn(task, "tfdist.runtime.task")
        self.resume_pending = True
        chief = sup.tasks["chief-0"]
        if chief.proc is not None and chief.proc.returncode is None:
            chief.killed_for = f"restarting after the loss of {task.name}"
            with contextlib.suppress(ProcessLookupError):
                chief.proc.kill()

    async def should_resume(self, sup: Any) -> bool:
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
                sup.sampler.forget(t.name)
                await self.ps_lost(sup, t, f"exited with code {t.proc.returncode}")
        if not self.resume_pending:
            return False
        self.resume_pending = False
        clear_leftovers(self.jobdir)
        sup.sampler.forget("chief-0")
        chief.restarts += 1
        chief.killed_for = None
        sup.emit(TaskEvent(task="chief-0", state="restarting", restarts=chief.restarts))
        return True
