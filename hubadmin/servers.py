"""What the GPU admin service knows of one running server: its GPUs, the samples it reported (the page's
sparklines), its jobs, the culler's last decision, and the reports refused from it.

Why a record per server and not per report: a report may be late, partial or refused; the page and the
culler read one consistent state, and a time nobody measured is never counted as idle.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .culler import Decision
from .report import ActivityReport, GpuRecord, JobRecord, NoticeRecord

__all__ = ["HISTORY_S", "SPARK_POINTS", "ServerRecord", "UnknownServer", "unmeasured_reason"]

HISTORY_S = 3600.0  # the admin page's sparklines
SPARK_POINTS = 60


class UnknownServer(LookupError):
    """A report from a server the hub does not list as running (not ready yet, or stopped)."""


@dataclass
class ServerRecord:
    user: str
    name: str  # "" for the default server
    profile: str | None
    gpu_model: str | None
    url: str  # path on the proxy, e.g. /user/alice/
    gpus: list[GpuRecord] = field(default_factory=list)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4000))
    points: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4000))
    idle_s: float | None = None
    jobs_running: list[JobRecord] = field(default_factory=list)
    decision: Decision | None = None
    warned_cull_at: float | None = None
    notice: NoticeRecord | None = None  # what the server's next report is answered with
    refused: str | None = None  # why its last report was refused (cleared by the next good one)
    refusals: int = 0  # reports refused since the hub started: a misbehaving reporter stays visible
    last_refusal: tuple[float, str] | None = None  # when and why, kept after a good report
    seen: float = 0.0  # when its last report was accepted (0: never)
    asked_s: float = 30.0  # the report interval it was last asked for
    last_cull_check: float = 0.0
    started: str | None = None  # the hub's start time of this server: a restart at the same URL is new
    gpus_given: int | None = None  # what the spawner gave it (None: not known); a report of more is refused
    missed: int = 0  # reads of the hub's servers in a row that did not list it

    @property
    def key(self) -> str:
        return f"{self.user}/{self.name}"

    def fresh(self, now: float) -> bool:
        """A report recent enough to act on: three missed reports (and some slack) make it stale."""
        return self.seen > 0 and now - self.seen <= 3 * self.asked_s + 15

    def no_data_reason(self, now: float) -> str | None:
        if self.fresh(now):
            return self.refused and f"last report refused: {self.refused}"
        why = "never reported" if not self.seen else f"no report for {now - self.seen:.0f} s"
        if self.refused:
            why += f"; last report refused: {self.refused}"
        return f"no data ({why}); not culled"

    def last_utils(self, now: float) -> list[float | None]:
        if not self.history or not self.fresh(now):
            return [None] * len(self.gpus)
        return list(self.history[-1][1])

    def unmeasured(self, now: float) -> list[str]:
        """This server's GPUs whose utilization is not known now, each in words (all of them when no recent
        sample came): what keeps the culler from stopping it."""
        if not self.gpus:
            return []
        if not self.history or now - self.history[-1][0] > 3 * self.asked_s + 60:
            return ["no recent GPU sample"]
        utils = list(self.history[-1][1])
        return [
            f"{g.label}: " + ("not measurable on a MIG instance" if g.is_mig else "utilization not read")
            for g, u in zip(self.gpus, utils + [None] * (len(self.gpus) - len(utils)), strict=False)
            if u is None
        ]

    def measured_idle_s(self, now: float) -> float | None:
        """The reported idle time, but no longer than since the last sample in which a GPU had no
        utilization: a time nobody measured is never counted as idle."""
        if self.idle_s is None:
            return None
        for t, utils, _ in reversed(self.history):
            if len(utils) < len(self.gpus) or any(u is None for u in utils):
                return max(0.0, min(self.idle_s, now - t))
        return self.idle_s

    def last_mem(self, now: float) -> list[float | None]:
        if not self.history or not self.fresh(now):
            return [None] * len(self.gpus)
        return list(self.history[-1][2])

    def add(self, t: float, utils: list[float | None], mems: list[float | None]) -> None:
        """One sample; the sparkline's point (max utilization, summed memory) is made here, once."""
        self.history.append((t, utils, mems))
        us = [x for x in utils if x is not None]
        ms = [x for x in mems if x is not None]
        self.points.append((t, max(us) if us else None, sum(ms) if ms else None))

    def spark(self, now: float) -> dict[str, list[float | None]]:
        """Times, max utilization and memory used (MiB, summed over GPUs) for the last hour, at most
        SPARK_POINTS each: three flat lists keep 200 servers' JSON small."""
        cut = now - HISTORY_S
        pts = [p for p in self.points if p[0] >= cut]
        pts = pts[:: max(1, -(-len(pts) // SPARK_POINTS))]
        return {
            "t": [round(p[0]) for p in pts],
            "util": [None if p[1] is None else round(p[1], 1) for p in pts],
            "mem": [None if p[2] is None else round(p[2]) for p in pts],
        }

    def overclaim(self, rep: ActivityReport) -> str | None:
        """Why a report's GPUs cannot be this server's: more than it was given (its user's own code writes
        the report, and the page's and the metrics' held and free counts add them up)."""
        if self.gpus_given is not None and len(rep.gpus) > self.gpus_given:
            return f"reports {len(rep.gpus)} GPUs, but the server was given {self.gpus_given}"
        return None

    def take(self, rep: ActivityReport, threshold: float, now: float) -> None:
        """An accepted report. Its idle time counts only when measured against this server's threshold."""
        self.gpus = list(rep.gpus)
        self.idle_s = rep.idle_s if rep.busy_percent == threshold else None
        self.jobs_running = list(rep.jobs_running)
        last_t = self.history[-1][0] if self.history else None
        for s in sorted(rep.samples, key=lambda s: s.t):
            if last_t is None or s.t > last_t:
                self.add(s.t, list(s.util), list(s.mem))
                last_t = s.t
        self.seen = now
        self.refused = None


def unmeasured_reason(rec: ServerRecord, now: float) -> str | None:
    """Why the culler leaves a reporting server alone, in words, when it is for lack of a measurement."""
    if rec.decision is None or rec.decision.action != "unmeasured":
        return None
    return "GPU utilization not measured (" + "; ".join(rec.unmeasured(now)) + "); not culled"
