"""Which lost tasks of a job come back, and how often: the one restart policy.

Why one: the local supervisor applies it to its processes and the Kubernetes manifests hand the same limits
to the Job controller (`backoffLimitPerIndex`); written twice, the two backends could drift apart. Pure.

The three cases: a PS-strategy worker comes back at its address (TensorFlow's coordinator re-sends its
work); a parameter server comes back only with `--checkpoint-every` (with the coordinator, which resumes
from its checkpoint), else its loss ends the job; an all-reduce worker never comes back (MWMS cannot take a
replica back mid-step), so any end but 0 ends the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tfdist.jobspec import JobSpec

WORKER_RESTARTS = 3  # per worker (locally) and per worker index (backoffLimitPerIndex)
PS_RESTARTS = 3  # per job, with --checkpoint-every


class Action(str, Enum):
    """What to do about a task process that ended (not the coordinator's: its end is the cell's)."""

    RESTART = "restart"  # the task alone comes back at its address
    RESUME = "resume"  # a PS comes back and the coordinator resumes from its checkpoint
    DONE = "done"  # it finished its part (an all-reduce worker that exited 0)
    FAIL = "fail"  # it stays down; a PS or an all-reduce worker takes the job with it

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RestartPolicy:
    strategy: str = "ps"
    checkpoint_every: int = 0
    worker_restarts: int = WORKER_RESTARTS
    ps_restarts: int = PS_RESTARTS

    @classmethod
    def for_spec(cls, spec: JobSpec) -> RestartPolicy:
        return cls(strategy=spec.strategy, checkpoint_every=spec.checkpoint_every or 0)

    @property
    def ps_comes_back(self) -> bool:
        """--checkpoint-every on a PS job: a lost PS is replaced and the coordinator resumes."""
        return self.strategy == "ps" and self.checkpoint_every > 0

    def limit(self, role: str) -> int:
        """How many times a task of `role` may come back (the Job controller's backoffLimitPerIndex)."""
        if self.strategy == "allreduce" or role == "chief":
            return 0
        if role == "worker":
            return self.worker_restarts
        return self.ps_restarts if self.ps_comes_back else 0

    def after_exit(self, role: str, code: int | None, restarts: int) -> Action:
        """The task of `role` ended with `code` after coming back `restarts` times (a PS: the job's PS
        restarts so far, as both backends count them)."""
        if self.strategy == "allreduce":
            return Action.DONE if code == 0 else Action.FAIL
        if restarts >= self.limit(role):
            return Action.FAIL
        return Action.RESUME if role == "ps" else Action.RESTART

    def ends_job(self, role: str) -> bool:
        """A task of `role` that stays down ends the job (a PS worker does not: the rest carry on)."""
        return self.strategy == "allreduce" or role != "worker"
