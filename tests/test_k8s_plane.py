"""The local control plane is real: the real kube-scheduler places GPU pods on kwok nodes by
nvidia.com/gpu allocatable and node labels, and the real kube-controller-manager garbage-collects."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

if "tests.k8s_fixtures" not in sys.modules:  # tests/conftest.py should import them; until then, here
    from tests.k8s_fixtures import k8s_api, k8s_namespace, k8s_plane  # noqa: F401

pytestmark = pytest.mark.k8s

H100 = "NVIDIA-H100-80GB-HBM3"


def gpu_pod(name: str, gpus: int, model: str | None = None, labels: dict | None = None, owner=None) -> dict:
    spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "containers": [
            {
                "name": "main",
                "image": "example.invalid/tfdist-worker:test",
                "resources": {"limits": {"nvidia.com/gpu": str(gpus), "cpu": "1", "memory": "1Gi"}},
            }
        ],
    }
    if model:
        spec["nodeSelector"] = {"nvidia.com/gpu.product": model}
    meta = {"name": name, "labels": labels or {}}
    if owner is not None:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": owner.metadata.name, "uid": owner.metadata.uid}
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


async def wait_for(what: str, probe, timeout: float = 60.0, interval: float = 0.25):
    """Await ``probe()`` until it returns something truthy; fail with the last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


async def test_gpu_pod_scheduled_on_requested_model_and_running(k8s_plane, k8s_api, k8s_namespace):
    from kubernetes_asyncio import client

    core = client.CoreV1Api(k8s_api)
    await core.create_namespaced_pod(k8s_namespace, gpu_pod("train-h100", 2, model=H100))

    async def running():
        pod = await core.read_namespaced_pod("train-h100", k8s_namespace)
        return pod if pod.status.phase == "Running" else None

    pod = await wait_for("pod train-h100 Running", running)
    assert pod.spec.node_name, "the scheduler did not bind the pod"
    node = await core.read_node(pod.spec.node_name)
    assert node.metadata.labels["nvidia.com/gpu.product"] == H100
    assert node.metadata.annotations["kwok.x-k8s.io/node"] == "fake"
    assert int(node.status.allocatable["nvidia.com/gpu"]) >= 2
    # kwok's pod-ready stage: containers running, a fake pod IP from the configured CIDR.
    assert pod.status.container_statuses[0].state.running is not None
    assert pod.status.pod_ip and pod.status.pod_ip.startswith("10.244.")
    scheduled = next(c for c in pod.status.conditions if c.type == "PodScheduled")
    assert scheduled.status == "True"


async def test_gpu_pod_larger_than_any_node_stays_pending(k8s_plane, k8s_api, k8s_namespace):
    from kubernetes_asyncio import client

    core = client.CoreV1Api(k8s_api)
    await core.create_namespaced_pod(k8s_namespace, gpu_pod("too-big", 64))

    async def unschedulable():
        pod = await core.read_namespaced_pod("too-big", k8s_namespace)
        for c in pod.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                return pod, c
        return None

    pod, cond = await wait_for("PodScheduled=False for too-big", unschedulable)
    assert "Insufficient nvidia.com/gpu" in cond.message, cond.message
    assert pod.status.phase == "Pending"
    assert not pod.spec.node_name


async def test_controller_manager_garbage_collects_dependents(k8s_plane, k8s_api, k8s_namespace):
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    core = client.CoreV1Api(k8s_api)
    owner = await core.create_namespaced_pod(k8s_namespace, gpu_pod("owner", 1))
    await core.create_namespaced_pod(k8s_namespace, gpu_pod("dependent", 1, owner=owner))

    async def both_running():
        pods = await core.list_namespaced_pod(k8s_namespace)
        return len([p for p in pods.items if p.status.phase == "Running"]) == 2

    await wait_for("owner and dependent Running", both_running)
    # Background propagation: the API deletes the owner (kwok's pod-delete stage finishes the graceful
    # deletion), then the controller-manager's garbage collector deletes the dependent.
    await core.delete_namespaced_pod("owner", k8s_namespace)

    async def gone(name):
        try:
            await core.read_namespaced_pod(name, k8s_namespace)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        return False

    await wait_for("owner deleted", lambda: gone("owner"))
    await wait_for("dependent garbage-collected", lambda: gone("dependent"), timeout=90)


async def test_kwok_fail_stage_fails_labelled_pod(k8s_plane, k8s_api, k8s_namespace):
    """k8s/kwok/stages.yaml pod-fail: label sim.tfdist.io/outcome=fail turns a Running pod Failed."""
    from kubernetes_asyncio import client

    core = client.CoreV1Api(k8s_api)
    body = gpu_pod("doomed", 1, labels={"sim.tfdist.io/outcome": "fail"})
    body["metadata"]["annotations"] = {
        "sim.tfdist.io/delay": "500ms",
        "sim.tfdist.io/exit-code": "137",
        "sim.tfdist.io/reason": "OOMKilled",
    }
    await core.create_namespaced_pod(k8s_namespace, body)

    async def failed():
        pod = await core.read_namespaced_pod("doomed", k8s_namespace)
        return pod if pod.status.phase == "Failed" else None

    pod = await wait_for("pod doomed Failed", failed)
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (137, "OOMKilled")
    assert pod.spec.node_name


def test_plane_ports_come_from_the_planes_own_block_and_skip_taken_ones(k8s_plane):
    """The kwok plane and the real node's plane run side by side on two test workers: each listens only in
    its own block below the ephemeral range, and a port already taken is never handed out."""
    import socket

    from tests import kube_plane

    lo, hi = kube_plane.KWOK_PORTS
    assert all(lo <= p < hi for p in k8s_plane.ports.values()), k8s_plane.ports
    assert kube_plane.KWOK_PORTS[1] <= kube_plane.REALNODE_PORTS[0]  # disjoint
    assert kube_plane.REALNODE_PORTS[1] <= 32768  # under the ephemeral range: no connection's source port
    for taken in range(lo, hi - 1):  # two neighbouring ports of the block, the first then held
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", taken))
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", taken + 1))
            break
        except OSError:
            held.close()
    with held:
        held.listen()
        block = (taken, taken + 2)
        assert {kube_plane.free_port("127.0.0.1", block) for _ in range(20)} == {taken + 1}
        with pytest.raises(kube_plane.ControlPlaneError, match="no free port"):
            kube_plane.free_port("127.0.0.1", (taken, taken + 1))
