"""Jobs' records in the user's state directory. A detached job's record: what a later kernel needs to
attach (the job's token and identity). A running job's latest sample (`*.live.json`): the kernel that
follows the job writes what its pods last reported (CPU, memory, GPUs), so this server's other processes
(the lab panel, the hub's GPU-idle culler and admin page, through the server extension) see a Kubernetes
job's utilization too; only that kernel holds the job's token. 0600 files: the notebook may not read the
job's Secret back from the cluster."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

LIVE_MAX_AGE_S = 60.0  # an older sample says nothing about now (its kernel stopped following the job)
LIVE_EVERY_S = 5.0  # a followed job's sample is written at most this often


def path(state_dir: str, namespace: str, name: str) -> str:
    return os.path.join(state_dir, "kubernetes", namespace, f"{name}.json")


def live_path(state_dir: str, namespace: str, name: str) -> str:
    return os.path.join(state_dir, "kubernetes", namespace, f"{name}.live.json")


def stop_path(state_dir: str, namespace: str, name: str) -> str:
    """A user's stop of the job (`%tfdist stop`, the lab panel's Stop, an interrupted cell), from any of
    this server's processes: the kernel that follows a preempted job reads it before it submits the job
    again. A new submit of the name removes it."""
    return os.path.join(state_dir, "kubernetes", namespace, f"{name}.stopped.json")


def load_live(file: str, now: float | None = None) -> dict[str, Any] | None:
    """The latest metrics sample, `{"t", "tasks"}`, if it is recent; else None."""
    rec = load(file)
    if rec is None or not isinstance(rec.get("tasks"), dict):
        return None
    try:
        age = (time.time() if now is None else now) - float(rec["t"])
    except (KeyError, TypeError, ValueError):
        return None
    return rec if age < LIVE_MAX_AGE_S else None


def save(file: str, record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(file), mode=0o700, exist_ok=True)
    fd = os.open(file + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(file + ".part", file)


def load(file: str) -> dict[str, Any] | None:
    try:
        with open(file) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def drop(file: str, taken: bool = False) -> None:
    """Remove a record; after the results were fetched, a stub says so to a later attach."""
    with contextlib.suppress(OSError):
        if taken and os.path.exists(file):
            save(file, {"taken": time.time()})
        else:
            os.unlink(file)
