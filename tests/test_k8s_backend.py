"""The Kubernetes backend of %%tfdist against a real API server, scheduler and garbage collector
(kwok GPU nodes: pods are scheduled and "run", but no container runs, so no TF training happens here;
the same runtime is exercised by the local backend's tests)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tfdist.backends.base import Launch
from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.errors import BackendUnavailable, JobSpecError
from tfdist.jobspec import JobSpec
from tfdist.kube import manifests as mf
from tfdist.settings import from_environ

pytestmark = pytest.mark.k8s
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def backend(plane, ns: str, **env: str) -> KubernetesBackend:
    b = KubernetesBackend(
        from_environ(
            {"TFDIST_NAMESPACE": ns, "TFDIST_WORKER_IMAGE": "example.org/tfdist-job:1", "USER": "ann", **env}
        ),
        kubeconfig=plane.kubeconfig,
    )
    return b


def spec(name: str, ns: str, **kw) -> JobSpec:
    return JobSpec(**({"name": name, "user": "ann", "namespace": ns, "backend": "kubernetes"} | kw))


async def collect(b: KubernetesBackend, name: str, until, timeout: float = 60) -> list[dict]:
    out: list[dict] = []

    async def run():
        async for ev in b.watch(name):
            out.append(ev)
            if until(ev, out):
                return

    await asyncio.wait_for(run(), timeout)
    return out


def get(plane, path: str):
    return plane.get(path)


def test_manifests_put_gpus_on_workers_only_and_own_everything():
    s = JobSpec(
        name="j1",
        user="ann@x",
        namespace="team",
        image="img:1",
        workers=2,
        ps=1,
        gpus_per_worker=2,
        cpu=2.0,
        memory_bytes=2**30,
    )
    owner = mf.owner_reference("jupyter-ann", "uid-1")
    objs = mf.job_objects(
        s, token="t", owner=owner, notebook_labels={"hub.jupyter.org/username": "ann"}, node_selector=H100
    )
    kinds = [o["kind"] for o in objs]
    assert kinds == ["Secret", "Service", "NetworkPolicy", "Pod", "Pod", "Pod", "Pod"]
    assert all(o["metadata"]["ownerReferences"] == [owner] for o in objs)
    pods = {o["metadata"]["labels"][mf.L_TASK]: o for o in objs if o["kind"] == "Pod"}
    assert set(pods) == {"chief-0", "worker-0", "worker-1", "ps-0"}
    for task, pod in pods.items():
        res = pod["spec"]["containers"][0]["resources"]
        if task.startswith("worker"):
            assert res["limits"]["nvidia.com/gpu"] == "2" and pod["spec"]["nodeSelector"] == H100
            assert pod["spec"]["restartPolicy"] == "OnFailure"
        else:
            assert "nvidia.com/gpu" not in res["limits"] and "nodeSelector" not in pod["spec"]
            assert pod["spec"]["restartPolicy"] == "Never"
        assert res["requests"] == {"cpu": "2000m", "memory": str(2**30)}
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["TFDIST_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "j1-token"
        assert pod["spec"]["subdomain"] == "j1" and pod["spec"]["hostname"] == f"j1-{task}"
    import json

    cfg = json.loads(
        {e["name"]: e for e in pods["worker-1"]["spec"]["containers"][0]["env"]}["TF_CONFIG"]["value"]
    )
    assert cfg["task"] == {"type": "worker", "index": 1}
    assert cfg["cluster"]["ps"] == ["j1-ps-0.j1.team.svc:2222"]
    assert objs[0]["metadata"]["labels"][mf.L_USER] == mf.user_label("ann@x")
    assert mf.user_label("ann@x").startswith("ann-x-") and mf.user_label("ann@x") != mf.user_label("ann-x")
    netpol = objs[2]["spec"]
    tf_rule, agent_rule = netpol["ingress"]
    assert tf_rule["from"] == [
        {"podSelector": {"matchLabels": {mf.L_JOB: "j1", mf.L_USER: mf.user_label("ann@x")}}}
    ]
    assert {"podSelector": {"matchLabels": {"hub.jupyter.org/username": "ann"}}} in agent_rule["from"]


async def test_gpu_job_lands_on_gpu_nodes_and_stop_deletes_everything(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    b.node_selector = H100
    try:
        await b.submit(spec("gpu1", k8s_namespace, workers=2, gpus_per_worker=2), b"payload", Launch())
        evs = await collect(b, "gpu1", lambda ev, _: ev.get("type") == "state" and ev["state"] == "running")
        nodes = {e["task"]: e.get("node") for e in evs if e.get("type") == "task" and e.get("node")}
        for w in ("worker-0", "worker-1"):
            node = get(k8s_plane, f"/api/v1/nodes/{nodes[w]}")
            assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert (await b.status("gpu1")).state == "running"
        assert [j["name"] for j in await b.list_jobs()] == ["gpu1"]
        assert await b.stop("gpu1")
        sel = f"labelSelector={mf.L_JOB}%3Dgpu1"
        for kind in ("pods", "services", "secrets"):
            deadline = time.time() + 30
            while (
                get(k8s_plane, f"/api/v1/namespaces/{k8s_namespace}/{kind}?{sel}")["items"]
                and time.time() < deadline
            ):
                await asyncio.sleep(0.3)
            assert not get(k8s_plane, f"/api/v1/namespaces/{k8s_namespace}/{kind}?{sel}")["items"], kind
        np = get(k8s_plane, f"/apis/networking.k8s.io/v1/namespaces/{k8s_namespace}/networkpolicies?{sel}")
        assert not np["items"]
    finally:
        await b.close()


async def test_unschedulable_job_shows_the_reason_then_is_deleted(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    try:
        await b.submit(
            spec("toobig", k8s_namespace, workers=1, gpus_per_worker=64, timeout_s=6), b"p", Launch()
        )
        evs = await collect(b, "toobig", lambda ev, _: ev.get("type") == "state" and ev["state"] == "failed")
        msgs = [e.get("message", "") for e in evs if e.get("type") == "state"]
        assert any("Insufficient nvidia.com/gpu" in m for m in msgs), msgs
        assert "not running within --timeout 6s; deleted" in msgs[-1]
        await asyncio.sleep(1)
        assert not get(k8s_plane, f"/api/v1/namespaces/{k8s_namespace}/pods")["items"]
    finally:
        await b.close()


async def test_rejected_object_leaves_nothing_half_created(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace, TFDIST_WORKER_IMAGE=" bad image ")
    with pytest.raises(JobSpecError, match="the API server refused Pod"):
        await b.submit(spec("badimg", k8s_namespace), b"p", Launch())
    for kind in ("pods", "services", "secrets"):
        items = get(k8s_plane, f"/api/v1/namespaces/{k8s_namespace}/{kind}?labelSelector={mf.L_JOB}%3Dbadimg")
        assert not items["items"], kind
    await b.close()


async def test_two_jobs_with_the_same_name(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    try:
        await b.submit(spec("twice", k8s_namespace), b"p", Launch())
        with pytest.raises(JobSpecError, match="a job named 'twice' already exists"):
            await b.submit(spec("twice", k8s_namespace), b"p", Launch())
        assert len(get(k8s_plane, f"/api/v1/namespaces/{k8s_namespace}/pods")["items"]) == 4
    finally:
        await b.close()


async def test_no_rbac_gives_a_clear_message(k8s_plane, k8s_namespace, tmp_path):
    """A service account without the tfdist Role: 403 becomes a message naming the fix."""
    k8s_plane.request(
        "POST", f"/api/v1/namespaces/{k8s_namespace}/serviceaccounts", {"metadata": {"name": "norights"}}
    )
    tok = k8s_plane.request(
        "POST",
        f"/api/v1/namespaces/{k8s_namespace}/serviceaccounts/norights/token",
        {"spec": {"expirationSeconds": 600}},
    )["status"]["token"]
    import yaml

    kc = yaml.safe_load(open(k8s_plane.kubeconfig))
    kc["users"] = [{"name": "sa", "user": {"token": tok}}]
    kc["contexts"][0]["context"]["user"] = "sa"
    path = tmp_path / "sa.kubeconfig"
    path.write_text(yaml.safe_dump(kc))
    b = KubernetesBackend(
        from_environ({"TFDIST_NAMESPACE": k8s_namespace, "TFDIST_WORKER_IMAGE": "img:1"}),
        kubeconfig=str(path),
    )
    with pytest.raises(BackendUnavailable, match="needs the tfdist Role"):
        await b.submit(spec("denied", k8s_namespace), b"p", Launch())
    await b.close()


async def test_notebook_pod_deleted_mid_job_garbage_collects_the_job(k8s_plane, k8s_namespace):
    nb = k8s_plane.request(
        "POST",
        f"/api/v1/namespaces/{k8s_namespace}/pods",
        {
            "metadata": {"name": "jupyter-ann", "labels": {"hub.jupyter.org/username": "ann"}},
            "spec": {"containers": [{"name": "notebook", "image": "jupyter:1"}]},
        },
    )
    b = backend(k8s_plane, k8s_namespace, TFDIST_POD_NAME="jupyter-ann", TFDIST_POD_UID=nb["metadata"]["uid"])
    try:
        await b.submit(spec("owned", k8s_namespace), b"p", Launch())
        await collect(b, "owned", lambda ev, _: ev.get("type") == "state" and ev["state"] == "running")
        k8s_plane.request("DELETE", f"/api/v1/namespaces/{k8s_namespace}/pods/jupyter-ann")
        deadline = time.time() + 60
        left = None
        while time.time() < deadline:
            left = [
                p["metadata"]["name"]
                for p in get(k8s_plane, f"/api/v1/namespaces/{k8s_namespace}/pods")["items"]
            ]
            svcs = get(k8s_plane, f"/api/v1/namespaces/{k8s_namespace}/services")["items"]
            if not left and not svcs:
                break
            await asyncio.sleep(0.5)
        assert not left, f"not garbage-collected: {left}"
    finally:
        await b.close()


async def test_failed_worker_pod_is_replaced_and_watch_survives_apiserver_restart(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    try:
        await b.submit(spec("faulty", k8s_namespace, workers=2), b"p", Launch())
        events: list[dict] = []

        async def follow():
            async for ev in b.watch("faulty"):
                events.append(ev)

        task = asyncio.ensure_future(follow())
        deadline = time.time() + 60
        while not any(e.get("state") == "running" and e.get("type") == "state" for e in events):
            assert time.time() < deadline
            await asyncio.sleep(0.2)
        await asyncio.to_thread(
            k8s_plane.restart_apiserver
        )  # the watch must resume, not restart from scratch
        n_before = len(events)
        k8s_plane.kubectl(
            "-n", k8s_namespace, "label", "pod", "faulty-worker-1", "sim.tfdist.io/outcome=fail"
        )
        deadline = time.time() + 60
        while not any(e.get("type") == "task" and e.get("state") == "restarting" for e in events):
            assert time.time() < deadline, events[-5:]
            await asyncio.sleep(0.2)
        while not [
            e
            for e in events[n_before:]
            if e.get("type") == "task" and e["task"] == "worker-1" and e["state"] == "running"
        ]:
            assert time.time() < deadline
            await asyncio.sleep(0.2)
        task_events = [(e["task"], e["state"]) for e in events if e.get("type") == "task"]
        # nothing duplicated across the API server restart: each task reached "running" once before the fault
        assert task_events.count(("worker-0", "running")) == 1
        assert task_events.count(("worker-1", "running")) == 2, (
            task_events
        )  # before the failure, after the replacement
        task.cancel()
    finally:
        await b.close()
