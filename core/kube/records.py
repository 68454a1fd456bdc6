"""Detached jobs' records in the user's state directory: what a later kernel needs to attach (the job's
token and identity). 0600 files: the notebook may not read the job's Secret back from the cluster."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any


def path(state_dir: str, namespace: str, name: str) -> str:
    return os.path.join(state_dir, "kubernetes", namespace, f"{name}.json")


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
