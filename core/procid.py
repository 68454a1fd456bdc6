"""Processes named by more than their PID: a PID and the time the process started.

Why: a PID outlives its process. A finished job's `supervisor.pid`, or a hub's saved server PID, may name an
unrelated process once the system reuses the number; in the local hub every server runs as the same Unix
user, so signalling that PID could end another user's kernel. Every check and every signal goes through
`ProcessId.alive()`, which compares the start time (clock ticks since this boot) too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def boot_id() -> str:
    """This boot of the machine: seconds since boot repeat after a reboot, this id does not."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_time(pid: int) -> float | None:
    """When `pid` started, in seconds since boot; None when no such process (or a zombie).

    Why not psutil's create_time: that adds the boot time read from the wall clock (/proc/stat btime, whole
    seconds), which moves when the clock is stepped (NTP, a VM's clock sync). Two processes reading one
    start time a minute apart could then disagree by a second, and a living job would look gone. Ticks since
    boot do not move.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19]) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessId:
    pid: int
    started: float  # seconds since boot (`start_time`): fixed for the life of the process
    boot: str = field(default_factory=boot_id)

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        started = start_time(pid)
        return None if started is None else cls(pid, started)

    @classmethod
    def current(cls) -> ProcessId:
        me = cls.of(os.getpid())
        assert me is not None
        return me

    def alive(self) -> bool:
        """This very process still runs (not a zombie, not another process with its PID, not another boot)."""
        return self.boot == boot_id() and start_time(self.pid) == self.started

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
        return json.dumps({"pid": self.pid, "started": self.started, "boot": self.boot})

    @classmethod
    def loads(cls, text: str) -> ProcessId | None:
        """From `dumps()`; anything else (a bare PID of an older version, garbage) names no process."""
        try:
            d = json.loads(text)
            return cls(int(d["pid"]), float(d["started"]), str(d["boot"]))
        except (ValueError, TypeError, KeyError):
            return None
