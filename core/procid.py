"""Processes named by more than their PID: a PID and the time the process started.

Why: a PID outlives its process. A finished job's `supervisor.pid`, or a hub's saved server PID, may name an
unrelated process once the system reuses the number; in the local hub every server runs as the same Unix
user, so signalling that PID could end another user's kernel. Every check and every signal goes through
`ProcessId.alive()`, which compares the start time too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessId:
    pid: int
    started: float  # psutil's create_time: seconds since the epoch, stable for the life of the process

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except psutil.Error:
            return None

    @classmethod
    def current(cls) -> ProcessId:
        me = cls.of(os.getpid())
        assert me is not None
        return me

    def alive(self) -> bool:
        """This very process still runs (not a zombie, not another process with its PID)."""
        try:
            p = psutil.Process(self.pid)
            return p.create_time() == self.started and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def signal(self, sig: int = signal.SIGTERM, group: bool = False) -> bool:
        """Send `sig` to this process (or its process group) only if it is still this process."""
        if not self.alive():
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
            return True
        return False

    def dumps(self) -> str:
        return json.dumps({"pid": self.pid, "started": self.started})

    @classmethod
    def loads(cls, text: str) -> ProcessId | None:
        """From `dumps()`; anything else (a bare PID of an older version, garbage) names no process."""
        try:
            d = json.loads(text)
            return cls(int(d["pid"]), float(d["started"]))
        except (ValueError, TypeError, KeyError):
            return None
