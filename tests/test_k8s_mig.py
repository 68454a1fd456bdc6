"""MIG on Kubernetes (issue 13): with the GPU operator's mixed strategy a MIG profile is a resource of its
own (``nvidia.com/mig-1g.10gb``), and a GPU model naming it is counted, placed and refused like any other.
On the kwok plane's MIG node (tests/k8s_fixtures.py: two A100 80GB in MIG mode, 7 x 1g.10gb and
2 x 3g.40gb, no whole GPU), with the real scheduler."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tfdist.spawner.availability import gpu_availability
from tfdist.spawner.profiles import GpuModel

pytestmark = pytest.mark.k8s
A100_80 = "NVIDIA-A100-SXM4-80GB"
PRODUCT = {"nvidia.com/gpu.product": A100_80}
MIG_1G = "nvidia.com/mig-1g.10gb"


def models(node: str) -> dict[str, GpuModel]:
    """The MIG node's resources as the profiles YAML would name them (pinned to that node, so that nodes
    other tests of the session add do not count)."""
    pin = {**PRODUCT, "kubernetes.io/hostname": node}
    return {
        "mig1g": GpuModel(display_name="A100 1g.10gb", resource=MIG_1G, node_selector=pin),
        "mig3g": GpuModel(display_name="A100 3g.40gb", resource="nvidia.com/mig-3g.40gb", node_selector=pin),
        "whole": GpuModel(display_name="A100 80GB", node_selector=pin),
    }


def mig_pod(name: str, n: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "nodeSelector": PRODUCT,
            "containers": [
                {"name": "main", "image": "example.invalid/x:1", "resources": {"limits": {MIG_1G: str(n)}}}
            ],
        },
    }


def wait_pod(plane, ns: str, name: str, check, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        pod = plane.get(f"/api/v1/namespaces/{ns}/pods/{name}")
        if pod and check(pod):
            return pod
        assert time.monotonic() < deadline, (pod or {}).get("status")
        time.sleep(0.2)


def availability(plane, node: str) -> dict[str, tuple[int, int]]:
    nodes = plane.get("/api/v1/nodes")["items"]
    pods = plane.get("/api/v1/pods")["items"]
    return {k: (a.free, a.total) for k, a in gpu_availability(nodes, pods, models(node)).items()}


def test_mig_instances_are_counted_placed_and_refused_per_profile(k8s_plane, k8s_namespace):
    ns = k8s_namespace
    mig_nodes = [
        n
        for n in k8s_plane.get("/api/v1/nodes")["items"]
        if n["metadata"]["labels"].get("nvidia.com/mig.strategy") == "mixed"
    ]
    assert len(mig_nodes) == 1
    node = mig_nodes[0]
    name = node["metadata"]["name"]
    assert node["status"]["allocatable"][MIG_1G] == "7"
    assert node["metadata"]["labels"]["nvidia.com/mig-1g.10gb.count"] == "7"
    assert availability(k8s_plane, name) == {"mig1g": (7, 7), "mig3g": (2, 2), "whole": (0, 0)}

    # two instances: the scheduler puts the pod on the only node that has them, and they are held
    k8s_plane.request("POST", f"/api/v1/namespaces/{ns}/pods", mig_pod("two", 2))
    pod = wait_pod(k8s_plane, ns, "two", lambda p: p["spec"].get("nodeName"))
    assert pod["spec"]["nodeName"] == name
    assert availability(k8s_plane, name) == {"mig1g": (5, 7), "mig3g": (2, 2), "whole": (0, 0)}

    # more instances than are free: Pending, with the resource named in the scheduler's reason
    k8s_plane.request("POST", f"/api/v1/namespaces/{ns}/pods", mig_pod("six", 6))

    def unschedulable(p: dict) -> bool:
        return any(c.get("reason") == "Unschedulable" for c in p.get("status", {}).get("conditions", []))

    pod = wait_pod(k8s_plane, ns, "six", unschedulable)
    why = next(c["message"] for c in pod["status"]["conditions"] if c.get("reason") == "Unschedulable")
    assert f"Insufficient {MIG_1G}" in why, why
    assert not pod["spec"].get("nodeName")

    # the instances come back when the pod goes; the waiting one then fits (5 + 2 = 7 >= 6)
    k8s_plane.request("DELETE", f"/api/v1/namespaces/{ns}/pods/two?gracePeriodSeconds=0")
    pod = wait_pod(k8s_plane, ns, "six", lambda p: p["spec"].get("nodeName"), timeout=60)
    assert pod["spec"]["nodeName"] == name
    assert availability(k8s_plane, name)["mig1g"] == (1, 7)
