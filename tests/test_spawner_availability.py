"""Free GPUs on Kubernetes from node and pod objects, and the watch-fed cache's event handling."""

from __future__ import annotations

from typing import Any

from tfdist.spawner.availability import ClusterGpuView, gpu_availability, parse_quantity
from tfdist.spawner.profiles import GpuModel

H100 = GpuModel(
    display_name="H100",
    node_selector={"nvidia.com/gpu.product": "H100"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
)
MIG = GpuModel(display_name="MIG", resource="nvidia.com/mig-1g.10gb", node_selector={"mig": "yes"})
MODELS = {"h100": H100, "mig": MIG}


def node(name: str, product: str = "H100", gpus: str = "8", **kw: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.product": product, **kw.get("labels", {})}},
        "spec": {
            "taints": kw.get(
                "taints", [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
            ),
            "unschedulable": kw.get("unschedulable", False),
        },
        "status": {
            "allocatable": {"cpu": "64", "nvidia.com/gpu": gpus, **kw.get("extra", {})},
            "conditions": [{"type": "Ready", "status": kw.get("ready", "True")}],
        },
    }


def pod(name: str, node_name: str | None, gpus: int, phase: str = "Running", init: int = 0) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if node_name:
        spec["nodeName"] = node_name
    if init:
        spec["initContainers"] = [{"resources": {"requests": {"nvidia.com/gpu": str(init)}}}]
    return {"metadata": {"namespace": "ns", "name": name}, "spec": spec, "status": {"phase": phase}}


def test_allocatable_minus_requests_per_model() -> None:
    nodes = [
        node("a"),
        node("b"),
        node("c", product="A100"),
        node("cordoned", unschedulable=True),
        node("notready", ready="False"),
        node("untolerated", taints=[{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]),
        node(
            "m",
            product="none",
            gpus="0",
            labels={"mig": "yes"},
            extra={"nvidia.com/mig-1g.10gb": "7"},
            taints=[],
        ),
    ]
    pods = [
        pod("p1", "a", 3),
        pod("p2", "a", 2),
        pod("p3", "b", 8),
        pod("done", "b", 8, phase="Succeeded"),
        pod("pending", None, 4),
        pod("init", "a", 1, init=2),
        {
            "metadata": {"namespace": "ns", "name": "mig1"},
            "spec": {
                "nodeName": "m",
                "containers": [{"resources": {"requests": {"nvidia.com/mig-1g.10gb": "2"}}}],
            },
            "status": {"phase": "Running"},
        },
    ]
    av = gpu_availability(nodes, pods, MODELS)
    # a: 8 - (3 + 2 + max(1, 2)) = 1; b: 8 - 8 = 0; others excluded
    assert (av["h100"].free, av["h100"].total) == (1, 16)
    assert (av["mig"].free, av["mig"].total) == (5, 7)


def test_quantities() -> None:
    assert parse_quantity("8") == 8 and parse_quantity("1k") == 1000 and parse_quantity("500m") == 0.5
    assert parse_quantity("junk") == 0 and parse_quantity(2) == 2


def test_view_applies_watch_events_and_caches() -> None:
    view = ClusterGpuView(api=None)
    assert view.availability(MODELS) is None  # not loaded: "unknown" in the form
    view.apply_node("ADDED", node("a"))
    view.apply_pod("ADDED", pod("p1", "a", 3))
    view._loaded = {"nodes": True, "pods": True}
    first = view.availability(MODELS)
    assert first is not None and first["h100"].free == 5
    assert view.availability(MODELS) is first  # no change, no recomputation
    view.apply_pod("MODIFIED", pod("p1", "a", 3, phase="Succeeded"))
    assert view.availability(MODELS)["h100"].free == 8
    view.apply_pod("ADDED", pod("p2", "a", 6))
    view.apply_node("DELETED", node("a"))
    assert view.availability(MODELS)["h100"].total == 0


def test_most_free_on_one_node_ignores_nodes_that_cannot_take_the_pod() -> None:
    """11 free in total, at most 5 on one usable node: the cordoned, not-Ready and untolerated-taint
    nodes have all 8 free but count for neither number."""
    nodes = [
        node("a"),
        node("b"),
        node("c", gpus="4"),
        node("cordoned", unschedulable=True),
        node("notready", ready="False"),
        node("untolerated", taints=[{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]),
        node("prefer", taints=[{"key": "dedicated", "value": "x", "effect": "PreferNoSchedule"}]),
    ]
    pods = [pod("p1", "a", 3), pod("p2", "b", 5), pod("p3", "c", 1), pod("p4", "prefer", 6)]
    av = gpu_availability(nodes, pods, MODELS)["h100"]
    # a: 5, b: 3, c: 3, prefer (a soft taint does not keep the pod off): 2
    assert (av.free, av.total, av.max_on_node) == (13, 28, 5)
    pods.append(pod("p5", "a", 1))
    av = gpu_availability(nodes, pods, MODELS)["h100"]
    assert (av.free, av.max_on_node) == (12, 4)
    # no offering node at all: 0, not None (None means "not applicable": the embedded hub)
    assert gpu_availability([node("x", unschedulable=True)], [], MODELS)["h100"].max_on_node == 0


def test_view_tracks_most_free_on_one_node() -> None:
    view = ClusterGpuView(api=None)
    view.apply_node("ADDED", node("a"))
    view.apply_node("ADDED", node("b"))
    view._loaded = {"nodes": True, "pods": True}
    assert view.availability(MODELS)["h100"].max_on_node == 8
    view.apply_pod("ADDED", pod("p1", "a", 3))
    view.apply_pod("ADDED", pod("p2", "b", 2))
    av = view.availability(MODELS)["h100"]
    assert (av.free, av.max_on_node) == (11, 6)
    view.apply_node("MODIFIED", node("b", unschedulable=True))  # cordoned
    av = view.availability(MODELS)["h100"]
    assert (av.free, av.total, av.max_on_node) == (5, 8, 5)


def test_view_that_keeps_failing_reports_unknown_not_old_numbers() -> None:
    """Old numbers must not refuse spawns while the watch is down: availability becomes unknown."""
    view = ClusterGpuView(api=None)
    view.apply_node("ADDED", node("a"))
    view._loaded = {"nodes": True, "pods": True}
    assert view.availability(MODELS) is not None
    view._note_failure("pods", ConnectionError("api away"), 1.0)  # a blip: keep the view
    assert view.availability(MODELS) is not None
    view._note_failure("pods", ConnectionError("api away"), 8.0)  # failing for a while: stale
    assert view.availability(MODELS) is None


async def test_the_view_lists_in_pages_of_one_snapshot() -> None:
    """How many pods a cluster holds is its users' doing: the view reads them LIST_PAGE at a time, follows
    `continue` to the end, and watches from the snapshot's version (the first page's)."""
    import json

    from tfdist.spawner import availability

    calls: list[dict[str, Any]] = []
    pages = [
        ([pod("a", "n1", 1), pod("b", "n1", 2)], "t1", "100"),
        ([pod("c", "n1", 1)], None, "107"),  # (the API server repeats the first; the first is the one)
    ]

    class Resp:
        def __init__(self, body: dict[str, Any]) -> None:
            self.body = body

        async def read(self) -> bytes:
            return json.dumps(self.body).encode()

    async def list_fn(**kw: Any) -> Resp:
        calls.append(kw)
        items, token, rv = pages[len(calls) - 1]
        meta = {"resourceVersion": rv} | ({"continue": token} if token else {})
        return Resp({"items": items, "metadata": meta})

    view = ClusterGpuView(api=None)
    sel = {"field_selector": "status.phase!=Succeeded,status.phase!=Failed,spec.nodeName!="}
    assert await view._list("pods", list_fn, view.apply_pod, sel) == "100"
    assert sorted(view.pods) == ["ns/a", "ns/b", "ns/c"]
    assert [c.get("_continue") for c in calls] == [None, "t1"]
    assert all(
        c["limit"] == availability.LIST_PAGE and c["field_selector"] == sel["field_selector"] for c in calls
    )
