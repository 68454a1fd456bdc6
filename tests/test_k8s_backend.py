"""The Kubernetes backend of %%tfdist against a real API server, scheduler and garbage collector
(kwok GPU nodes: pods are scheduled and "run", but no container runs, so no TF training happens here;
the same runtime is exercised by the local backend's tests)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tfdist.backends.base import Launch
from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.errors import BackendUnavailable, JobSpecError
from tfdist.job.events import Event
from tfdist.job.restart import WORKER_RESTARTS
from tfdist.jobspec import JobSpec
from tfdist.kube import manifests as mf
from tfdist.kube import names as kn
from tfdist.settings import from_environ

pytestmark = [pytest.mark.k8s, pytest.mark.usefixtures("private_agent_port")]
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


@pytest.fixture
def private_agent_port(monkeypatch):
    """kwok hands out pod IPs from 10.244.0.0/16, which a real pod of this machine's one-node cluster
    (scripts/cluster) may hold, with a real agent on the default port: talk to a port nothing serves."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setattr(kn, "AGENT_PORT", s.getsockname()[1])


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


async def collect(b: KubernetesBackend, name: str, until, timeout: float = 60) -> list[Event]:
    out: list[Event] = []

    async def run():
        async for ev in b.watch(name):
            out.append(ev)
            if until(ev, out):
                return

    await asyncio.wait_for(run(), timeout)
    return out


def get(plane, path: str):
    return plane.get(path)


async def follow_until_running(
    b: KubernetesBackend, name: str, timeout: float = 60
) -> tuple[list[Event], asyncio.Task]:
    """Follow the job's watch in the background (its events collect in the list) until it says running."""
    events: list[Event] = []

    async def follow():
        async for ev in b.watch(name):
            events.append(ev)

    task = asyncio.ensure_future(follow())
    deadline = time.time() + timeout
    while not any(e.type == "state" and e.state == "running" for e in events):
        assert time.time() < deadline, events[-5:]
        await asyncio.sleep(0.2)
    return events, task


def test_manifests_put_gpus_on_workers_only_and_hang_everything_on_one_root():
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
    nb = kn.owner_reference("jupyter-ann", "uid-1")
    root = mf.root_job(s, nb, lifeline_s=60)
    assert root["metadata"]["ownerReferences"] == [nb] and root["metadata"]["name"] == "j1"
    assert root["metadata"]["labels"][kn.L_ROOT] == "true"
    assert root["spec"] | {"template": None} == {
        "completions": 1,
        "parallelism": 1,
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": mf.FINISHED_TTL_S,
        "suspend": True,
        "activeDeadlineSeconds": 60,
        "template": None,
    }
    assert "activeDeadlineSeconds" not in mf.root_job(s, nb, lifeline_s=None)["spec"]  # detached
    owner = kn.root_reference(s, "root-uid")
    objs = mf.job_objects(
        s, token="t", root=owner, notebook_labels={"hub.jupyter.org/username": "ann"}, node_selector=H100
    )
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Job", "j1-worker"),
        ("Secret", "j1-token"),
        ("Service", "j1"),
        ("NetworkPolicy", "j1"),
        ("Job", "j1-ps"),
    ]
    assert all(o["metadata"]["ownerReferences"] == [owner] for o in objs)
    worker, ps = objs[0]["spec"], objs[4]["spec"]
    assert (worker["completionMode"], worker["completions"], worker["parallelism"]) == ("Indexed", 2, 2)
    assert worker["backoffLimitPerIndex"] == WORKER_RESTARTS and worker["maxFailedIndexes"] == 2
    assert worker["podReplacementPolicy"] == "TerminatingOrFailed"
    assert (ps["completionMode"], ps["completions"], ps["backoffLimit"]) == ("Indexed", 1, 0)
    templates = {"chief": root["spec"]["template"], "worker": worker["template"], "ps": ps["template"]}
    for role, t in templates.items():
        res = t["spec"]["containers"][0]["resources"]
        if role == "worker":
            assert res["limits"]["nvidia.com/gpu"] == "2" and t["spec"]["nodeSelector"] == H100
        else:
            assert "nvidia.com/gpu" not in res["limits"] and "nodeSelector" not in t["spec"]
        assert t["spec"]["restartPolicy"] == "Never" and t["spec"]["subdomain"] == "j1"
        assert res["requests"] == {"cpu": "2000m", "memory": str(2**30)}
        env = {e["name"]: e for e in t["spec"]["containers"][0]["env"]}
        assert env["TFDIST_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "j1-token"
        assert t["metadata"]["labels"][kn.L_ROLE] == role
    # Indexed pods are named <job>-<index>: the worker Job's pods get the hostnames TF_CONFIG names
    assert templates["chief"]["spec"]["hostname"] == "j1-chief-0"
    env = {e["name"]: e["value"] for e in templates["worker"]["spec"]["containers"][0]["env"] if "value" in e}
    from tfdist.runtime.podmain import task_environment

    pod_env = {**env, "JOB_COMPLETION_INDEX": "1"}
    task_environment("worker", pod_env)
    cfg = json.loads(pod_env["TF_CONFIG"])
    assert cfg["task"] == {"type": "worker", "index": 1} and pod_env["TFDIST_TASK"] == "worker-1"
    assert cfg["cluster"]["ps"] == ["j1-ps-0.j1.team.svc:2222"]
    assert cfg["cluster"]["worker"][1] == "j1-worker-1.j1.team.svc:2222"
    assert objs[1]["metadata"]["labels"][kn.L_USER] == kn.user_label("ann@x")
    assert kn.user_label("ann@x").startswith("ann-x-") and kn.user_label("ann@x") != kn.user_label("ann-x")
    tf_rule, agent_rule = objs[3]["spec"]["ingress"]
    assert tf_rule["from"] == [
        {"podSelector": {"matchLabels": {kn.L_JOB: "j1", kn.L_USER: kn.user_label("ann@x")}}}
    ]
    assert {"podSelector": {"matchLabels": {"hub.jupyter.org/username": "ann"}}} in agent_rule["from"]


def left(plane, ns: str, job: str) -> list[str]:
    """Every object of the job still there (not being deleted)."""
    sel = f"labelSelector={kn.L_JOB}%3D{job}"
    out = []
    for path in (
        f"/apis/batch/v1/namespaces/{ns}/jobs",
        f"/api/v1/namespaces/{ns}/pods",
        f"/api/v1/namespaces/{ns}/services",
        f"/api/v1/namespaces/{ns}/secrets",
        f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    ):
        out += [
            f"{path.rsplit('/', 1)[1]}/{o['metadata']['name']}" for o in get(plane, f"{path}?{sel}")["items"]
        ]
    return out


async def wait_gone(plane, ns: str, job: str, timeout: float) -> float:
    t0 = time.time()
    while left(plane, ns, job):
        assert time.time() - t0 < timeout, left(plane, ns, job)
        await asyncio.sleep(0.5)
    return time.time() - t0


async def test_gpu_job_lands_on_gpu_nodes_and_stop_deletes_everything(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    b.node_selector = H100
    try:
        await b.submit(spec("gpu1", k8s_namespace, workers=2, gpus_per_worker=2), b"payload", Launch())
        evs = await collect(b, "gpu1", lambda ev, _: ev.type == "state" and ev.state == "running")
        nodes = {str(e.task): e.node for e in evs if e.type == "task" and e.node}
        for w in ("worker-0", "worker-1"):
            node = get(k8s_plane, f"/api/v1/nodes/{nodes[w]}")
            assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert (await b.status("gpu1")).state == "running"
        assert [j.name for j in await b.list_jobs()] == ["gpu1"]
        assert await b.stop("gpu1")
        await wait_gone(k8s_plane, k8s_namespace, "gpu1", 30)
    finally:
        await b.close()


async def test_unschedulable_job_shows_the_reason_then_is_deleted(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    try:
        await b.submit(
            spec("toobig", k8s_namespace, workers=1, gpus_per_worker=64, timeout_s=6), b"p", Launch()
        )
        evs = await collect(b, "toobig", lambda ev, _: ev.type == "state" and ev.state == "failed")
        msgs = [(e.message or "") for e in evs if e.type == "state"]
        assert any("Insufficient nvidia.com/gpu" in m for m in msgs), msgs
        assert "not running within --timeout 6s; deleted" in msgs[-1]
        await wait_gone(k8s_plane, k8s_namespace, "toobig", 20)
    finally:
        await b.close()


async def test_rejected_object_leaves_nothing_half_created(k8s_plane, k8s_namespace):
    """The workers' Job is refused (a node selector that is no label key) after the root was created: the
    root goes too, and no pod ever existed (the root was still suspended)."""
    b = backend(k8s_plane, k8s_namespace, TFDIST_GPU_NODE_SELECTOR='{"not a key!": "x"}')
    with pytest.raises(JobSpecError, match="the API server refused Job 'badimg-worker'"):
        await b.submit(spec("badimg", k8s_namespace, gpus_per_worker=1), b"p", Launch())
    assert left(k8s_plane, k8s_namespace, "badimg") == []
    await b.close()


async def test_two_jobs_with_the_same_name(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    try:
        await b.submit(spec("twice", k8s_namespace), b"p", Launch())
        with pytest.raises(JobSpecError, match="a job named 'twice' already exists"):
            await b.submit(spec("twice", k8s_namespace), b"p", Launch())
        deadline = time.time() + 30
        while len(get(k8s_plane, f"/api/v1/namespaces/{k8s_namespace}/pods")["items"]) != 4:
            assert time.time() < deadline
            await asyncio.sleep(0.3)
        jobs = get(k8s_plane, f"/apis/batch/v1/namespaces/{k8s_namespace}/jobs")["items"]
        assert sorted(j["metadata"]["name"] for j in jobs) == ["twice", "twice-ps", "twice-worker"]
    finally:
        await b.close()


async def test_no_rbac_gives_a_clear_message(k8s_plane, k8s_namespace, tmp_path):
    """A service account without the tfdist Role: 403 becomes a message naming the fix."""
    k8s_plane.request(
        "POST", f"/api/v1/namespaces/{k8s_namespace}/serviceaccounts", {"metadata": {"name": "norights"}}
    )
    path = k8s_plane.service_account_kubeconfig(k8s_namespace, "norights", tmp_path / "sa.kubeconfig")
    b = KubernetesBackend(
        from_environ({"TFDIST_NAMESPACE": k8s_namespace, "TFDIST_WORKER_IMAGE": "img:1"}),
        kubeconfig=path,
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
        await collect(b, "owned", lambda ev, _: ev.type == "state" and ev.state == "running")
        k8s_plane.request("DELETE", f"/api/v1/namespaces/{k8s_namespace}/pods/jupyter-ann")
        await wait_gone(k8s_plane, k8s_namespace, "owned", 60)
    finally:
        await b.close()


async def test_failed_worker_pod_is_replaced_and_watch_survives_apiserver_restart(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    try:
        await b.submit(spec("faulty", k8s_namespace, workers=2), b"p", Launch())
        events, task = await follow_until_running(b, "faulty")
        await asyncio.to_thread(
            k8s_plane.restart_apiserver
        )  # the watch must resume, not restart from scratch
        n_before = len(events)
        k8s_plane.kubectl(
            "-n",
            k8s_namespace,
            "label",
            "pod",
            "-l",
            f"{kn.L_JOB}=faulty,{kn.L_ROLE}=worker,{kn.L_INDEX}=1",
            "sim.tfdist.io/outcome=fail",
        )
        deadline = time.time() + 60
        while not any(e.type == "task" and e.state == "restarting" for e in events):
            assert time.time() < deadline, events[-5:]
            await asyncio.sleep(0.2)
        while not [
            e
            for e in events[n_before:]
            if e.type == "task" and str(e.task) == "worker-1" and e.state == "running"
        ]:
            assert time.time() < deadline
            await asyncio.sleep(0.2)
        task_events = [(str(e.task), e.state) for e in events if e.type == "task"]
        # nothing duplicated across the API server restart: each task reached "running" once before the fault
        assert task_events.count(("worker-0", "running")) == 1
        assert task_events.count(("worker-1", "running")) == 2, (
            task_events
        )  # before the failure, after the replacement
        task.cancel()
    finally:
        await b.close()
