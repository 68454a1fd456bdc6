"""All-reduce (MultiWorkerMirroredStrategy) jobs on the supervisor's side: which replica a task is, and
how a worker's failure is told.

Every worker runs the cell (`tfdist.runtime.coordinator` under MWMS); chief-0 is replica 0 and the one
that returns results, worker-i is replica i+1. A worker that fails mid-fit stalls every collective of the
others, and MWMS cannot take one worker back (TF: "the unavailable worker needs to be restarted, as well as
other workers"), so a worker failure ends the job, saying which worker and, if the cell failed there, with
the cell's own traceback.
"""

from __future__ import annotations

import json
import os
import re

from tfdist import tf_config
from tfdist.job.vocab import FailureKind, Reason


def replica_index(task: str) -> int:
    role, idx = tf_config.split_task(task)
    return 0 if role == "chief" else idx + 1


def worker_failure(jobdir: str, task: str, how: str) -> dict[str, str]:
    """The job's error for a failed worker: the cell's error if the cell raised there, else how it ended."""
    path = os.path.join(jobdir, f"error-{task}.json")
    if os.path.exists(path):
        with open(path) as f:
            err = json.load(f)
        err["message"] = f"{err.get('message', '')} (raised on {task})"
        return err
    return {
        "type": FailureKind.WORKER_LOST.value,
        "message": f"all-reduce worker {task} {how}; the other workers cannot finish a step without it",
        "traceback": "",
        "reason": Reason.TASK_FAILED.value,
    }


# TensorFlow names the replica a collective lost: "The following tasks are unhealthy (stopped sending
# heartbeats):\n/job:worker/replica:0/task:0", or "... from remote target /job:chief/replica:0/task:0"
_PEER = re.compile(r"/job:(chief|worker)/replica:\d+/task:(\d+)")
_LOST = ("Collective ops is aborted", "unhealthy", "Connection reset by peer", "Socket closed")


def peer_lost(err: dict, me: str) -> dict | None:
    """The cell's error as a lost replica's (`task-failed`, naming it) when TensorFlow aborted a collective
    because another replica went away; None for any other error. On Kubernetes the chief says this before
    the pod watch sees the worker's pod fail, so both say the same."""
    message = str(err.get("message", ""))
    if not any(m in message for m in _LOST):
        return None
    peers = [f"{r}-{i}" for r, i in _PEER.findall(message) if f"{r}-{i}" != me]
    who = f"all-reduce worker {peers[0]}" if peers else "an all-reduce replica"
    return {
        "type": FailureKind.WORKER_LOST.value,
        "message": f"{who} stopped (its pod or process ended); the other workers cannot finish a step "
        "without it",
        "traceback": err.get("traceback", ""),
        "reason": Reason.TASK_FAILED.value,
    }
