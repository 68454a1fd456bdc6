"""How a coordinator run ended, read the same way by the local supervisor and the coordinator pod.

The coordinator's contract: exit 0 after writing JOBDIR/result.bin, or write JOBDIR/error.json (the cell's
exception with its traceback) and exit non-zero. Anything else (a signal, a crash before error.json) is a
coordinator death, said in words by the caller that knows why (`ended`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tfdist.job.vocab import FailureKind, JobState
from tfdist.settings import TaskSettings


@dataclass(frozen=True)
class Outcome:
    state: JobState  # succeeded or failed
    message: str
    error: dict[str, Any] | None = None


def coordinator_outcome(
    jobdir: str, code: int | None, ended: str | None = None, strategy: str | None = None
) -> Outcome:
    """How the coordinator ended. ``strategy``: the job's (the local supervisor's environment has none;
    a pod's says it)."""
    if code == 0 and os.path.exists(os.path.join(jobdir, "result.bin")):
        return Outcome(JobState.SUCCEEDED, "finished")
    try:
        with open(os.path.join(jobdir, "error.json")) as f:
            err = json.load(f)
        ts = TaskSettings()
        if (strategy or ts.strategy) == "allreduce":  # chief-0's replica lost a peer: say which
            from .allreduce import peer_lost

            err = peer_lost(err, ts.task or "chief-0") or err
        return Outcome(JobState.FAILED, f"{err['type']}: {str(err['message'])[:300]}", err)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    how = ended or f"exited with code {code}"
    return Outcome(
        JobState.FAILED,
        f"the coordinator {how}",
        {"type": FailureKind.COORDINATOR_EXIT.value, "message": f"exit code {code}", "traceback": ""},
    )
