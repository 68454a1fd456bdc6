"""The admin page's data, pure: one row per server and totals per GPU model, from the service's records.

Kept apart from the service's I/O (the hub's API, reports, culling) so what an admin sees can be built and
tested from records alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .servers import ServerRecord, unmeasured_reason


def page_view(
    records: Iterable[ServerRecord],
    threshold: Callable[[ServerRecord], float],
    model_names: dict[str, str],
    machine_gpus: list[str] | None,
    refreshed: float,
    now: float,
) -> dict[str, Any]:
    """`threshold(rec)`: the utilization (%) at which that server's GPUs count as busy; `machine_gpus`: this
    machine's GPU models, one entry per GPU (None: not known, so no free count)."""
    rows = []
    totals: dict[str, dict[str, Any]] = {}
    for rec in sorted(records, key=lambda r: (r.user, r.name)):
        utils = rec.last_utils(now)
        thr = threshold(rec)
        for g, u in zip(rec.gpus, utils + [None] * (len(rec.gpus) - len(utils)), strict=False):
            name = g.name or "?"
            t = totals.setdefault(name, {"model": name, "held": 0, "busy": 0})
            t["held"] += 1
            if u is not None and u >= thr:
                t["busy"] += 1
        fresh = rec.fresh(now)
        rows.append(
            {
                "user": rec.user,
                "server": rec.name,
                "profile": rec.profile,
                "gpu_model": model_names.get(rec.gpu_model or "", rec.gpu_model),
                "gpus": [
                    {"index": g.index, "name": g.name, "uuid": g.uuid, "label": g.label} for g in rec.gpus
                ],
                "util": utils,
                # per GPU, what the page shows: "35%", "n/a (MIG)" (NVML cannot measure it), "—"
                "util_text": [
                    f"{u:.0f}%" if u is not None else "n/a (MIG)" if g.is_mig else "\u2014"
                    for g, u in zip(rec.gpus, utils + [None] * len(rec.gpus), strict=False)
                ],
                "mem_mib": rec.last_mem(now),
                "idle_s": rec.idle_s if fresh else None,
                "jobs": [j.model_dump() for j in rec.jobs_running] if fresh else [],
                "action": (rec.decision.action if rec.decision else None) if fresh else "no-data",
                "reason": unmeasured_reason(rec, now) if fresh else None,
                "cull_at": rec.warned_cull_at,
                "error": rec.no_data_reason(now),
                "refusals": (
                    {"count": rec.refusals, "at": rec.last_refusal[0], "why": rec.last_refusal[1]}
                    if rec.last_refusal
                    else None
                ),
                "spark": rec.spark(now),
            }
        )
    for name in machine_gpus or []:
        totals.setdefault(name, {"model": name, "held": 0, "busy": 0})
    for t in totals.values():
        t["free"] = None if machine_gpus is None else max(0, machine_gpus.count(t["model"]) - t["held"])
    return {
        "now": now,
        "refreshed": refreshed,
        "servers": rows,
        "totals": sorted(totals.values(), key=lambda t: t["model"]),
    }
