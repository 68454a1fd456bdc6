"""Free GPUs per model on Kubernetes: nodes' allocatable GPUs minus the GPU requests of pods on them.

Two layers, so the arithmetic is testable without a cluster and the cluster is never listed per request:
- pure functions over Kubernetes API objects as plain dicts (`node_info`, `pod_usage`, `gpu_availability`);
- `ClusterGpuView`: one list-then-watch per kind (nodes, pods in all namespaces) per hub, kept as compact
  records, shared by every spawner. A form render reads the cache; it never calls the API server.

What counts: a node offers a model's GPUs when its labels match the model's node selector, it is
schedulable and Ready, and every NoSchedule/NoExecute taint on it is tolerated by the model's tolerations.
A pod uses GPUs on its node while it is bound (``spec.nodeName``) and not Succeeded/Failed; its use of a
resource is max(sum over containers, max over init containers), a container's use being its request, or
its limit when no request is given (Kubernetes defaults extended-resource requests to the limit).

Besides the total free per model, the largest number free on any one offering node (`max_on_node`): a
notebook pod's GPUs must all come from one node, so 11 free across nodes with at most 5 on one node
cannot hold a request for 8. Cordoned, not-Ready and untolerated-taint nodes offer nothing, so they
count for neither number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tfdist.quantity import parse_quantity as _parse_quantity

from .allocator import ModelAvailability
from .profiles import GpuModel

__all__ = [
    "ClusterGpuView",
    "NodeInfo",
    "PodUsage",
    "gpu_availability",
    "largest_node",
    "node_info",
    "parse_quantity",
    "pod_usage",
]

STALE_AFTER_BACKOFF_S = 8.0  # after 0.5+1+2+4 s of failed retries (~7.5 s)
LIST_PAGE = 500  # objects per list request of the GPU view
log = logging.getLogger(__name__)


def parse_quantity(q: Any) -> float:
    """A quantity as a number; what does not parse counts as 0 (a node's odd field must not hide the rest)."""
    try:
        return _parse_quantity(q)
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class NodeInfo:
    """What availability needs of a node."""

    name: str
    labels: Mapping[str, str]
    allocatable: Mapping[str, float]
    taints: tuple[tuple[str, str, str], ...]  # (key, value, effect) of NoSchedule/NoExecute taints
    schedulable: bool
    addresses: tuple[str, ...] = ()  # its InternalIP and ExternalIP addresses (the egress policy's)


@dataclass(frozen=True)
class PodUsage:
    """The extended resources a bound, live pod holds on its node."""

    node: str
    resources: Mapping[str, float] = field(default_factory=dict)


def node_info(node: Mapping[str, Any]) -> NodeInfo:
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in (status.get("conditions") or [])
    )
    taints = tuple(
        (str(t.get("key", "")), str(t.get("value", "") or ""), str(t.get("effect", "")))
        for t in (spec.get("taints") or [])
        if t.get("effect") in ("NoSchedule", "NoExecute")
    )
    return NodeInfo(
        name=str(meta.get("name", "")),
        labels=dict(meta.get("labels") or {}),
        allocatable={k: parse_quantity(v) for k, v in (status.get("allocatable") or {}).items() if "/" in k},
        taints=taints,
        schedulable=ready and not spec.get("unschedulable", False),
        addresses=tuple(
            str(a.get("address", ""))
            for a in (status.get("addresses") or [])
            if a.get("type") in ("InternalIP", "ExternalIP") and a.get("address")
        ),
    )


def pod_usage(pod: Mapping[str, Any]) -> PodUsage | None:
    """None for pods that hold nothing: not bound yet, finished, or asking for no extended resource."""
    spec = pod.get("spec") or {}
    node = spec.get("nodeName")
    if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None

    def use(container: Mapping[str, Any]) -> dict[str, float]:
        res = container.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        return {k: parse_quantity(req.get(k, lim.get(k))) for k in {*req, *lim} if "/" in k}

    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        for k, v in use(c).items():
            total[k] = total.get(k, 0.0) + v
    for c in spec.get("initContainers") or []:
        for k, v in use(c).items():
            total[k] = max(total.get(k, 0.0), v)
    total = {k: v for k, v in total.items() if v > 0}
    return PodUsage(node=str(node), resources=total) if total else None


def _tolerates(model: GpuModel, taint: tuple[str, str, str]) -> bool:
    key, value, effect = taint
    for t in model.tolerations:
        if t.effect not in (None, effect):
            continue
        if t.key is None and t.operator == "Exists":
            return True
        if t.key == key and (t.operator == "Exists" or (t.value or "") == value):
            return True
    return False


def _offers(model: GpuModel, node: NodeInfo) -> bool:
    if not node.schedulable or node.allocatable.get(model.resource, 0) <= 0:
        return False
    if any(node.labels.get(k) != v for k, v in model.node_selector.items()):
        return False
    return all(_tolerates(model, t) for t in node.taints)


def availability_from(
    nodes: Iterable[NodeInfo], usages: Iterable[PodUsage], models: Mapping[str, GpuModel]
) -> dict[str, ModelAvailability]:
    used: dict[tuple[str, str], float] = {}
    resources = {m.resource for m in models.values()}
    for u in usages:
        for res, n in u.resources.items():
            if res in resources:
                used[(u.node, res)] = used.get((u.node, res), 0.0) + n
    node_list = list(nodes)
    out = {}
    for key, model in models.items():
        free = total = most = 0
        for node in node_list:
            if _offers(model, node):
                alloc = int(node.allocatable[model.resource])
                total += alloc
                here = max(alloc - int(used.get((node.name, model.resource), 0)), 0)
                free += here
                most = max(most, here)
        out[key] = ModelAvailability(free=free, total=total, max_on_node=most)
    return out


def largest_node(nodes: Iterable[NodeInfo], models: Mapping[str, GpuModel]) -> dict[str, int]:
    """The most GPUs of each model one offering node has in all (free or not): a server asking for more
    can never start, however long it waits in a queue (its GPUs must all be on one node)."""
    node_list = list(nodes)
    return {
        key: max(
            (int(n.allocatable[m.resource]) for n in node_list if _offers(m, n)),
            default=0,
        )
        for key, m in models.items()
    }


def gpu_availability(
    nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]], models: Mapping[str, GpuModel]
) -> dict[str, ModelAvailability]:
    """Free/total GPUs (and the most free on one node) per model key from node and pod objects (dicts as
    the API returns them)."""
    usages = [u for u in (pod_usage(p) for p in pods) if u is not None]
    return availability_from((node_info(n) for n in nodes), usages, models)


class ClusterGpuView:
    """One shared, watch-fed cache of nodes and GPU-holding pods.

    `api` is a kubernetes_asyncio CoreV1Api. Each kind is listed once, then watched from that
    resourceVersion; a watch the server ends is resumed from the last resourceVersion (no new list), an
    expired one (410) is listed again at once, a failing one with capped exponential backoff (0.5 s .. 30 s)
    (tested against a real API server in tests/test_k8s_spawner.py). Until the
    first list of both kinds has arrived `loaded` is False and the form says availability is unknown
    (validation then leaves the decision to the scheduler instead of blocking spawns).
    """

    def __init__(self, api: Any, *, watch_timeout: int = 300) -> None:
        self.api = api
        self.watch_timeout = watch_timeout
        self.nodes: dict[str, NodeInfo] = {}
        self.pods: dict[str, PodUsage] = {}
        self._loaded = {"nodes": False, "pods": False}
        self._tasks: list[asyncio.Task[None]] = []
        self._cache: tuple[int, Mapping[str, GpuModel], dict[str, ModelAvailability]] | None = None
        self._version = 0

    @property
    def loaded(self) -> bool:
        return all(self._loaded.values())

    # event application, separate from I/O so it is testable
    def apply_node(self, event_type: str, obj: Mapping[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        if event_type == "DELETED":
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = node_info(obj)
        self._version += 1

    def apply_pod(self, event_type: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        usage = None if event_type == "DELETED" else pod_usage(obj)
        if usage is None:
            if self.pods.pop(key, None) is not None:
                self._version += 1
        else:
            self.pods[key] = usage
            self._version += 1

    def availability(self, models: Mapping[str, GpuModel]) -> dict[str, ModelAvailability] | None:
        """Cached per cluster change: many form renders between two pod events cost one computation."""
        if not self.loaded:
            return None
        c = self._cache
        if c is None or c[0] != self._version or c[1] is not models:
            c = self._cache = (
                self._version,
                models,
                availability_from(self.nodes.values(), self.pods.values(), models),
            )
        return c[2]

    def largest_node(self, models: Mapping[str, GpuModel]) -> dict[str, int] | None:
        """`largest_node` of the watched nodes; None until they are loaded."""
        return largest_node(self.nodes.values(), models) if self.loaded else None

    def node_addresses(self) -> tuple[str, ...] | None:
        """Every watched node's addresses; None until the nodes are loaded."""
        if not self._loaded["nodes"]:
            return None
        return tuple(dict.fromkeys(a for n in self.nodes.values() for a in n.addresses))

    # I/O
    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.ensure_future(self._reflect("nodes", self.api.list_node, self.apply_node)),
                asyncio.ensure_future(
                    self._reflect("pods", self.api.list_pod_for_all_namespaces, self.apply_pod)
                ),
            ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    async def _reflect(self, kind: str, list_fn: Any, apply: Any) -> None:
        """List once, then watch from the list's resourceVersion for as long as the server allows.

        A watch the server ends (``timeout_seconds``) is resumed from the last resourceVersion seen
        (bookmarks keep it fresh), so a quiet cluster costs one watch request per ``watch_timeout`` and no
        list; only an expired resourceVersion (410 Gone) or an error makes a new list.
        """
        from kubernetes_asyncio.client.exceptions import ApiException

        kwargs: dict[str, Any] = {}
        if kind == "pods":
            # only pods that hold GPUs: bound to a node, not finished (a watch says ADDED when one binds)
            kwargs["field_selector"] = "status.phase!=Succeeded,status.phase!=Failed,spec.nodeName!="
        delay = 0.5
        rv: str | None = None
        while True:
            try:
                if rv is None:
                    rv = await self._list(kind, list_fn, apply, kwargs)
                    delay = 0.5
                rv = await self._watch(list_fn, rv, apply, kwargs)
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                rv = None
                if e.status == 410:  # resourceVersion too old: list again, now
                    log.info("GPU availability: %s watch expired (410); listing again", kind)
                    continue
                self._note_failure(kind, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
            except Exception as e:
                rv = None
                self._note_failure(kind, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _note_failure(self, kind: str, exc: Exception, delay: float) -> None:
        log.warning("GPU availability: %s watch failed (%s); retrying in %.1fs", kind, exc, delay)
        if delay >= STALE_AFTER_BACKOFF_S and self._loaded[kind]:
            # failing for a while: old numbers must not refuse spawns; the form says "unknown" until a relist
            log.warning("GPU availability: %s view is stale; showing availability as unknown", kind)
            self._loaded[kind] = False

    async def _list(self, kind: str, list_fn: Any, apply: Any, kwargs: dict[str, Any]) -> str:
        import json

        # in pages: how many pods the cluster holds is its users' doing, and one answer of all of them
        # would be read and parsed whole in the hub's event loop (the pages are one snapshot: its version)
        items: list[dict[str, Any]] = []
        token: str | None = None
        version = ""
        while True:
            page = {"limit": LIST_PAGE} | ({"_continue": token} if token else {})
            resp = await list_fn(_preload_content=False, **kwargs, **page)
            data = json.loads(await resp.read())
            items += data.get("items") or []
            meta = data.get("metadata") or {}
            version = version or str(meta["resourceVersion"])
            token = meta.get("continue")
            if not token:
                break
        if kind == "nodes":
            self.nodes = {}
        else:
            self.pods = {}
        self._version += 1
        for item in items:
            apply("ADDED", item)
        self._loaded[kind] = True
        return version

    async def _watch(self, list_fn: Any, rv: str, apply: Any, kwargs: dict[str, Any]) -> str:
        """One watch request from `rv`; returns the last resourceVersion seen when the server ends it."""
        from kubernetes_asyncio import watch

        # "object": events stay plain dicts (no model deserialization per event; apply reads raw_object)
        w = watch.Watch(return_type="object")
        async with w.stream(
            list_fn,
            resource_version=rv,
            timeout_seconds=self.watch_timeout,
            allow_watch_bookmarks=True,
            **kwargs,
        ) as stream:
            async for ev in stream:
                if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    apply(ev["type"], ev.get("raw_object") or {})
        return str(w.resource_version or rv)
