"""Issue 9 against a real API server: each user confined to their own namespace (tfdist.kube.tenancy, applied
with the hub's own token and hub_config/rbac-hub-tenancy.yaml), the admin's placement rules enforced by the
cluster (hub_config/admission-policy.yaml, a ValidatingAdmissionPolicy) and the ResourceQuota, and a
coordinator that is only ever the pod the backend created."""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import pickle
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube_plane import nothing_created
from tests.test_k8s_backend import private_agent_port  # noqa: F401
from tfdist.backends.base import Launch
from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.errors import JobSpecError
from tfdist.job.events import Event
from tfdist.jobspec import JobSpec
from tfdist.kube import names as kn
from tfdist.kube import tenancy
from tfdist.kube.apply import prepare_user_namespace, user_kubeconfig
from tfdist.podidentity import DEFAULT as DEFAULT_IDENTITY
from tfdist.settings import from_environ

pytestmark = [pytest.mark.k8s, pytest.mark.usefixtures("private_agent_port")]
REPO = Path(__file__).resolve().parent.parent
POLICY_FILE = REPO / "hub_config" / "admission-policy.yaml"
HUB_RBAC = REPO / "hub_config" / "rbac-hub-tenancy.yaml"
NOTEBOOK_RBAC = REPO / "hub_config" / "rbac-notebook.yaml"
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
GPU_TOL = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
IMAGE = "example.org/tfdist-job:1"
# what Pod Security "restricted" (the user namespaces' level) asks of a container
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
NOTEBOOK = "jupyter-nb"


def notebook_pod(plane, ns: str, user: str) -> str:
    """A stand-in for the user's notebook pod (created by the hub, as KubeSpawner would): its UID."""
    pod = plane.request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "metadata": {"name": NOTEBOOK, "labels": kn.notebook_pod_labels(user)},
            "spec": {"containers": [{"name": "c", "image": IMAGE, "securityContext": RESTRICTED}]},
        },
    )
    return pod["metadata"]["uid"]


# the caps every user namespace has by default (counts, local disk, claims)
DEFAULT_CAPS = {
    "count/jobs.batch": "48",
    "services": "64",
    "secrets": "32",
    "count/networkpolicies.networking.k8s.io": "35",
    "persistentvolumeclaims": "4",
    "requests.storage": str(100 * 2**30),
    "requests.ephemeral-storage": str(100 * 2**30),
    "limits.ephemeral-storage": str(100 * 2**30),
}


def gpu_policy(user: str, ns: str, **kw: Any) -> tenancy.TenantPolicy:
    return tenancy.TenantPolicy(
        **{
            "user": user,
            "namespace": ns,
            "gpu_quota": {"nvidia.com/gpu": 8, "nvidia.com/mig-1g.10gb": 0},
            "gpu_resource": "nvidia.com/gpu",
            "max_gpus_per_pod": 8,
            "node_selector": H100,
            "tolerations": [GPU_TOL],
            "required_tolerations": [GPU_TOL],
            "queue": "ml-team",
            "pods_quota": 20,
        }
        | kw
    )


def cpu_policy(user: str, ns: str) -> tenancy.TenantPolicy:
    return tenancy.TenantPolicy(
        user=user, namespace=ns, gpu_quota={"nvidia.com/gpu": 0, "nvidia.com/mig-1g.10gb": 0}, pods_quota=20
    )


# ------------------------------------------------------------------------------------------ pure builders
def test_tenant_objects_grant_no_patch_and_no_secret_reads():
    p = gpu_policy("ann@x", "jhub-ann", cpu_quota=10.0, memory_quota_bytes=64 * 2**30, hub_namespace="jhub")
    objs = tenancy.tenant_objects(p)
    assert [o["kind"] for o in objs] == [
        "Namespace",
        "ResourceQuota",
        "LimitRange",
        "ConfigMap",
        "NetworkPolicy",
        "NetworkPolicy",
        "NetworkPolicy",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    ]
    ns = objs[0]["metadata"]["labels"]
    assert ns[tenancy.L_TENANT] == "true" and ns["pod-security.kubernetes.io/enforce"] == "restricted"
    assert objs[1]["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "8",
        "requests.nvidia.com/mig-1g.10gb": "0",
        "requests.cpu": "10000m",
        "limits.cpu": "10000m",
        "requests.memory": str(64 * 2**30),
        "limits.memory": str(64 * 2**30),
        "pods": "20",
        "count/pods": "80",  # finished pods too: each task's retries are kept until its Job goes
        **DEFAULT_CAPS,
    }
    assert objs[3]["data"] == {
        "gpuResource": "nvidia.com/gpu",
        "gpuResources": "nvidia.com/gpu,nvidia.com/mig-1g.10gb",
        "maxGpusPerPod": "8",
        "cpuPerGpu": "",  # the model sets no share per GPU (test_k8s_escapes.py: one that does)
        "memoryPerGpu": "",
        "defaultCpu": "1",  # the LimitRange's, which the share counts for a container without a limit
        "defaultMemory": "2Gi",
        "nodeSelector": "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
        "tolerations": "nvidia.com/gpu|Exists||NoSchedule",
        "requiredTolerations": "nvidia.com/gpu|Exists||NoSchedule",
        "queue": "ml-team",
        "runtimeClasses": "",
        "dataClaims": "",
        "readOnlyClaims": "",
        "maxTasks": "20",
        "runAsUser": "1000",  # the notebook's (tfdist.podidentity): every job pod's
        "runAsGroup": "1000",
        "fsGroup": "",
        "supplementalGroups": "",
    }
    assert objs[4]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    # the quota's NetworkPolicy cap leaves room for the hub's own beside the jobs'
    assert sum(o["kind"] == "NetworkPolicy" for o in objs) == tenancy.HUB_POLICIES
    assert objs[6]["metadata"]["name"] == "tfdist-default-egress"  # tests/test_k8s_egress.py
    rules = objs[8]["rules"]
    verbs = {(r["apiGroups"][0], res): set(r["verbs"]) for r in rules for res in r["resources"]}
    assert not any("patch" in v or "*" in v or "deletecollection" in v for v in verbs.values())
    assert [k for k, v in verbs.items() if "update" in v] == [("batch", "jobs")]  # the lifeline only
    assert verbs[("", "secrets")] == {"create", "delete"}
    assert verbs[("", "pods")] == {"list", "watch"}  # the Job controller creates the pods
    assert ("", "configmaps") not in verbs and ("rbac.authorization.k8s.io", "roles") not in verbs
    assert objs[9]["subjects"] == [
        {"kind": "ServiceAccount", "name": "tfdist-notebook", "namespace": "jhub-ann"}
    ]
    # the shared-namespace file carries the same rules
    shipped = next(d for d in yaml.safe_load_all(NOTEBOOK_RBAC.read_text()) if d["kind"] == "Role")["rules"]
    assert shipped == tenancy.NOTEBOOK_RULES


def test_cpu_only_policy_has_zero_gpu_quota_and_no_gpu_resource():
    objs = tenancy.tenant_objects(cpu_policy("bob", "jhub-bob"))
    assert objs[1]["spec"]["hard"]["requests.nvidia.com/gpu"] == "0"
    assert objs[3]["data"]["gpuResource"] == "" and objs[3]["data"]["maxGpusPerPod"] == "0"
    assert "tfdist-notebook-ingress" not in [o["metadata"]["name"] for o in objs]


# ------------------------------------------------------------------------------------------ the cluster
def _api_for_token(plane, token: str):
    from kubernetes_asyncio import client

    cfg = client.Configuration(host=plane.server)
    cfg.ssl_ca_cert = str(plane.ca_file)
    cfg.api_key = {"BearerToken": token}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    return client.ApiClient(cfg)


def _token(plane, ns: str, sa: str) -> str:
    return plane.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 900},
        },
    )["status"]["token"]


def wait_policy_in_force(plane, timeout: float = 60) -> None:
    """Until the API server enforces the admission policy just applied (its informers pick a new policy up
    a moment later; a busy cold run saw a pod admitted that it refuses): a dry-run pod from a tenant
    namespace without policy parameters must be refused (parameterNotFoundAction: Deny)."""
    from kubernetes_asyncio import client

    ns = f"vap-probe-{uuid.uuid4().hex[:6]}"
    plane.request(
        "POST", "/api/v1/namespaces", {"metadata": {"name": ns, "labels": {tenancy.L_TENANT: "true"}}}
    )
    plane.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "probe"}})
    plane.request(
        "POST",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
        {
            "metadata": {"name": "probe"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
            "subjects": [{"kind": "ServiceAccount", "name": "probe", "namespace": ns}],
        },
    )
    pod = {"metadata": {"name": "probe"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}

    async def refused() -> bool:
        async with _api_for_token(plane, _token(plane, ns, "probe")) as api:
            try:
                await client.CoreV1Api(api).create_namespaced_pod(ns, pod, dry_run="All")
            except client.ApiException as e:
                return "ValidatingAdmissionPolicy" in (e.body or "")  # 422 "no params found"
            return False

    try:
        deadline = time.monotonic() + timeout
        while not asyncio.run(refused()):
            assert time.monotonic() < deadline, f"the admission policy not in force after {timeout:.0f}s"
            time.sleep(0.5)
    finally:
        plane.request("DELETE", f"/api/v1/namespaces/{ns}")


@pytest.fixture(scope="module")
def hub(k8s_plane):
    """The admission policy and the hub's RBAC from hub_config/, applied as an admin would; a hub namespace
    holding the hub's Secret and its service account."""
    k8s_plane.kubectl("apply", "-f", str(POLICY_FILE))
    wait_policy_in_force(k8s_plane)
    hub_ns = k8s_plane.create_namespace(f"hub-{uuid.uuid4().hex[:8]}")
    k8s_plane.request("POST", f"/api/v1/namespaces/{hub_ns}/serviceaccounts", {"metadata": {"name": "hub"}})
    k8s_plane.request(
        "POST",
        f"/api/v1/namespaces/{hub_ns}/secrets",
        {"metadata": {"name": "hub"}, "stringData": {"hub.config.CryptKeeper.keys": "k", "cookie": "c"}},
    )
    rbac = HUB_RBAC.read_text().replace("NAMESPACE", hub_ns)
    path = Path(k8s_plane.workdir) / f"hub-rbac-{hub_ns}.yaml"
    path.write_text(rbac)
    k8s_plane.kubectl("apply", "-f", str(path))
    return hub_ns


@pytest.fixture
async def users(k8s_plane, hub):
    """ann (GPU profile) and bob (CPU-only), their namespaces prepared with the HUB's own token."""
    suffix = uuid.uuid4().hex[:6]
    ann_ns, bob_ns = f"{hub}-ann-{suffix}", f"{hub}-bob-{suffix}"
    async with _api_for_token(k8s_plane, _token(k8s_plane, hub, "hub")) as api:
        await prepare_user_namespace(api, gpu_policy("ann", ann_ns, hub_namespace=hub))
        await prepare_user_namespace(api, cpu_policy("bob", bob_ns))
    uids = {ann_ns: notebook_pod(k8s_plane, ann_ns, "ann"), bob_ns: notebook_pod(k8s_plane, bob_ns, "bob")}
    yield {"hub": hub, "ann": ann_ns, "bob": bob_ns, "notebook_uid": uids}
    for ns in (ann_ns, bob_ns):
        try:
            k8s_plane.request("DELETE", f"/api/v1/namespaces/{ns}")
        except Exception:
            pass


async def test_hub_converges_a_user_namespace_on_every_spawn(k8s_plane, users):
    ann = users["ann"]
    async with _api_for_token(k8s_plane, _token(k8s_plane, users["hub"], "hub")) as api:
        # the admin changed the profile: the next spawn applies it (twice: idempotent)
        await prepare_user_namespace(api, gpu_policy("ann", ann, gpu_quota={"nvidia.com/gpu": 2}, queue=""))
        await prepare_user_namespace(api, gpu_policy("ann", ann, gpu_quota={"nvidia.com/gpu": 2}, queue=""))
    quota = k8s_plane.get(f"/api/v1/namespaces/{ann}/resourcequotas/{tenancy.QUOTA}")
    assert quota["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "2",
        "pods": "20",
        "count/pods": "80",
        **DEFAULT_CAPS,
    }
    params = k8s_plane.get(f"/api/v1/namespaces/{ann}/configmaps/{tenancy.POLICY_PARAMS}")["data"]
    assert params["queue"] == ""
    ns = k8s_plane.get(f"/api/v1/namespaces/{ann}")["metadata"]["labels"]
    assert ns[tenancy.L_TENANT] == "true" and ns["kubernetes.io/metadata.name"] == ann


async def test_notebook_token_reaches_neither_the_hub_nor_other_users(k8s_plane, users):
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    hub, ann, bob = users["hub"], users["ann"], users["bob"]
    k8s_plane.request(
        "POST", f"/api/v1/namespaces/{bob}/secrets", {"metadata": {"name": "bobs"}, "stringData": {"k": "v"}}
    )

    def mounting(secret: str) -> dict[str, Any]:
        return {
            "metadata": {"name": f"steal-{uuid.uuid4().hex[:6]}"},
            "spec": {
                "containers": [
                    {"name": "c", "image": IMAGE, "volumeMounts": [{"name": "s", "mountPath": "/s"}]}
                ],
                "volumes": [{"name": "s", "secret": {"secretName": secret}}],
            },
        }

    async def status(coro: Any) -> tuple[int, str]:
        try:
            await coro
        except ApiException as e:
            return int(e.status), json.loads(e.body or "{}").get("message", "")
        return 200, ""

    async with _api_for_token(k8s_plane, _token(k8s_plane, ann, tenancy.NOTEBOOK_SA)) as api:
        core = client.CoreV1Api(api)
        rbac = client.RbacAuthorizationV1Api(api)
        # the hub's namespace: no pod that mounts the hub's Secret, no reading it, no patching the hub
        assert (await status(core.create_namespaced_pod(hub, mounting("hub"))))[0] == 403
        assert (await status(core.read_namespaced_secret("hub", hub)))[0] == 403
        assert (await status(core.list_namespaced_secret(hub)))[0] == 403
        assert (await status(core.delete_collection_namespaced_secret(hub)))[0] == 403
        # another user's namespace: nothing
        assert (await status(core.read_namespaced_secret("bobs", bob)))[0] == 403
        assert (await status(core.create_namespaced_pod(bob, mounting("bobs"))))[0] == 403
        assert (await status(core.list_namespaced_pod(bob)))[0] == 403
        # its own namespace: no patch, no reading Secrets, no touching its quota, policy or RBAC
        patch = {"metadata": {"labels": {kn.L_TASK: "chief-0"}}}
        assert (await status(core.patch_namespaced_pod(NOTEBOOK, ann, patch)))[0] == 403
        assert (await status(core.list_namespaced_secret(ann)))[0] == 403
        assert (await status(core.read_namespaced_secret("anything", ann)))[0] == 403
        cm = {"data": {"queue": ""}}
        assert (await status(core.patch_namespaced_config_map(tenancy.POLICY_PARAMS, ann, cm)))[0] == 403
        assert (await status(core.delete_namespaced_resource_quota(tenancy.QUOTA, ann)))[0] == 403
        rb = {
            "metadata": {"name": "x"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "cluster-admin",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "tfdist-notebook", "namespace": ann}],
        }
        assert (await status(rbac.create_namespaced_role_binding(ann, rb)))[0] == 403
        # no pods of its own at all (the Job controller creates job pods); a Job whose pod would be
        # privileged gets no pod either (Pod Security restricted on the namespace)
        assert (await status(core.create_namespaced_pod(ann, mounting("anything"))))[0] == 403
        priv = {
            "metadata": {
                "name": "priv",
                "labels": {"kueue.x-k8s.io/queue-name": "ml-team"},
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": NOTEBOOK, "uid": users["notebook_uid"][ann]}
                ],
            },
            "spec": {
                "template": {
                    "metadata": {"labels": {"kueue.x-k8s.io/queue-name": "ml-team"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "securityContext": DEFAULT_IDENTITY.security_context(),  # admission's; not PSA's
                        "containers": [
                            {"name": "c", "image": IMAGE, "securityContext": {"privileged": True}}
                        ],
                    },
                }
            },
        }
        await client.BatchV1Api(api).create_namespaced_job(ann, priv)
    await asyncio.sleep(3)
    assert not k8s_plane.get(f"/api/v1/namespaces/{ann}/pods?labelSelector=job-name%3Dpriv")["items"]
    evs = k8s_plane.get(f"/api/v1/namespaces/{ann}/events?fieldSelector=reason%3DFailedCreate")["items"]
    assert any("violates PodSecurity" in e["message"] for e in evs), [e["message"] for e in evs]
    assert not k8s_plane.get(f"/api/v1/namespaces/{hub}/pods")["items"]


def _backend(plane, kubeconfig: str, ns: str, user: str, **env: str) -> KubernetesBackend:
    """The user's kernel as in their notebook pod: the pod (NOTEBOOK in `ns`, if there) owns its jobs."""
    pod = plane.get(f"/api/v1/namespaces/{ns}/pods/{NOTEBOOK}")
    owner = {"TFDIST_POD_NAME": NOTEBOOK, "TFDIST_POD_UID": pod["metadata"]["uid"]} if pod else {}
    return KubernetesBackend(
        from_environ(
            {"TFDIST_NAMESPACE": ns, "TFDIST_WORKER_IMAGE": IMAGE, "TFDIST_USER": user, **owner, **env}
        ),
        kubeconfig=kubeconfig,
    )


def _user_kubeconfig(plane, ns: str, tmp_path: Path, user: str) -> str:
    token = _token(plane, ns, tenancy.NOTEBOOK_SA)
    ca = base64.b64encode(Path(plane.ca_file).read_bytes()).decode()
    path = tmp_path / f"{user}.kubeconfig"
    path.write_text(yaml.safe_dump(user_kubeconfig(plane.server, ca, token, ns, user)))
    return str(path)


def _left(plane, ns: str, job: str) -> list[str]:
    sel = f"labelSelector={kn.L_JOB}%3D{job}"
    jobs = plane.get(f"/apis/batch/v1/namespaces/{ns}/jobs?{sel}")["items"]
    out = [f"jobs/{j['metadata']['name']}" for j in jobs if not j["metadata"].get("deletionTimestamp")]
    for kind in ("pods", "services", "secrets"):
        out += [
            f"{kind}/{o['metadata']['name']}"
            for o in plane.get(f"/api/v1/namespaces/{ns}/{kind}?{sel}")["items"]
        ]
    pols = plane.get(f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies?{sel}")["items"]
    return out + [f"networkpolicies/{p['metadata']['name']}" for p in pols]


GPU_ENV = {
    "TFDIST_GPU_NODE_SELECTOR": json.dumps(H100),
    "TFDIST_GPU_TOLERATIONS": json.dumps([GPU_TOL]),
    "TFDIST_KUEUE_QUEUE": "ml-team",
}


@pytest.mark.parametrize(
    ("who", "env", "kw", "expected"),
    [
        (
            "bob",
            {},
            {"workers": 1, "gpus_per_worker": 1},
            "exceed your quota of nvidia.com/gpu: it needs 1, 0 of 0",
        ),
        (
            "ann",
            GPU_ENV,
            {"workers": 2, "gpus_per_worker": 8},
            "exceed your quota of nvidia.com/gpu: it needs 16, 0 of 8",
        ),
        (
            "ann",
            GPU_ENV | {"TFDIST_KUEUE_QUEUE": ""},
            {"workers": 1, "gpus_per_worker": 1},
            "must go through the Kueue queue ml-team",
        ),
        (
            "ann",
            GPU_ENV | {"TFDIST_GPU_TOLERATIONS": json.dumps([GPU_TOL, {"operator": "Exists"}])},
            {"workers": 1, "gpus_per_worker": 1},
            "toleration |Exists|| is not allowed",
        ),
        (
            "ann",
            GPU_ENV | {"TFDIST_GPU_TOLERATIONS": "[]"},
            {"workers": 1, "gpus_per_worker": 1},
            "must carry the tolerations of your GPU model: nvidia.com/gpu|Exists||NoSchedule",
        ),
        (
            "ann",
            GPU_ENV | {"TFDIST_GPU_NODE_SELECTOR": "{}"},
            {"workers": 1, "gpus_per_worker": 1},
            "nodeSelector must include nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
        ),
    ],
    ids=["cpu-profile-gpus", "beyond-quota", "no-queue", "extra-toleration", "no-toleration", "no-selector"],
)
async def test_refused_jobs_say_why_in_one_sentence_and_create_nothing(
    k8s_plane, users, tmp_path, who, env, kw, expected
):
    ns = users[who]
    b = _backend(k8s_plane, _user_kubeconfig(k8s_plane, ns, tmp_path, who), ns, who, **env)
    name = f"j-{uuid.uuid4().hex[:6]}"
    try:
        with nothing_created(k8s_plane, ns, name), pytest.raises(JobSpecError) as e:
            await b.submit(JobSpec(name=name, user=who, backend="kubernetes", **kw), b"p", Launch())
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert _left(k8s_plane, ns, name) == []
    finally:
        await b.close()


async def test_quota_binds_even_without_the_kernels_check_and_a_good_job_is_admitted(
    k8s_plane, users, tmp_path, monkeypatch
):
    ns = users["ann"]
    b = _backend(k8s_plane, _user_kubeconfig(k8s_plane, ns, tmp_path, "ann"), ns, "ann", **GPU_ENV)
    try:
        await b.submit(
            JobSpec(name="fits", user="ann", backend="kubernetes", workers=2, gpus_per_worker=4),
            b"p",
            Launch(),
        )
        running = await collect(b, "fits", lambda ev: ev.type == "state" and ev.state == "running")
        assert running
        pods = k8s_plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3Dfits")["items"]
        assert len(pods) == 4
        worker = next(p for p in pods if p["metadata"]["labels"][kn.L_ROLE] == "worker")
        assert worker["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "ml-team"
        # without the kernel's own check the Job is created, but the quota keeps its pods from existing;
        # at --timeout the job is deleted with the quota's reason in one sentence
        monkeypatch.setattr(KubernetesBackend, "_check_quota", lambda self, spec: asyncio.sleep(0))
        spec = JobSpec(
            name="over", user="ann", backend="kubernetes", workers=1, gpus_per_worker=1, timeout_s=6
        )
        # every pod of the job, watched from before its submit: one created and deleted with the Job at
        # the timeout would pass a look afterwards
        with k8s_plane.watching(f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3Dover") as seen:
            await b.submit(spec, b"p", Launch())
            evs = await collect(b, "over", lambda ev: ev.type == "state" and ev.state == "failed")
        assert "exceed your quota of nvidia.com/gpu: it asks for 1 more, 8 of 8" in evs[-1].message, evs[-1]
        # (the watch worked: it saw the job's coordinator pod, which needs no GPU)
        assert [e for e in seen if e["type"] == "ADDED"], seen
        workers = [e for e in seen if e["object"]["metadata"].get("labels", {}).get(kn.L_ROLE) == "worker"]
        assert workers == [], [(e["type"], e["object"]["metadata"]["name"]) for e in workers]
        # and it was the quota that kept them out: the Job controller's FailedCreate says so
        refusals = [
            e["message"]
            for e in k8s_plane.get(f"/api/v1/namespaces/{ns}/events")["items"]
            if e["reason"] == "FailedCreate"
            and e["involvedObject"]["kind"] == "Job"
            and e["involvedObject"]["name"].startswith("over")
        ]
        assert any("exceeded quota" in m and "nvidia.com/gpu" in m for m in refusals), refusals
    finally:
        await b.stop("fits")
        await b.close()


async def test_the_next_job_waits_for_the_quota_the_last_one_is_letting_go_of(k8s_plane, users, tmp_path):
    """Two cells in a row: the second job's quota check must not fail because the first job's pods are still
    being deleted; a job that a RUNNING job keeps out is refused at once, as before."""
    ns = users["ann"]
    b = _backend(k8s_plane, _user_kubeconfig(k8s_plane, ns, tmp_path, "ann"), ns, "ann", **GPU_ENV)
    full = {"user": "ann", "backend": "kubernetes", "workers": 2, "gpus_per_worker": 4}
    try:
        await b.submit(JobSpec(name="first", **full), b"p", Launch())
        assert await collect(b, "first", lambda ev: ev.type == "state" and ev.state == "running")
        t0 = time.monotonic()
        with (
            nothing_created(k8s_plane, ns, "blocked"),
            pytest.raises(JobSpecError, match=r"exceed your quota of nvidia\.com/gpu: it needs 8, 8 of 8"),
        ):
            await b.submit(JobSpec(name="blocked", **full), b"p", Launch())
        assert time.monotonic() - t0 < 10, "a job kept out by a running job must be refused at once"
        assert _left(k8s_plane, ns, "blocked") == []

        await b.stop("first")  # the cell ended; its pods are on their way out
        t0 = time.monotonic()
        await b.submit(JobSpec(name="second", **full), b"p", Launch())
        print(f"\nfirst stopped -> second admitted after {time.monotonic() - t0:.1f}s")
        assert await collect(b, "second", lambda ev: ev.type == "state" and ev.state == "running")
    finally:
        for name in ("first", "second"):
            await b.stop(name)
        await b.close()


async def collect(b: KubernetesBackend, name: str, until, timeout: float = 60) -> list[Event]:
    out: list[Event] = []

    async def run() -> None:
        async for ev in b.watch(name):
            out.append(ev)
            if until(ev):
                return

    await asyncio.wait_for(run(), timeout)
    return out


async def test_same_job_name_in_two_users_namespaces(k8s_plane, users, tmp_path):
    ann = _backend(
        k8s_plane, _user_kubeconfig(k8s_plane, users["ann"], tmp_path, "ann"), users["ann"], "ann", **GPU_ENV
    )
    bob = _backend(k8s_plane, _user_kubeconfig(k8s_plane, users["bob"], tmp_path, "bob"), users["bob"], "bob")
    try:
        await ann.submit(JobSpec(name="same", user="ann", backend="kubernetes"), b"p", Launch())
        await bob.submit(JobSpec(name="same", user="bob", backend="kubernetes"), b"p", Launch())
        assert [j.name for j in await ann.list_jobs()] == ["same"]
        assert await ann.stop("same")
        assert len(_left(k8s_plane, users["bob"], "same")) >= 4  # bob's job untouched
        assert [j.name for j in await bob.list_jobs()] == ["same"]
    finally:
        await ann.close()
        await bob.stop("same")
        await bob.close()


# ------------------------------------------------------------------------------------ forged coordinator
class _Marker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, ("pwned",))


async def test_a_forged_coordinator_gets_no_token_no_payload_and_its_pickle_is_never_loaded(
    k8s_plane, k8s_namespace, tmp_path, monkeypatch
):
    """Another principal (here: an admin, as anyone who may create and label pods in a shared namespace)
    makes a pod that carries the job's chief labels, with its address pointing at a server it controls."""
    marker = tmp_path / "marker"
    seen: list[dict] = []
    evil = pickle.dumps(_Marker(str(marker)))

    class Forged(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _any(self) -> None:
            n = int(self.headers.get("Content-Length", "0"))
            seen.append({"path": self.path, "headers": dict(self.headers), "body": self.rfile.read(n)})
            body = (
                json.dumps({"first": 0, "events": [{"type": "state", "state": "succeeded"}]}).encode()
                if self.path.startswith("/events")
                else evil
            )
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_POST = _any

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Forged)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(kn, "AGENT_PORT", port)
    ns = k8s_namespace
    b = _backend(k8s_plane, k8s_plane.kubeconfig, ns, "ann")
    spec = JobSpec(name="victim", backend="kubernetes", user="ann", namespace=ns)
    try:
        await b.submit(spec, b"the victim's model and data", Launch())
        forged = {
            "metadata": {
                "name": "victim-chief-0-x",
                "labels": kn.labels(JobSpec(name="victim", user="ann"), "chief-0"),
            },
            "spec": {"nodeName": "nowhere", "containers": [{"name": "c", "image": IMAGE}]},
        }
        k8s_plane.request("POST", f"/api/v1/namespaces/{ns}/pods", forged)
        live = k8s_plane.get(f"/api/v1/namespaces/{ns}/pods/victim-chief-0-x")
        live["status"] = {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}
        k8s_plane.request("PUT", f"/api/v1/namespaces/{ns}/pods/victim-chief-0-x/status", live)
        events: list[Event] = []

        async def follow() -> None:
            async for ev in b.watch("victim"):
                events.append(ev)

        task = asyncio.ensure_future(follow())
        await asyncio.sleep(8)
        task.cancel()
        agent = b._jobs["victim"].agent
        assert agent is None or "127.0.0.1" not in agent.base_url  # only the root Job's own pod
        assert await b.stop("victim")
    finally:
        srv.shutdown()
        await b.close()
    assert seen == [], seen  # the forged address was never contacted: not even a probe
    assert not marker.exists()
    assert not any(e.type == "state" and e.state == "succeeded" for e in events), events


def test_the_magic_says_why_in_one_sentence_and_starts_nothing(k8s_plane, users, tmp_path):
    """%%tfdist run in a real kernel of a CPU-only user asking for GPUs, and with a toleration the admin
    did not allow: one sentence each, no traceback, no object of the job."""
    from tests.conftest import SETUP_CODE
    from tests.kernels import Kernel, kernel_env

    ns = users["bob"]
    env = kernel_env(
        str(tmp_path / "state"),
        KUBECONFIG=_user_kubeconfig(k8s_plane, ns, tmp_path, "bob"),
        TFDIST_BACKEND="kubernetes",
        TFDIST_NAMESPACE=ns,
        TFDIST_USER="bob",
        TFDIST_WORKER_IMAGE=IMAGE,
    )
    k = Kernel(env, cwd=str(tmp_path))
    try:
        assert k.execute(SETUP_CODE, timeout=240).error is None
        r = k.execute(
            "%%tfdist run --workers 2 --gpus-per-worker 1 --name greedy\n"
            "history = model.fit(train_ds, epochs=1, steps_per_epoch=2)\n",
            timeout=120,
        )
        assert r.error and "exceed your quota of nvidia.com/gpu: it needs 2, 0 of 0" in r.error_text, (
            r.error_text
        )
        assert "Traceback (most recent call last)" not in r.error_text + r.text, r.error_text
        assert _left(k8s_plane, ns, "greedy") == []
        r = k.execute("%tfdist list", timeout=60)
        assert "greedy" not in r.text
    finally:
        k.shutdown()
