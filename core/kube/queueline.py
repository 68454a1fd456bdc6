"""Kueue for `%%tfdist run` jobs, the pure reads: what a queue can ever hold (a job's or a server's refusal
with the numbers, before anything is created), what a job asks of it, and a queued job's place in line.
The objects themselves (queues from the profiles, pod groups) are tfdist.kube.queueing's; the I/O is
tfdist.kube.queueing_apply's."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_FLAVOR = "default"  # CPU, memory and local disk on any node
CPU_RESOURCES = ("cpu", "memory", "ephemeral-storage")
GIB = 2**30


# ------------------------------------------------------------------------------------ never fits: refused


def _parse_quantity(q: str | int | float) -> float:
    """A Kubernetes quantity as a number (cpu in cores, bytes, counts)."""
    s = str(q).strip()
    suffixes = {
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
        "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    }  # fmt: skip
    for suf in sorted(suffixes, key=len, reverse=True):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * suffixes[suf]
    return float(s)


def job_demand(objects: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """What a job's Jobs ask for all together, per resource: each pod template's requests (limits where a
    request is not given, as the API server defaults them) times the Job's parallelism."""
    total: dict[str, float] = {}
    for obj in objects:
        if obj.get("kind") != "Job":
            continue
        spec = obj["spec"]
        n = int(spec.get("parallelism", 1))
        for c in spec["template"]["spec"]["containers"]:
            res = c.get("resources", {})
            amounts = {**res.get("limits", {}), **res.get("requests", {})}
            for name, q in amounts.items():
                total[name] = total.get(name, 0.0) + n * _parse_quantity(q)
    return total


@dataclass(frozen=True)
class Capacity:
    """The most one ClusterQueue can ever hold of one resource of one flavor: its nominal quota plus what it
    may borrow (its borrowing limit, or else every other queue's quota of that flavor in the cohort)."""

    queue: str
    flavor: str
    resource: str
    nominal: float
    borrowable: float

    @property
    def maximum(self) -> float:
        return self.nominal + self.borrowable


def capacities(cluster_queues_: Iterable[Mapping[str, Any]], queue: str) -> list[Capacity]:
    """Capacities of ``queue`` from the ClusterQueue objects of its cohort (as built or as read back)."""
    cqs = {cq["metadata"]["name"]: cq for cq in cluster_queues_}
    mine = cqs.get(queue)
    if mine is None:
        return []
    cohort_name = mine["spec"].get("cohortName")
    peers = [
        cq
        for n, cq in cqs.items()
        if n != queue and cohort_name and cq["spec"].get("cohortName") == cohort_name
    ]

    def nominal_of(cq: Mapping[str, Any], flavor: str, resource: str) -> tuple[float, str | None]:
        for g in cq["spec"].get("resourceGroups", []):
            for f in g.get("flavors", []):
                if f["name"] != flavor:
                    continue
                for r in f.get("resources", []):
                    if r["name"] == resource:
                        lending = r.get("lendingLimit")
                        n = _parse_quantity(r.get("nominalQuota", 0))
                        return (min(n, _parse_quantity(lending)) if lending is not None else n), r.get(
                            "borrowingLimit"
                        )
        return 0.0, None

    out = []
    for g in mine["spec"].get("resourceGroups", []):
        for f in g.get("flavors", []):
            for r in f.get("resources", []):
                nominal = _parse_quantity(r.get("nominalQuota", 0))
                lendable = sum(nominal_of(p, f["name"], r["name"])[0] for p in peers)
                limit = r.get("borrowingLimit")
                borrow = min(lendable, _parse_quantity(limit)) if limit is not None else lendable
                out.append(Capacity(queue, f["name"], r["name"], nominal, borrow))
    return out


def pending_workloads(cluster_queues_: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many Workloads wait in each ClusterQueue (Kueue's own count, ``status.pendingWorkloads``), by
    queue name: the line ahead of a new spawn, as the form shows it."""
    return {
        str(cq["metadata"]["name"]): int((cq.get("status") or {}).get("pendingWorkloads") or 0)
        for cq in cluster_queues_
    }


def flavor_for(flavors: Iterable[Mapping[str, Any]], node_selector: Mapping[str, str] | None) -> str | None:
    """The ResourceFlavor whose node labels a job's GPU node selector asks for (the GPU model's flavor), or
    None when no flavor's labels are all in the selector (then every flavor of the resource counts)."""
    sel = dict(node_selector or {})
    best: tuple[int, str] | None = None
    for f in flavors:
        labels = (f.get("spec") or {}).get("nodeLabels") or {}
        if labels and all(sel.get(k) == v for k, v in labels.items()):
            if best is None or len(labels) > best[0]:
                best = (len(labels), f["metadata"]["name"])
    return best[1] if best else None


def _fmt(resource: str, amount: float) -> str:
    if resource == "memory" or resource == "ephemeral-storage":
        return f"{amount / GIB:g} GiB"
    if resource == "cpu":
        return f"{amount:g} CPUs"
    return f"{amount:g} {resource}"


def refusal(
    demand: Mapping[str, float], caps: Iterable[Capacity], *, gpu_flavor: str | None = None
) -> str | None:
    """Why a job of ``demand`` can never be admitted by its queue (one sentence with the numbers), or None
    when it fits at least once the queue and its cohort are idle. The check Kueue makes too (its Workload
    then says "request > maximum capacity"), made before anything is created. GPUs count against the
    flavor of the job's GPU model (``gpu_flavor``); cpu and memory against ``default``."""
    caps = list(caps)
    if not caps:
        return None
    for resource, amount in sorted(demand.items()):
        if amount <= 0:
            continue
        flavor = DEFAULT_FLAVOR if resource in CPU_RESOURCES else gpu_flavor
        match = [c for c in caps if c.resource == resource and (flavor is None or c.flavor == flavor)]
        if not match:
            if resource in CPU_RESOURCES:
                continue  # not covered here: Kueue's own message says so
            return f"the job needs {_fmt(resource, amount)}, which queue {caps[0].queue} has no quota for" + (
                f" on GPU model {flavor}" if flavor else ""
            )
        best = max(match, key=lambda c: c.maximum)
        if amount > best.maximum + 1e-9 and math.isfinite(best.maximum):
            where = f" of {best.flavor}" if best.flavor != DEFAULT_FLAVOR else ""
            return (
                f"the job needs {_fmt(resource, amount)}{where}, but queue {best.queue} can never hold more "
                f"than {_fmt(resource, best.maximum)} (its quota {_fmt(resource, best.nominal)} + "
                f"{_fmt(resource, best.borrowable)} it may borrow): make the job smaller"
            )
    return None


# ------------------------------------------------------------------------------------------ place in line


@dataclass(frozen=True)
class QueuePosition:
    """Where a queued job waits: 1 is next. ``source`` says where the number comes from: "visibility"
    (Kueue's visibility API: positionInClusterQueue) or "workloads" (the pending Workloads this caller can
    list, in Kueue's order: priority, then the time it entered the queue)."""

    job: str
    queue: str | None
    position: int
    ahead: int
    source: str
    admitted: bool = False

    def event(self) -> Any:
        """The job protocol's QueueEvent (tfdist.job.events) for the cell, `%tfdist list` and the panel."""
        from ..job.events import QueueEvent

        scope = "queue" if self.source == "visibility" else "own"
        return QueueEvent(position=self.position, queue=self.queue, ahead=self.ahead, scope=scope)


def _conditions(wl: Mapping[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in wl.get("status", {}).get("conditions", [])}


def is_admitted(wl: Mapping[str, Any]) -> bool:
    c = _conditions(wl)
    return c.get("QuotaReserved") == "True" or c.get("Admitted") == "True"


def is_finished(wl: Mapping[str, Any]) -> bool:
    return _conditions(wl).get("Finished") == "True"


def _queued_at(wl: Mapping[str, Any]) -> str:
    """When it entered the queue: its last requeue (an evicted workload goes back in at that time) or its
    creation, as RFC 3339 strings (they sort as times)."""
    requeued = [
        c.get("lastTransitionTime", "")
        for c in wl.get("status", {}).get("conditions", [])
        if c["type"] in ("Evicted", "Requeued") and c["status"] == "True"
    ]
    return max([wl["metadata"].get("creationTimestamp", ""), *requeued])


def position_from_workloads(
    workloads: Iterable[Mapping[str, Any]], name: str, namespace: str
) -> QueuePosition | None:
    """The place of Workload ``namespace/name`` among the pending Workloads of its queue, in Kueue's
    BestEffortFIFO order (higher priority first, then earlier queued). None if it is not in the list."""
    wls = list(workloads)
    me = next(
        (w for w in wls if w["metadata"]["name"] == name and w["metadata"].get("namespace") == namespace),
        None,
    )
    if me is None:
        return None
    queue = me.get("spec", {}).get("queueName")
    if is_admitted(me):
        return QueuePosition(name, queue, 0, 0, "workloads", admitted=True)
    pending = [
        w
        for w in wls
        if w.get("spec", {}).get("queueName") == queue and not is_admitted(w) and not is_finished(w)
    ]

    def key(w: Mapping[str, Any]) -> tuple[int, str, str]:
        return (-int(w.get("spec", {}).get("priority") or 0), _queued_at(w), w["metadata"]["name"])

    pending.sort(key=key)
    ahead = next(i for i, w in enumerate(pending) if w is me)
    return QueuePosition(name, queue, ahead + 1, ahead, "workloads")


def position_from_visibility(summary: Mapping[str, Any], name: str, namespace: str) -> QueuePosition | None:
    """The place of ``namespace/name`` in Kueue's visibility answer (PendingWorkloadsSummary of a
    LocalQueue or ClusterQueue). None if it is not pending there."""
    for item in summary.get("items", []):
        meta = item.get("metadata", {})
        if meta.get("name") == name and meta.get("namespace", namespace) == namespace:
            pos = int(item.get("positionInClusterQueue", 0))
            return QueuePosition(name, item.get("localQueueName"), pos + 1, pos, "visibility")
    return None


def workload_refusal(wl: Mapping[str, Any]) -> str | None:
    """Kueue's own verdict that a Workload can never fit (its QuotaReserved condition's message), or None."""
    for c in wl.get("status", {}).get("conditions", []):
        if (
            c["type"] == "QuotaReserved"
            and c["status"] == "False"
            and "maximum capacity" in c.get("message", "")
        ):
            return c["message"]
    return None
