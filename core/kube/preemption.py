"""Who gives GPUs back when a queue wants its lent quota again (issue 25), and how a job learns that it did.
Pure: the ClusterQueues' preemption policy, the notebook's priority, and a pod's eviction read into a record.

The policy (read from Kueue v0.17.0's scheduler, pkg/scheduler/preemption):

* ``reclaimWithinCohort: Any``: a queue under its own nominal quota takes back what it lent. Kueue then
  considers only the Workloads of queues that are *borrowing* the resources it needs, orders them evicted
  first, lower priority first, most recently admitted first, evicts until the newcomer fits and puts back
  every one it did not need. ``LowerPriority`` would not do: a reclaiming job has a job's priority, the
  borrowing job too (Kueue wants strictly lower), so a lending queue's jobs would wait for the borrowers.
* ``withinClusterQueue: Never``: inside one queue nobody is evicted for anybody; the line decides.
* ``borrowWithinCohort: Never``: a job that must itself borrow never evicts to do so.
* Notebook servers carry the WorkloadPriorityClass ``tfdist-notebook`` (above every job, which have the
  default 0): in a borrowing queue its jobs are evicted first and a notebook is put back whenever evicting
  jobs is enough. What Kueue v0.17.0 cannot say: a queue whose notebooks *alone* exceed its nominal quota
  (no job left to take) would lose a notebook to ``Any``; docs/queueing.md "Preemption" says so.

An evicted pod group: Kueue's pod integration writes the condition ``TerminationTarget`` (reason
``WorkloadEvictedDueToPreempted`` for a group, ``WorkloadEvicted`` for a single pod; message
"Preempted to accommodate a workload ... due to reclamation within the cohort; preemptor path:
/<cohort>/<queue>; ...") on every running pod of the group and deletes them all; the
Workload gets ``Evicted`` (reason ``Preempted``) and ``Preempted`` (reason ``InCohortReclamation``), then,
since our pods say ``retriable-in-group: "false"``, ``Finished`` ("Pods succeeded: 0/N") once none runs:
the job is not requeued (measured on the kwok plane, docs/queueing.md "Preemption"). `eviction` reads the
pod's condition, which the job's pod watch already has.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..job.checkpoint import Resume

if TYPE_CHECKING:
    from .cluster import KubeApi

API_VERSION = "kueue.x-k8s.io/v1beta2"
L_PRIORITY = "kueue.x-k8s.io/priority-class"  # Kueue reads a Workload's priority class from this label
NOTEBOOK_PRIORITY = "tfdist-notebook"
NOTEBOOK_PRIORITY_VALUE = 1000  # above every job (no class: 0)
MANAGED = {"app.kubernetes.io/managed-by": "jupyter-tfdist", "app.kubernetes.io/part-of": "tfdist-queues"}

C_TERMINATION = "TerminationTarget"  # Kueue's pod condition on a pod it stops (pod_controller.go)
STOP_EVICTED = "WorkloadEvicted"
PREEMPTED_PREFIX = "Preempted to accommodate a workload"
RECLAIM_WORDS = "reclamation within the cohort"  # Kueue's words for InCohortReclamation
# On the root Job of a job the kernel submitted again after Kueue preempted it: any server's `%tfdist
# list` reads "preempted, waiting to be readmitted" until it runs (tfdist.kube.status). Its value: the
# checkpoint it resumes from (a Resume as JSON), or "" when it starts over.
A_RESUBMITTED = "tfdist.io/preempted-resubmitted"
log = logging.getLogger(__name__)


def policy() -> dict[str, Any]:
    """Every ClusterQueue's ``spec.preemption``: reclaim what was lent, nothing else (module docstring)."""
    return {
        "reclaimWithinCohort": "Any",
        "withinClusterQueue": "Never",
        "borrowWithinCohort": {"policy": "Never"},
    }


def priority_classes() -> list[dict[str, Any]]:
    """The WorkloadPriorityClass the notebook servers name (cluster-scoped, one object)."""
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": NOTEBOOK_PRIORITY, "labels": dict(MANAGED)},
            "value": NOTEBOOK_PRIORITY_VALUE,
            "description": "tfdist notebook servers: evicted after every job of a borrowing queue",
        }
    ]


def notebook_labels() -> dict[str, str]:
    """The labels a queued notebook server's pod carries beside its queue label (the spawner adds them)."""
    return {L_PRIORITY: NOTEBOOK_PRIORITY}


@dataclasses.dataclass(frozen=True)
class Preemption:
    """A job's pods evicted by Kueue: why in Kueue's words, and the queue that took its quota back."""

    reclaimed_by: str  # the ClusterQueue that got its quota back ("" when Kueue did not say)
    message: str  # Kueue's own sentence

    def sentence(self) -> str:
        by = f" to give queue {self.reclaimed_by} its quota back" if self.reclaimed_by else ""
        return f"preempted by Kueue{by}"


def _preemptor_queue(message: str) -> str:
    """The last element of Kueue's "preemptor path: /<cohort>/<queue>" ("" when absent)."""
    _, sep, rest = message.partition("preemptor path: ")
    if not sep:
        return ""
    path = rest.split(";", 1)[0].strip()
    return "" if path in ("", "UNKNOWN") else path.rstrip("/").rsplit("/", 1)[-1]


def eviction(pod: Mapping[str, Any]) -> Preemption | None:
    """The preemption a pod's ``TerminationTarget`` condition says, or None (not stopped by Kueue, or
    stopped for another reason: the Workload deleted, not admitted)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") != C_TERMINATION or c.get("status") != "True":
            continue
        message = str(c.get("message") or "")
        reason = str(c.get("reason") or "")
        if reason.startswith(STOP_EVICTED) and message.startswith(PREEMPTED_PREFIX):
            return Preemption(reclaimed_by=_preemptor_queue(message), message=message)
    return None


def requeued(said: str, queue: str, checkpoint_every: int | None, resume: Resume | None = None) -> str:
    """What the cell says, once per eviction, when its preempted job is submitted again: it waits in line,
    then resumes from the checkpoint the kernel kept (tfdist.kube.checkpoints) or starts over."""
    waits = f"{said}; waiting in queue {queue} again"
    if resume is not None:
        at = f"epoch {resume.epoch + 1} (the checkpoint at step {resume.step})"
        return f"{waits}, it resumes from {at} when admitted"
    if checkpoint_every:
        why = "no checkpoint had reached the notebook yet"
        return f"{waits}, it starts from the beginning when admitted ({why})"
    return f"{waits}, it starts from the beginning when admitted (without --checkpoint-every)"


def resubmitted(root: Mapping[str, Any] | None) -> bool:
    """Is this root Job a preempted job's new run (`A_RESUBMITTED`)?"""
    return A_RESUBMITTED in (((root or {}).get("metadata") or {}).get("annotations") or {})


async def mark_resubmitted(kube: KubeApi, namespace: str, name: str, resume: Resume | None) -> None:
    """Say on the new root Job that it is a preempted job's new run, where another server's list reads it.
    Only a word for people: a root Job that keeps changing or is gone is left as it is."""
    value = resume.model_dump_json() if resume is not None else ""
    for _ in range(5):
        try:
            root = await kube.read_job(name, namespace)
            if root is None:
                return
            root["metadata"].setdefault("annotations", {})[A_RESUBMITTED] = value
            await kube.replace_job(root, keep=("suspend", "activeDeadlineSeconds"), attempts=1)
            return
        except Exception as exc:  # a conflict (the lifeline renewed it): read it again
            log.debug("root Job %s not marked as resubmitted yet: %s", name, exc)
