"""JOBDIR/state.json: what `%tfdist status`, `%tfdist list` and the lab panel read of a local job once its
supervisor is gone (or before they reach its socket). Written whole and renamed, so a reader never sees half.
"""

from __future__ import annotations

import json
import os

from tfdist.job.view import JobView
from tfdist.runtime import history


def write_state(jobdir: str, view: JobView, pid: int) -> None:
    tmp = os.path.join(jobdir, "state.json.tmp")
    with open(tmp, "w") as f:
        extra = {
            "error": view.error,
            "pid": pid,
            "tasks": view.tasks,
            "epoch_logs": view.epoch_logs,
            "metrics": history.downsample(list(view.metrics)),  # the panel's charts after the end
        }
        json.dump(view.summary() | extra, f)
    os.replace(tmp, os.path.join(jobdir, "state.json"))
