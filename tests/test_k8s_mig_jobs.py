"""%%tfdist jobs of a MIG profile on Kubernetes (issue 13): the workers ask for the profile's GPU resource
(TFDIST_GPU_RESOURCE, from the admin's GPU model), never nvidia.com/gpu, so that they fit a MIG node and
pass the user namespace's admission policy, which allows only that resource."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from tests.test_k8s_backend import backend, collect, private_agent_port, spec, wait_gone  # noqa: F401
from tests.test_k8s_tenancy import (  # noqa: F401
    _api_for_token,
    _backend,
    _left,
    _token,
    _user_kubeconfig,
    gpu_policy,
    hub,
    notebook_pod,
)
from tfdist.backends.base import Launch
from tfdist.errors import JobSpecError
from tfdist.jobspec import JobSpec
from tfdist.kube import allreduce
from tfdist.kube import manifests as mf
from tfdist.kube import names as kn
from tfdist.kube.apply import prepare_user_namespace

MIG_1G = "nvidia.com/mig-1g.10gb"
A100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}


def _limits(obj: dict) -> dict[str, str]:
    return obj["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})


def test_manifests_ask_for_the_profiles_gpu_resource_on_gpu_pods_only():
    s = JobSpec(
        name="m", user="ann", namespace="ns", backend="kubernetes", workers=2, ps=1, gpus_per_worker=1
    )
    objs = mf.job_objects(s, token="t", node_selector=A100, gpu_resource=MIG_1G)
    jobs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Job"}
    workers = jobs[kn.task_job_name(s, "worker")]
    assert _limits(workers) == {MIG_1G: "1"}
    assert '"nvidia.com/gpu"' not in json.dumps(objs)
    assert not _limits(jobs[kn.task_job_name(s, "ps")]).get(MIG_1G)
    # all-reduce: every replica (chief-0 too) is a GPU worker of the same profile
    s = JobSpec(
        name="a",
        user="ann",
        namespace="ns",
        backend="kubernetes",
        workers=3,
        ps=0,
        gpus_per_worker=1,
        strategy="allreduce",
    )
    root = allreduce.root_job(s, None, gpu_resource=MIG_1G)
    rest = allreduce.job_objects(s, token="t", gpu_resource=MIG_1G)
    assert _limits(root) == {MIG_1G: "1"} and _limits(rest[0]) == {MIG_1G: "1"}
    assert '"nvidia.com/gpu"' not in json.dumps([root, *rest])
    # the default stays whole GPUs (callers without a profile)
    assert _limits(mf.task_job(s, "worker", None)) == {"nvidia.com/gpu": "1"}


def _mig_node(plane) -> str:
    nodes = plane.get("/api/v1/nodes")["items"]
    mig = [n for n in nodes if n["metadata"]["labels"].get("nvidia.com/mig.strategy") == "mixed"]
    assert len(mig) == 1
    return mig[0]["metadata"]["name"]


@pytest.mark.k8s
@pytest.mark.usefixtures("private_agent_port")
async def test_mig_job_asks_for_the_profile_and_lands_on_the_mig_node(k8s_plane, k8s_namespace):
    ns = k8s_namespace
    b = backend(
        k8s_plane,
        ns,
        TFDIST_GPU_RESOURCE=MIG_1G,
        TFDIST_GPU_NODE_SELECTOR=json.dumps(A100),
    )
    assert b.gpu_resource == MIG_1G
    try:
        await b.submit(spec("mig1", ns, workers=2, gpus_per_worker=1), b"payload", Launch())
        evs = await collect(b, "mig1", lambda ev, _: ev.type == "state" and ev.state == "running")
        assert evs
        pods = k8s_plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3Dmig1")["items"]
        workers = [p for p in pods if p["metadata"]["labels"][kn.L_ROLE] == "worker"]
        assert len(workers) == 2
        node = _mig_node(k8s_plane)
        for p in workers:
            limits = p["spec"]["containers"][0]["resources"]["limits"]
            assert limits[MIG_1G] == "1" and "nvidia.com/gpu" not in limits, limits
            assert p["spec"]["nodeName"] == node
        assert await b.stop("mig1")
        await wait_gone(k8s_plane, ns, "mig1", 30)
    finally:
        await b.close()


@pytest.mark.k8s
@pytest.mark.usefixtures("private_agent_port")
async def test_mig_profile_namespace_admits_its_resource_and_refuses_whole_gpus(
    k8s_plane,
    hub,  # noqa: F811 (the fixture of test_k8s_tenancy)
    tmp_path,
):
    """A user namespace whose profile is a MIG model (quota and admission parameters for MIG_1G only)."""
    ns = f"{hub}-mig-{uuid.uuid4().hex[:6]}"
    policy = gpu_policy(
        "ann",
        ns,
        hub_namespace=hub,
        gpu_quota={MIG_1G: 7},
        gpu_resource=MIG_1G,
        max_gpus_per_pod=1,
        node_selector=A100,
        tolerations=[],
        required_tolerations=[],
        queue="",
    )
    async with _api_for_token(k8s_plane, _token(k8s_plane, hub, "hub")) as api:
        await prepare_user_namespace(api, policy)
    notebook_pod(k8s_plane, ns, "ann")  # owns the jobs, as the real notebook pod does
    kubeconfig = _user_kubeconfig(k8s_plane, ns, tmp_path, "ann")
    selector = {"TFDIST_GPU_NODE_SELECTOR": json.dumps(A100)}
    mig = _backend(k8s_plane, kubeconfig, ns, "ann", TFDIST_GPU_RESOURCE=MIG_1G, **selector)
    whole = _backend(k8s_plane, kubeconfig, ns, "ann", **selector)  # a server from before the fix
    try:
        await mig.submit(
            JobSpec(name="fits", user="ann", backend="kubernetes", workers=2, gpus_per_worker=1),
            b"p",
            Launch(),
        )
        running = await collect(mig, "fits", lambda ev, _: ev.type == "state" and ev.state == "running")
        assert running
        with pytest.raises(JobSpecError) as e:
            await whole.submit(
                JobSpec(name="whole", user="ann", backend="kubernetes", workers=1, gpus_per_worker=1),
                b"p",
                Launch(),
            )
        msg = str(e.value)
        assert f"your profile allows only the GPU resource {MIG_1G}, not nvidia.com/gpu" in msg, msg
        assert "\n" not in msg
        assert _left(k8s_plane, ns, "whole") == []
        # the kernel's own quota check counts the MIG resource: 8 instances exceed the 7 of the profile
        with pytest.raises(JobSpecError) as e:
            await mig.submit(
                JobSpec(name="many", user="ann", backend="kubernetes", workers=8, gpus_per_worker=1),
                b"p",
                Launch(),
            )
        assert f"exceed your quota of {MIG_1G}: it needs 8" in str(e.value), str(e.value)
    finally:
        await mig.stop("fits")
        await asyncio.gather(mig.close(), whole.close())
        try:
            k8s_plane.request("DELETE", f"/api/v1/namespaces/{ns}")
        except Exception:
            pass
