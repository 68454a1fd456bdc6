"""GPU-idle culling: what to do with one GPU server, given its activity report and the admin's rule.

Why a pure function: the decision (warn, wait, stop, leave alone) is the part admins argue about, so it is
tested on its own; the service (`service.py`) only takes the servers' reports and carries out what this says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .config import CullingRule

__all__ = ["NOT_CULLED", "Decision", "decide", "warning_text"]

# "no-data": the server has not reported lately (set by the service, never by `decide`): never culled;
# "unmeasured": a GPU of the server has no utilization now (a MIG instance, an NVML error): never culled
Action = Literal[
    "cpu-only",
    "disabled",
    "unknown",
    "no-data",
    "unmeasured",
    "job-running",
    "active",
    "warn",
    "warned",
    "cull",
]
#: the actions that leave a server alone whatever its idle time says (a warning given is withdrawn)
NOT_CULLED: frozenset[str] = frozenset({"cpu-only", "disabled", "unknown", "no-data", "unmeasured"})


@dataclass(frozen=True)
class Decision:
    action: Action
    idle_s: float | None = None
    cull_at: float | None = None  # set for "warn", "warned" and "cull"


def decide(
    rule: CullingRule | None, report: dict[str, Any], warned_cull_at: float | None, now: float
) -> Decision:
    """`report`: the server's latest report (``gpus``, ``idle_s`` counted against the rule's threshold, None
    when not known, ``jobs_running``, ``unmeasured``: its GPUs whose utilization is not known now);
    `warned_cull_at`: when the server was told it would be stopped. Never "cull" on what is not known."""
    if not report.get("gpus"):
        return Decision("cpu-only")  # the ordinary idle culler's business
    if rule is None or not rule.enabled:
        return Decision("disabled")
    if report.get("unmeasured"):
        return Decision("unmeasured")  # a MIG instance or a failing GPU may be busy: nobody can tell
    idle = report.get("idle_s")
    if not isinstance(idle, (int, float)):
        return Decision("unknown")
    if report.get("jobs_running") and not rule.cull_during_jobs:
        return Decision("job-running", idle)
    limit = rule.idle_minutes * 60.0
    warn = rule.warn_minutes * 60.0
    if idle < limit - warn:
        return Decision("active", idle)
    if warned_cull_at is None:
        # the user always gets the whole warning time, even when the service first sees a long-idle server
        cull_at = now + max(warn, limit - idle)
        return Decision("cull", idle, now) if cull_at <= now else Decision("warn", idle, cull_at)
    if now >= warned_cull_at and idle >= limit:
        return Decision("cull", idle, warned_cull_at)
    return Decision("warned", idle, warned_cull_at)


def warning_text(rule: CullingRule, cull_in_s: float) -> str:
    mins = max(1, round(cull_in_s / 60))
    return (
        f"Your server's GPUs have been below {rule.idle_below_percent:g}% utilization for a while. "
        f"The hub will stop this server in about {mins} minute{'s' if mins != 1 else ''} "
        "(save your work) unless its GPUs are used again."
    )
