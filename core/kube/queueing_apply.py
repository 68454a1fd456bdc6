"""Kueue for `%%tfdist run` jobs, the I/O part: converge the cluster's Kueue objects and a user's
LocalQueues on the admin's profiles, and read a job's place in line. The objects themselves come from
tfdist.kube.queueing (pure).

Converging is idempotent: an object is created, replaced whole when its spec or labels differ (PUT with the
live resourceVersion), left alone when equal; objects this project made (label part-of=tfdist-queues) that
the profiles no longer name are deleted. Running it on every hub start and every spawn is cheap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import queueing as q
from . import queueline as ql
from .queuepace import QueuePace

if TYPE_CHECKING:
    from ..spawner.profiles import ProfilesConfig

_BASE = "/apis/kueue.x-k8s.io/v1beta2"
_PLURAL = {
    "ResourceFlavor": "resourceflavors",
    "Cohort": "cohorts",
    "ClusterQueue": "clusterqueues",
    "LocalQueue": "localqueues",
    "WorkloadPriorityClass": "workloadpriorityclasses",
}
_SELECTOR = "app.kubernetes.io/part-of=" + q.MANAGED["app.kubernetes.io/part-of"]
VISIBILITY = "/apis/visibility.kueue.x-k8s.io/v1beta2"
# the label Kueue puts on the Workload it makes for a job or a single pod: that object's UID
JOB_UID = "kueue.x-k8s.io/job-uid"


@dataclass
class Converged:
    """What one converge changed (names as kind/name)."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


async def _call(api: Any, method: str, path: str, body: Any = None, query: list | None = None) -> dict:
    data = await api.call_api(
        path,
        method,
        query_params=query or [],
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        body=body,
        response_types_map={200: "object", 201: "object"},
        auth_settings=["BearerToken"],
        _return_http_data_only=True,
    )
    return data if isinstance(data, dict) else {}


def _collection(kind: str, namespace: str | None = None) -> str:
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{_BASE}{ns}/{_PLURAL[kind]}"


async def _apply(api: Any, obj: dict[str, Any], out: Converged) -> None:
    from kubernetes_asyncio.client.exceptions import ApiException

    meta = obj["metadata"]
    coll = _collection(obj["kind"], meta.get("namespace"))
    what = f"{obj['kind']}/{meta['name']}"
    try:
        await _call(api, "POST", coll, obj)
        out.created.append(what)
        return
    except ApiException as exc:
        if exc.status != 409:
            raise
    live = await _call(api, "GET", f"{coll}/{meta['name']}")
    same_labels = q.covers(meta["labels"], live["metadata"].get("labels")) and q.covers(
        meta.get("annotations", {}), live["metadata"].get("annotations") or {}
    )
    if same_labels and q.covers(_body(obj), _body(live)):
        out.unchanged.append(what)
        return
    new = {**obj, "metadata": {**meta, "resourceVersion": live["metadata"]["resourceVersion"]}}
    await _call(api, "PUT", f"{coll}/{meta['name']}", new)
    out.updated.append(what)


def _body(obj: dict[str, Any]) -> dict[str, Any]:
    """What an object says beyond its identity: its spec, or (a WorkloadPriorityClass has none) its
    top-level fields."""
    if "spec" in obj:
        return obj["spec"]
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}


async def _prune(api: Any, kind: str, keep: set[str], out: Converged, namespace: str | None = None) -> None:
    coll = _collection(kind, namespace)
    live = await _call(api, "GET", coll, query=[("labelSelector", _SELECTOR)])
    for item in live.get("items", []):
        name = item["metadata"]["name"]
        if name not in keep:
            await _call(api, "DELETE", f"{coll}/{name}")
            out.deleted.append(f"{kind}/{name}")


async def converge(api: Any, cfg: ProfilesConfig) -> Converged:
    """The cluster's flavors, cohort and ClusterQueues as the profiles say (queues first deleted, then
    flavors, so nothing named is removed while a queue still names it)."""
    out = Converged()
    objs = q.cluster_objects(cfg)
    for obj in objs:
        await _apply(api, obj, out)
    for kind in ("ClusterQueue", "Cohort", "ResourceFlavor", "WorkloadPriorityClass"):
        keep = {o["metadata"]["name"] for o in objs if o["kind"] == kind}
        await _prune(api, kind, keep, out)
    return out


async def converge_user(api: Any, cfg: ProfilesConfig, namespace: str, groups: list[str]) -> Converged:
    """One user's LocalQueues as their profiles say (run on each spawn, beside the namespace's quota)."""
    out = Converged()
    objs = q.local_queues(cfg, namespace, groups)
    for obj in objs:
        await _apply(api, obj, out)
    await _prune(api, "LocalQueue", {o["metadata"]["name"] for o in objs}, out, namespace)
    return out


async def cluster_queues(api: Any) -> list[dict[str, Any]]:
    """Every ClusterQueue (for tfdist.kube.queueline.capacities: a job's refusal before it is created)."""
    return (await _call(api, "GET", _collection("ClusterQueue"))).get("items", [])


async def pending_by_queue(api: Any) -> dict[str, int]:
    """Workloads waiting per ClusterQueue (tfdist.kube.queueline.pending_workloads): one list."""
    return ql.pending_workloads(await cluster_queues(api))


async def queue_refusal(
    api: Any, namespace: str, queue: str, demand: dict[str, float], node_selector: dict[str, str] | None
) -> str | None:
    """Why a job of ``demand`` can never be admitted by its queue (tfdist.kube.queueline.refusal), GPUs
    counted on the flavor of the job's node selector, or None. The live ClusterQueues and flavors where the
    caller may read them (an admin), else the limits the hub wrote on the user's LocalQueue (A_LIMITS).
    None where neither is there (no Kueue, no LocalQueue): Kueue's Workload then says it once the pods
    exist."""
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        cqs = await cluster_queues(api)
        flavors = (await _call(api, "GET", _collection("ResourceFlavor"))).get("items", [])
        caps = ql.capacities(cqs, queue)
    except ApiException as exc:
        if exc.status not in (403, 404):
            raise
        try:
            lq = await _call(api, "GET", f"{_collection('LocalQueue', namespace)}/{queue}")
        except ApiException as exc2:
            if exc2.status in (403, 404):
                return None
            raise
        got = q.limits_from_annotation(lq)
        if got is None:
            return None
        caps, flavors = got
    return ql.refusal(demand, caps, gpu_flavor=ql.flavor_for(flavors, node_selector))


async def workload_of(api: Any, namespace: str, group: str) -> dict[str, Any] | None:
    """The Workload Kueue made for a job's pod group (named after the group), or None yet."""
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        return await _call(api, "GET", f"{_BASE}/namespaces/{namespace}/workloads/{group}")
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def read_position(api: Any, namespace: str, group: str, queue: str) -> ql.QueuePosition | None:
    """A job's place in line: Kueue's visibility API (the LocalQueue's pending workloads, what a user may
    read) where the cluster serves it, else its own namespace's Workloads. None when its Workload does not
    exist (yet)."""
    wl = await workload_of(api, namespace, group)
    if wl is None:
        return None
    if ql.is_admitted(wl):
        return ql.QueuePosition(group, queue, 0, 0, "workloads", admitted=True)
    return await _place(api, namespace, group, queue)


async def _place(api: Any, namespace: str, name: str, queue: str) -> ql.QueuePosition | None:
    """Workload `namespace/name`'s place in its ClusterQueue from Kueue's visibility API (other users'
    jobs counted), else among the namespace's own Workloads. Never a list of every namespace's: their
    number is other users' doing, and the hub asks every 2 s while a server waits."""
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        summary = await _call(
            api, "GET", f"{VISIBILITY}/namespaces/{namespace}/localqueues/{queue}/pendingworkloads"
        )
        pos = ql.position_from_visibility(summary, name, namespace)
        if pos is not None:
            return pos
    except ApiException as exc:
        if exc.status not in (403, 404, 503):
            raise
    items = (await _call(api, "GET", f"{_BASE}/namespaces/{namespace}/workloads")).get("items", [])
    return ql.position_from_workloads(items, name, namespace)


@dataclass(frozen=True)
class PodWait:
    """A pod Kueue has not admitted yet (a GPU notebook server): its place and Kueue's reason."""

    position: ql.QueuePosition
    reason: str


async def pod_wait(api: Any, namespace: str, pod_uid: str) -> PodWait | None:
    """Where a single pod (a notebook server with a queue label: Kueue makes it a Workload of its own,
    labelled with the pod's UID) waits in line, and why (Kueue's QuotaReserved message), or None when it
    has no Workload (yet) or is admitted. Reads the pod's own namespace and its LocalQueue's place in the
    ClusterQueue: one small answer however many Workloads other users keep."""
    found = await _call(
        api,
        "GET",
        f"{_BASE}/namespaces/{namespace}/workloads",
        query=[("labelSelector", f"{JOB_UID}={pod_uid}")],
    )
    mine = next(
        (
            w
            for w in found.get("items", [])
            if any(o.get("uid") == pod_uid for o in w["metadata"].get("ownerReferences", []))
        ),
        None,
    )
    if mine is None or ql.is_admitted(mine):
        return None
    queue = mine.get("spec", {}).get("queueName") or ""
    pos = await _place(api, namespace, mine["metadata"]["name"], queue)
    if pos is None:
        return None
    reason = next(
        (
            c.get("message", "")
            for c in mine.get("status", {}).get("conditions", [])
            if c["type"] == "QuotaReserved" and c["status"] == "False"
        ),
        "",
    )
    return PodWait(pos, reason)


async def queue_events(
    api: Any, namespace: str, group: str, queue: str, every_s: float = 2.0
) -> AsyncIterator[Any]:
    """The job's place in line while it waits: a QueueEvent (tfdist.job.events) whenever it changes, with
    the wait estimated from the line's pace so far (tfdist.kube.queuepace); ends
    once Kueue admits it, and at once where the queue's LocalQueue is not there or the caller may not read
    it or the Workloads (403). A failed read is tried again on the next tick: the queue is news, never a
    reason to fail the job."""
    from kubernetes_asyncio.client.exceptions import ApiException

    try:  # no such LocalQueue here (no Kueue in the cluster, or not this queue): no line to stand in
        await _call(api, "GET", f"{_collection('LocalQueue', namespace)}/{queue}")
    except ApiException as exc:
        if exc.status in (403, 404):
            return
    last: tuple[int, int] | None = None
    pace = QueuePace()  # the estimate: how fast this line has moved since the job joined it
    while True:
        try:
            pos = await read_position(api, namespace, group, queue)
        except ApiException as exc:
            if exc.status == 403:
                return
            pos = None
        except Exception:  # a connection lost for a moment: try again on the next tick
            pos = None
        if pos is not None and pos.admitted:
            return
        if pos is not None:  # a place counted another way (the visibility API lost or back) starts anew
            pace.see_counted(time.time(), pos.position, pos.source)
        if pos is not None and (pos.position, pos.ahead, pos.source) != last:  # what it counts, too
            last = (pos.position, pos.ahead, pos.source)
            yield pos.event().model_copy(update={"wait_s": pace.wait_s(time.time())})
        await asyncio.sleep(every_s)
