"""The agent's event log: what the coordinator pod's agent serves the notebook (a long poll), bounded by count
and bytes, with the server pods' samples merged into one metrics event a second.

Why apart from the HTTP server: it is the pod's memory bound and the order of events, tested on its own
(tests/test_agent_log.py), and the server only reads and appends.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..events import MetricsEvent, to_wire
from . import events as wire


class JobLog:
    """Events in order, readable from any index (long-poll); thread-safe. A ring bounded by count *and*
    bytes: the coordinator pod's memory is the job's --memory, and one metrics event of a 66-task job is
    tens of KiB (20,000 of them were ~840 MiB), so only the newest events stay (a reader that fell
    behind skips ahead)."""

    def __init__(self, keep: int = 20000, keep_bytes: int = 32 * 2**20) -> None:
        self._events: list[dict[str, Any]] = []
        self._sizes: list[int] = []
        self._bytes = 0
        self._base = 0  # index of self._events[0]
        self._keep, self._keep_bytes = keep, keep_bytes
        self._cond = threading.Condition()

    def add(self, ev: dict[str, Any]) -> None:
        size = len(wire.dumps(ev))
        with self._cond:
            self._events.append(ev)
            self._sizes.append(size)
            self._bytes += size
            drop = max(len(self._events) - self._keep, 0)
            freed = sum(self._sizes[:drop])
            while self._bytes - freed > self._keep_bytes and drop < len(self._events) - 1:
                freed += self._sizes[drop]
                drop += 1
            if drop:
                self._bytes -= freed
                del self._events[:drop], self._sizes[:drop]
                self._base += drop
            self._cond.notify_all()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def read(self, start: int, wait: float) -> tuple[int, list[dict[str, Any]]]:
        """(index of the first event returned, events from `start` on)."""
        with self._cond:
            if start >= self._base + len(self._events):
                self._cond.wait(wait)
            first = max(start, self._base)
            return first, self._events[first - self._base :]


class MetricsMerger:
    """Each server pod posts its own sample; the notebook gets one metrics event per second for all."""

    def __init__(self, log: JobLog, period: float = 1.0) -> None:
        self._log, self._period = log, period
        self._latest: dict[str, Any] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="tfdist-metrics", daemon=True).start()

    def add(self, ev: MetricsEvent) -> None:
        with self._lock:
            self._latest.update(to_wire(ev)["tasks"])

    def _run(self) -> None:
        while True:
            time.sleep(self._period)
            with self._lock:
                tasks, self._latest = self._latest, {}
            if tasks:
                self._log.add(to_wire(MetricsEvent(t=time.time(), tasks=tasks)))
