"""Tenant escapes (issue 22) attacked as a user would, against a real API server: each request is made with
the user's own notebook service-account token in their own namespace (what `kubectl` from their notebook
can do), or with the hub's own token for the hub's bounds. Each of these requests went through before the
admission policies (hub_config/admission-policy.yaml, the bounds at the end of
hub_config/rbac-hub-tenancy.yaml), Pod Security `restricted` and the quota's caps."""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest

from tests import test_k8s_tenancy as tenancy_tests
from tests.test_k8s_tenancy import GPU_TOL, H100, IMAGE, NOTEBOOK, RESTRICTED, _token
from tfdist.kube import tenancy
from tfdist.kube.apply import prepare_user_namespace
from tfdist.kube.egress import EGRESS_POLICY
from tfdist.podidentity import DEFAULT as NOTEBOOK_IDENTITY

pytestmark = [pytest.mark.k8s]
# the hub (its RBAC and bounds, the admission policies) and two prepared users, as there
hub = tenancy_tests.hub
users = tenancy_tests.users


def call(plane, token: str, method: str, path: str, body: Any = None) -> tuple[int, dict]:
    """One API request with `token` (the user's kubectl): (status, the answer)."""
    req = urllib.request.Request(
        plane.server + path, data=None if body is None else json.dumps(body).encode(), method=method
    )
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, context=plane._ssl, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def refused(answer: tuple[int, dict], *words: str) -> None:
    code, body = answer
    assert code in (403, 422), f"admitted ({code}): {json.dumps(body)[:400]}"
    for w in words:
        assert w in body.get("message", ""), body.get("message")


def notebook_owner(plane, ns: str) -> dict[str, Any]:
    pod = plane.get(f"/api/v1/namespaces/{ns}/pods/{NOTEBOOK}")
    return {"apiVersion": "v1", "kind": "Pod", "name": NOTEBOOK, "uid": pod["metadata"]["uid"]}


QUEUED = {"kueue.x-k8s.io/queue-name": "ml-team"}


def gpu_job(plane, ns: str, name: str, **pod: Any) -> dict[str, Any]:
    """A Job the policy admits for ann (a GPU profile: H100s, queue ml-team), as the backend makes it."""
    container = {
        "name": "c",
        "image": IMAGE,
        "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}},
        "securityContext": dict(RESTRICTED),
    }
    spec = {
        "restartPolicy": "Never",
        "securityContext": NOTEBOOK_IDENTITY.security_context(),  # tfdist.kube.runas
        "containers": [container],
        "nodeSelector": dict(H100),
        "tolerations": [dict(GPU_TOL)],
        **pod,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "labels": dict(QUEUED),  # on the Job and its pods (the policy checks both)
            "ownerReferences": [notebook_owner(plane, ns)],
        },
        "spec": {"suspend": True, "template": {"metadata": {"labels": dict(QUEUED)}, "spec": spec}},
    }


def cpu_job(plane, ns: str, name: str) -> dict[str, Any]:
    job = gpu_job(plane, ns, name)
    pod = job["spec"]["template"]["spec"]
    pod["containers"][0]["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
    del pod["nodeSelector"], pod["tolerations"]
    return job


@pytest.fixture
def ann(k8s_plane, users):
    ns = users["ann"]
    return ns, _token(k8s_plane, ns, tenancy.NOTEBOOK_SA)


def jobs_path(ns: str) -> str:
    return f"/apis/batch/v1/namespaces/{ns}/jobs"


def updated(plane, token: str, item: str, change) -> tuple[int, dict]:
    """PUT `item` back with `change` made to it, as the user: the Job controller writes its status in
    between, so it is read again on a conflict."""
    answer: tuple[int, dict] = (0, {})
    for _ in range(10):
        live = call(plane, token, "GET", item)[1]
        change(live)
        answer = call(plane, token, "PUT", item, live)
        if answer[0] != 409:
            return answer
    return answer


# ------------------------------------------------------------------------------ HIGH 3: Job UPDATE
def test_a_suspended_jobs_template_cannot_be_swapped_for_what_create_refuses(k8s_plane, ann):
    ns, token = ann
    name = f"sw-{uuid.uuid4().hex[:6]}"
    code, job = call(k8s_plane, token, "POST", jobs_path(ns), gpu_job(k8s_plane, ns, name))
    assert code == 201, job
    item = f"{jobs_path(ns)}/{name}"

    def update(change) -> tuple[int, dict]:
        return updated(k8s_plane, token, item, change)

    def tolerate_all(j):
        j["spec"]["template"]["spec"]["tolerations"].append({"operator": "Exists"})

    def other_model(j):
        j["spec"]["template"]["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}

    def more_gpus(j):
        j["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "2"

    def no_queue(j):  # (a Job left without labels takes its template's, queue included)
        j["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "other"

    def unowned(j):
        j["metadata"].pop("ownerReferences")

    # the template and labels are frozen: what the parameters bound there was judged at the creation
    for change in (tolerate_all, other_model, more_gpus, no_queue):
        refused(update(change), "cannot change after it is created")
    refused(update(unowned), "must be owned by your notebook server's pod")
    live = call(k8s_plane, token, "GET", item)[1]
    tpl = live["spec"]["template"]["spec"]
    assert tpl["tolerations"] == [GPU_TOL] and tpl["nodeSelector"] == H100
    # what the backend does is still allowed: resume, renew the deadline (the lifeline)
    code, body = update(lambda j: j["spec"].update(suspend=False, activeDeadlineSeconds=600))
    assert code == 200, body


# ---------------------------------------------------------------- HIGH 4: GPUs without requesting GPUs
@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            lambda c, p, m: c.setdefault("env", []).append(
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}
            ),
            ["NVIDIA_VISIBLE_DEVICES is not allowed"],
        ),
        (lambda c, p, m: p.update(runtimeClassName="nvidia"), ["runtimeClassName nvidia is not allowed"]),
        (lambda c, p, m: p.update(tolerations=[dict(GPU_TOL)]), ["may not tolerate the GPU nodes"]),
        (lambda c, p, m: p.update(nodeName="gpu-node-0"), ["may not name their node"]),
        (
            lambda c, p, m: c.update(envFrom=[{"secretRef": {"name": "mine"}}]),
            ["envFrom is not allowed"],
        ),
        (
            lambda c, p, m: m.update(annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}),
            ["cdi.k8s.io/gpu is not allowed"],
        ),
        (
            lambda c, p, m: p.update(
                tolerations=[{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}]
            ),
            ["not allowed"],
        ),
    ],
    ids=["nvidia-env", "runtime-class", "gpu-toleration", "node-name", "env-from", "cdi", "not-ready"],
)
def test_a_pod_without_a_gpu_request_gets_no_gpu_by_other_means(k8s_plane, ann, change, words):
    ns, token = ann
    job = cpu_job(k8s_plane, ns, f"g-{uuid.uuid4().hex[:6]}")
    tpl = job["spec"]["template"]
    change(tpl["spec"]["containers"][0], tpl["spec"], tpl["metadata"])
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), *words)


def test_the_gpu_cap_counts_the_whole_pod(k8s_plane, ann):
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"cap-{uuid.uuid4().hex[:6]}")
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    c["resources"]["limits"]["nvidia.com/gpu"] = "8"  # the profile's per-pod maximum
    pod["containers"].append({**copy.deepcopy(c), "name": "d"})
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "at most 8 nvidia.com/gpu per pod")


# ------------------------------------------- Kueue's own keys: a GPU pod passing for a CPU pod in its group
@pytest.mark.parametrize(
    ("where", "key"),
    [
        # Kueue keeps a role hash it finds on a pod and builds each pod set from the first pod of a hash: a
        # GPU pod with the hash of the group's CPU pod would be admitted as that CPU pod (its GPUs never
        # counted by the queue)
        ("template-annotations", "kueue.x-k8s.io/role-hash"),
        ("template-annotations", "kueue.x-k8s.io/pod-group-fast-admission"),
        ("template-labels", "kueue.x-k8s.io/prebuilt-workload-name"),
        ("job-annotations", "kueue.x-k8s.io/pod-group-serving"),
        ("job-labels", "kueue.x-k8s.io/managed"),
    ],
    ids=["role-hash", "fast-admission", "prebuilt-workload", "job-annotation", "job-label"],
)
def test_kueues_own_keys_cannot_come_from_the_user(k8s_plane, ann, where, key):
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"kq-{uuid.uuid4().hex[:6]}")
    tpl = job["spec"]["template"]
    # the pod group keys the backend sets (tfdist.kube.queueing.with_pod_group) are the control: admitted
    group = {"kueue.x-k8s.io/pod-group-name": job["metadata"]["name"]}
    counts = {"kueue.x-k8s.io/pod-group-total-count": "2", "kueue.x-k8s.io/retriable-in-group": "false"}
    tpl["metadata"]["labels"].update(group)
    tpl["metadata"]["annotations"] = dict(counts)
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    meta = {
        "template-annotations": tpl["metadata"]["annotations"],
        "template-labels": tpl["metadata"]["labels"],
        "job-annotations": job["metadata"].setdefault("annotations", {}),
        "job-labels": job["metadata"]["labels"],
    }[where]
    meta[key] = "deadbeef" if key.endswith("role-hash") else "true"
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), f"{key} is not allowed")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


def test_a_job_may_not_name_a_controller_owner(k8s_plane, ann):
    """A controller owner reference makes Kueue walk up from the Job's pods to their owner: under a pod
    Kueue manages (the user's queued notebook, or a running job's pod) it takes them for that pod's and
    never gates them. The backend's plain owner reference is the control."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"ctl-{uuid.uuid4().hex[:6]}")
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    job["metadata"]["ownerReferences"][0]["controller"] = True
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "may not be controllers")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


@pytest.fixture
def bob(k8s_plane, users):
    """A CPU-only profile: no GPUs and no Kueue queue."""
    ns = users["bob"]
    return ns, _token(k8s_plane, ns, tenancy.NOTEBOOK_SA)


def test_no_priority_class_without_a_queue_either(k8s_plane, bob):
    """Without a queue the scheduler preempts for a pod's priority itself, and system-node-critical may be
    named in any namespace: bob's job would evict other users' pods, the hub's and DNS to make room."""
    ns, token = bob
    job = cpu_job(k8s_plane, ns, f"prio-{uuid.uuid4().hex[:6]}")
    job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"] = {}, {}
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    job["spec"]["template"]["spec"]["priorityClassName"] = "system-node-critical"
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "may not pick a priority class")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


def test_a_job_is_deleted_only_with_what_it_owns(k8s_plane, ann):
    """A bare DELETE of a batch/v1 Job orphans its pods, worker Jobs and objects (Kubernetes' default for
    that version), as --cascade=orphan does: they would run on, GPUs and the queue's admission held, after
    the lifeline, the server and the user are gone. The backend's Background delete is the control."""
    ns, token = ann
    owner = _owned_by_job(k8s_plane, token, ns)
    item = f"{jobs_path(ns)}/{owner['name']}"
    refused(call(k8s_plane, token, "DELETE", item), "propagationPolicy Background or Foreground")
    refused(call(k8s_plane, token, "DELETE", item, {"propagationPolicy": "Orphan"}), "--cascade=orphan")
    refused(call(k8s_plane, token, "DELETE", item, {"orphanDependents": True}), "propagationPolicy")
    assert k8s_plane.get(item) is not None
    code, body = call(k8s_plane, token, "DELETE", item, {"propagationPolicy": "Background"})
    assert code == 200, body


def test_no_finalizers_that_would_keep_a_job_after_its_owner(k8s_plane, ann):
    """A finalizer nobody removes keeps a Job, or its pods (the Job controller copies the template's),
    after the garbage collector deletes it with the notebook's pod; `orphan` added later orphans them."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"fin-{uuid.uuid4().hex[:6]}")
    job["metadata"]["finalizers"] = ["example.com/keep"]
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "finalizers are not allowed")
    del job["metadata"]["finalizers"]
    job["spec"]["template"]["metadata"]["finalizers"] = ["example.com/keep"]
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "finalizers are not allowed")
    del job["spec"]["template"]["metadata"]["finalizers"]
    code, made = call(k8s_plane, token, "POST", jobs_path(ns), job)
    assert code == 201, made
    item = f"{jobs_path(ns)}/{job['metadata']['name']}"
    answer = updated(k8s_plane, token, item, lambda j: j["metadata"].__setitem__("finalizers", ["orphan"]))
    refused(answer, "finalizers are not allowed")
    assert not k8s_plane.get(item)["metadata"].get("finalizers")
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": made["metadata"]["name"]}
    secret = {
        "metadata": {
            "name": f"fin-{uuid.uuid4().hex[:6]}",
            "ownerReferences": [{**owner, "uid": made["metadata"]["uid"]}],
            "finalizers": ["example.com/keep"],
        }
    }
    refused(call(k8s_plane, token, "POST", f"/api/v1/namespaces/{ns}/secrets", secret), "finalizers")


@pytest.mark.parametrize(
    "volume",
    [
        # any export a CSI driver reaches, read-write (the team's read-only dataset among them)
        {"csi": {"driver": "nfs.csi.k8s.io", "volumeAttributes": {"server": "10.0.0.9", "share": "/data"}}},
        # a claim of any storage class, or bound to an Available PV the admin made for someone else
        {
            "ephemeral": {
                "volumeClaimTemplate": {
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "volumeName": "pv-for-someone-else",
                        "resources": {"requests": {"storage": "1Gi"}},
                    }
                }
            }
        },
    ],
    ids=["inline-csi", "ephemeral-claim"],
)
def test_only_plain_volumes_and_the_profiles_claims(k8s_plane, ann, volume):
    """Pod Security `restricted` admits inline CSI and generic ephemeral volumes; the policy's own list does
    not. An emptyDir, a Secret and a projected token are the control."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"vol-{uuid.uuid4().hex[:6]}")
    pod = job["spec"]["template"]["spec"]
    pod["volumes"] = [
        {"name": "scratch", "emptyDir": {}},
        {"name": "token", "secret": {"secretName": "mine"}},
        {"name": "sa", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}},
    ]
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    pod["volumes"].append({"name": "data", **volume})
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "volume data is not allowed")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


@pytest.mark.parametrize(
    ("where", "key"),
    [
        # Multus: a secondary network (another namespace's, by default), which no NetworkPolicy covers
        ("template", "k8s.v1.cni.cncf.io/networks"),
        # Calico: an address or pool of the pod's choosing
        ("template", "cni.projectcalico.org/ipAddrs"),
        ("job", "k8s.v1.cni.cncf.io/networks"),
    ],
    ids=["multus", "calico-address", "on-the-job"],
)
def test_no_annotations_that_the_clusters_programs_act_on(k8s_plane, ann, where, key):
    """Only the backend's own annotations (tfdist.io/, and Kueue's pod group counts: the control)."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"an-{uuid.uuid4().hex[:6]}")
    tpl = job["spec"]["template"]["metadata"]
    tpl["annotations"] = {"tfdist.io/ps-restarts": "3", "kueue.x-k8s.io/pod-group-total-count": "1"}
    tpl["labels"]["kueue.x-k8s.io/pod-group-name"] = job["metadata"]["name"]
    job["metadata"]["annotations"] = {"tfdist.io/spec": "{}"}
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    meta = tpl if where == "template" else job["metadata"]
    meta["annotations"][key] = "other-team/fabric" if "networks" in key else '["10.0.0.7"]'
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), f"annotation {key} is not allowed")


def test_a_zero_gpu_request_makes_no_gpu_pod(k8s_plane, ann):
    """`nvidia.com/gpu: 0` asks for no GPU: it must not pass for a GPU pod and take the GPU nodes'
    toleration (there an image's own NVIDIA_VISIBLE_DEVICES=all would see every GPU, none allocated)."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"zero-{uuid.uuid4().hex[:6]}")
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "0"
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "may not tolerate the GPU nodes")


# ---------------------------------------------------- HIGH 2: Services that capture addresses, and more
def test_affinity_cannot_reach_other_users_pods(k8s_plane, ann, users):
    """A required anti-affinity over every namespace against bob's pods (their labels are computable from
    his name) keeps his notebook and jobs off every node while ann's one CPU pod lives; affinity tells her
    whether they exist. %%tfdist sets no affinity, so none is admitted (its lists are unbounded too); the
    same Job without it is the control."""
    from tfdist.kube import names

    ns, token = ann
    job = cpu_job(k8s_plane, ns, f"aff-{uuid.uuid4().hex[:6]}")
    pod = job["spec"]["template"]["spec"]
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    bobs = {"labelSelector": {"matchLabels": {names.L_USER: names.user_label("bob")}}}
    terms = {
        "anti-everywhere": ("podAntiAffinity", "required", {**bobs, "namespaceSelector": {}}),
        "anti-his-namespace": ("podAntiAffinity", "required", {**bobs, "namespaces": [users["bob"]]}),
        "affinity-probe": ("podAffinity", "preferred", {**bobs, "namespaceSelector": {}}),
        "own-namespace": ("podAntiAffinity", "required", {"labelSelector": {"matchLabels": {"app": "x"}}}),
    }
    for kind, when, term in terms.values():
        term = {**term, "topologyKey": "kubernetes.io/os"}
        rule = [term] if when == "required" else [{"weight": 100, "podAffinityTerm": term}]
        pod["affinity"] = {kind: {f"{when}DuringSchedulingIgnoredDuringExecution": rule}}
        refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "affinity", "not allowed")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


def test_a_pod_being_deleted_does_not_keep_its_gpus_for_long(k8s_plane, ann):
    """A grace period of a year (and a PID 1 that ignores SIGTERM): preemption, the lifeline, the server's
    stop and culling all delete gracefully, so the pod would run on, its GPUs held. 30 s is admitted."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"tg-{uuid.uuid4().hex[:6]}", terminationGracePeriodSeconds=30)
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 31536000
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "terminationGracePeriodSeconds 31536000")


def test_a_job_cannot_leave_pods_without_end(k8s_plane, bob):
    """The Job controller keeps each finished pod until its Job is deleted, and the quota counts only
    running ones: 100000 completions, retries without end (a huge backoffLimit, a podFailurePolicy that
    ignores failures) or more tasks than the namespace's pods would fill the API server's store. The
    backend's shapes (an Indexed Job, a task each, backoffLimitPerIndex 3) are the control."""
    ns, token = bob

    def job(**spec: Any) -> dict[str, Any]:
        j = cpu_job(k8s_plane, ns, f"many-{uuid.uuid4().hex[:6]}")
        j["metadata"]["labels"], j["spec"]["template"]["metadata"]["labels"] = {}, {}
        j["spec"].update(spec)
        return j

    indexed = {"completionMode": "Indexed", "completions": 2, "parallelism": 2}
    for ok in ({}, {**indexed, "backoffLimitPerIndex": 3, "maxFailedIndexes": 2}, {"backoffLimit": 0}):
        code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job(**ok))
        assert code == 201, (ok, body)
    ignore = {"rules": [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [1]}}]}
    for bad, says in (
        ({"completions": 100000, "parallelism": 30}, "completions must equal parallelism"),
        ({"completions": 1000, "parallelism": 1000}, "at most 20 (your namespace"),
        ({"backoffLimit": 100000}, "backoffLimit at most 6"),
        ({**indexed, "backoffLimitPerIndex": 1000, "maxFailedIndexes": 2}, "backoffLimitPerIndex at most 3"),
        ({"podFailurePolicy": ignore}, "no podFailurePolicy"),
    ):
        j = job(**bad)
        refused(call(k8s_plane, token, "POST", jobs_path(ns), j), says)
        assert k8s_plane.get(f"{jobs_path(ns)}/{j['metadata']['name']}") is None


def test_no_hugepages_which_no_quota_counts(k8s_plane, bob):
    ns, token = bob
    job = cpu_job(k8s_plane, ns, f"hp-{uuid.uuid4().hex[:6]}")
    job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"] = {}, {}
    res = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    res["limits"]["hugepages-2Mi"] = "1Gi"
    res["requests"] = {"hugepages-2Mi": "1Gi", "cpu": "1", "memory": "1Gi"}
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "hugepages (hugepages-2Mi) are not allowed")


def _our_network_policy(plane, ns: str, token: str) -> tuple[str, dict[str, Any]]:
    """%%tfdist's own policy for a job of ann's (owned by a Job of hers), admitted as it is (the control):
    the collection's path and the policy, to be made worse."""
    from tfdist.jobspec import JobSpec
    from tfdist.kube.access import network_policy

    owner = _owned_by_job(plane, token, ns)
    netpols = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
    ours = network_policy(
        JobSpec(name=f"np-{uuid.uuid4().hex[:6]}", user="ann"), owner, {"app": "jupyterhub"}
    )
    code, body = call(plane, token, "POST", netpols + "?dryRun=All", ours)
    assert code == 201, body
    return netpols, ours


def _owned_by_job(plane, token: str, ns: str) -> dict[str, Any]:
    name = f"own-{uuid.uuid4().hex[:6]}"
    code, job = call(plane, token, "POST", jobs_path(ns), cpu_job(plane, ns, name))
    assert code == 201, job.get("message", job)
    return {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"]}


ONLY_CLUSTER_IP = "only ClusterIP or headless Services"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        # the real node's address (the hub API's, on scripts/cluster): any address but loopback, which the
        # API server refuses anyway. Refused first by the API server's DenyServiceExternalIPs (the plane
        # runs it, as docs/security.md asks of every cluster); the policy's own clause is the second layer
        (
            {"externalIPs": ["10.99.0.1"], "ports": [{"port": 8081}]},
            "Use of external IPs is denied by admission control",
        ),
        ({"type": "NodePort", "ports": [{"port": 80}]}, ONLY_CLUSTER_IP),
        ({"type": "LoadBalancer", "ports": [{"port": 80}]}, ONLY_CLUSTER_IP),
        ({"type": "ExternalName", "externalName": "hub.jhub.svc.cluster.local"}, ONLY_CLUSTER_IP),
    ],
    ids=["external-ips", "node-port", "load-balancer", "external-name"],
)
def test_a_user_service_cannot_reach_past_the_namespace(k8s_plane, ann, spec, says):
    ns, token = ann
    owner = _owned_by_job(k8s_plane, token, ns)
    svc = {"metadata": {"name": f"s-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]}, "spec": spec}
    refused(call(k8s_plane, token, "POST", f"/api/v1/namespaces/{ns}/services", svc), says)
    # a job's own headless Service is still fine
    ok = {
        "metadata": {"name": f"h-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]},
        "spec": {"clusterIP": "None", "ports": [{"port": 2222}]},
    }
    code, body = call(k8s_plane, token, "POST", f"/api/v1/namespaces/{ns}/services", ok)
    assert code == 201, body


CLUSTER_ADDRESS = "a Service with a cluster address (not headless, clusterIP: None) is only a returning"


def _ps_shaped(**spec: Any) -> dict[str, Any]:
    return {
        "selector": {"tfdist.io/role": "ps", "batch.kubernetes.io/job-completion-index": "0"},
        "ports": [{"name": "tf", "port": 2222}],
        **spec,
    }


@pytest.mark.parametrize(
    "spec",
    [
        {"selector": {"app": "x"}, "ports": [{"port": 80}]},  # any ClusterIP Service: an address for each
        _ps_shaped(selector={"tfdist.io/role": "ps"}),  # every PS of the namespace behind one address
        _ps_shaped(ports=[{"name": "a", "port": 2222}, {"name": "b", "port": 2223}]),
    ],
    ids=["any-selector", "no-index", "two-ports"],
)
def test_a_cluster_address_only_for_a_returning_ps(k8s_plane, ann, spec):
    """Each Service with a cluster address takes one from the one Service range that every team, the hub
    and kube-system share, and no quota tells it from a headless one (finding 8 of stop 42's review): only
    %%tfdist's returning PS gets one (tfdist.kube.access.ps_service). Each was admitted before; the
    backend's own PS Service passes."""
    from tfdist.jobspec import JobSpec
    from tfdist.kube.access import ps_service

    ns, token = ann
    owner = _owned_by_job(k8s_plane, token, ns)
    services = f"/api/v1/namespaces/{ns}/services"
    svc = {"metadata": {"name": f"s-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]}, "spec": spec}
    refused(call(k8s_plane, token, "POST", services + "?dryRun=All", svc), CLUSTER_ADDRESS)
    spec_ = JobSpec(name=f"ps-{uuid.uuid4().hex[:6]}", user="ann", checkpoint_every=10)
    ours = ps_service(spec_, "ps-0", owner)
    code, body = call(k8s_plane, token, "POST", services + "?dryRun=All", ours)
    assert code == 201, body


def test_no_service_account_token_secret_no_egress_policy_no_unowned_objects(k8s_plane, ann):
    ns, token = ann
    owner = _owned_by_job(k8s_plane, token, ns)
    forever = {
        "metadata": {
            "name": "forever",
            "annotations": {"kubernetes.io/service-account.name": tenancy.NOTEBOOK_SA},
            "ownerReferences": [owner],
        },
        "type": "kubernetes.io/service-account-token",
    }
    refused(call(k8s_plane, token, "POST", f"/api/v1/namespaces/{ns}/secrets", forever), "Opaque")
    egress = {
        "metadata": {"name": "out", "ownerReferences": [owner]},
        "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]},
    }
    refused(
        call(k8s_plane, token, "POST", f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies", egress),
        "only admit ingress",
    )
    # objects that would outlive the server: no owner, or one that never ends (the quota, which users
    # may list, so its UID is known)
    refused(
        call(k8s_plane, token, "POST", f"/api/v1/namespaces/{ns}/secrets", {"metadata": {"name": "loose"}}),
        "must be owned by one of your jobs",
    )
    job = cpu_job(k8s_plane, ns, f"loose-{uuid.uuid4().hex[:6]}")
    del job["metadata"]["ownerReferences"]
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "owned by your notebook server's pod")
    quota = call(k8s_plane, token, "GET", f"/api/v1/namespaces/{ns}/resourcequotas")[1]["items"][0]
    job["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ResourceQuota", "name": tenancy.QUOTA, "uid": quota["metadata"]["uid"]}
    ]
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "owned by your notebook server's pod")


def test_the_hubs_policies_and_objects_cannot_be_deleted_by_the_user(k8s_plane, ann):
    """The namespace's default deny, its egress limits and the notebook's ingress rule are the hub's: a user
    who deleted them (their Role may delete by name, for a submit's rollback) would lift every egress limit
    until their next spawn. Only objects one of their jobs owns may go; the job's own policy still does."""
    ns, token = ann
    netpols = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
    hubs = {p["metadata"]["name"] for p in k8s_plane.get(netpols)["items"]}
    assert {tenancy.DENY_POLICY, EGRESS_POLICY, "tfdist-notebook-ingress"} <= hubs, hubs
    for name in sorted(hubs):
        refused(call(k8s_plane, token, "DELETE", f"{netpols}/{name}"), "only what one of your jobs owns")
    assert {p["metadata"]["name"] for p in k8s_plane.get(netpols)["items"]} == hubs
    # an object the hub made with no job owner: a Secret and a Service of the user's namespace
    for kind in ("secrets", "services"):
        path = f"/api/v1/namespaces/{ns}/{kind}"
        body = {"metadata": {"name": f"hubs-{uuid.uuid4().hex[:6]}"}}
        if kind == "services":
            body["spec"] = {"clusterIP": "None", "ports": [{"port": 2222}]}
        made = k8s_plane.request("POST", path, body)
        gone = call(k8s_plane, token, "DELETE", f"{path}/{made['metadata']['name']}")
        refused(gone, "only what one of your jobs owns")
        assert k8s_plane.get(f"{path}/{made['metadata']['name']}") is not None
    # the control: a job's own ingress policy is the user's to delete (a submit's rollback)
    owner = _owned_by_job(k8s_plane, token, ns)
    mine = {
        "metadata": {"name": f"job-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]},
    }
    code, body = call(k8s_plane, token, "POST", netpols, mine)
    assert code == 201, body
    code, body = call(k8s_plane, token, "DELETE", f"{netpols}/{mine['metadata']['name']}")
    assert code == 200, body


# ----------------------------------------------------------- MEDIUM: Pod Security restricted, caps
def _run_as(**sc: Any):
    return lambda pod: pod.__setitem__("securityContext", sc)


def _container_runs_as(**sc: Any):
    return lambda pod: pod["containers"][0]["securityContext"].update(sc)


@pytest.mark.parametrize(
    "change, words",
    [
        # another user's files on the shared data volumes: their UID, or a group the notebook is not in
        (_run_as(runAsUser=2001, runAsGroup=1000), ("must run as your notebook", "runAsUser 1000")),
        (_run_as(runAsUser=1000, runAsGroup=2001), ("runAsGroup 1000",)),
        (_container_runs_as(runAsUser=2001), ("container c must run as your notebook",)),
        (_container_runs_as(runAsGroup=0), ("container c must run as your notebook",)),
        # the image's own user: whatever an image the user built says
        (_run_as(), ("container c must run as your notebook",)),
        # an fsGroup: the kubelet makes every file of the volume that group's, recursively, on mount
        (_run_as(runAsUser=1000, runAsGroup=1000, fsGroup=4242), ("fsGroup 4242 is not your notebook's",)),
        (_run_as(runAsUser=1000, runAsGroup=1000, supplementalGroups=[0]), ("supplementary group 0",)),
    ],
)
def test_a_job_runs_as_its_notebook_on_the_shared_data_volumes(k8s_plane, ann, change, words):
    """Pod Security `restricted` refuses only UID 0: a job pod could run as another user's UID, a group the
    notebook is not in, or with an fsGroup, and read or overwrite other users' files on the profile's shared
    data volumes (finding 9 of the security review). Each was admitted before; the backend's identity (the
    notebook's, tfdist.podidentity) passes."""
    ns, token = ann
    ok = gpu_job(k8s_plane, ns, "runs-as")
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", ok)
    assert code == 201, body
    job = gpu_job(k8s_plane, ns, "runs-as")
    change(job["spec"]["template"]["spec"])
    refused(call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job), *words)


TEAM_IMAGES = r"registry\.example\.org/team/[a-z-]+:[0-9.]+"


@pytest.mark.parametrize(
    "image",
    [
        "docker.io/attacker/etc-group:1",  # its own /etc/group, or 40 GB of layers on every node's disk
        "registry.example.org/team/notebook:1.0-evil",  # the pattern matches whole, never a prefix
        "x" + IMAGE,  # the list's images exactly
        "registry.example.org/team/private:1",  # another user's, cached on the node: by pattern only
    ],
)
async def test_a_job_runs_only_the_images_its_profile_offers(k8s_plane, users, image):
    """Finding 10 of stop 42's review (and the image's /etc/group beside the pinned uid): a job pod may run
    only the profile's images, its worker image, or what its free-form pattern matches whole. Each was
    admitted before; the profile's own pass."""
    from tests.test_k8s_tenancy import _api_for_token, gpu_policy

    ns = users["ann"]
    private = "registry.example.org/team/private:1" == image
    pattern = r"registry\.example\.org/team/(?:notebook|worker):[0-9.]+" if private else TEAM_IMAGES
    policy = gpu_policy("ann", ns, hub_namespace=users["hub"], images=(IMAGE,), image_pattern=pattern)
    async with _api_for_token(k8s_plane, _token(k8s_plane, users["hub"], "hub")) as api:
        await prepare_user_namespace(api, policy)
    token = _token(k8s_plane, ns, tenancy.NOTEBOOK_SA)
    for ok in (IMAGE, "registry.example.org/team/notebook:1.0"):
        job = gpu_job(k8s_plane, ns, "img")
        job["spec"]["template"]["spec"]["containers"][0]["image"] = ok
        code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
        assert code == 201, body
    job = gpu_job(k8s_plane, ns, "img")
    job["spec"]["template"]["spec"]["containers"][0]["image"] = image
    refused(
        call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job),
        f"image {image} is not one your profiles offer ({IMAGE}, or matching ",
    )


async def test_a_running_jobs_lifeline_outlives_a_change_of_the_parameters(k8s_plane, users):
    """The lifeline renews a running job's deadline with an UPDATE; the Job's template, labels and
    parallelism are frozen, so what the parameters bound there was checked at its creation. Checked again
    against the parameters of now, the renewal was refused once they changed (another profile's server
    started with another GPU model, queue or images; the policy's identity rolled out over old parameters)
    and the job ended at its deadline (review of this stop; before, the GPU model's change alone did it)."""
    from tests.test_k8s_tenancy import _api_for_token, gpu_policy

    ns, hub = users["ann"], users["hub"]
    token = _token(k8s_plane, ns, tenancy.NOTEBOOK_SA)
    # a profile whose GPU pods carry two more tolerations (the admin's node pools)
    pools = [{"key": f"pool-{p}", "operator": "Exists", "effect": "NoSchedule"} for p in "ab"]
    async with _api_for_token(k8s_plane, _token(k8s_plane, hub, "hub")) as api:
        first = gpu_policy("ann", ns, hub_namespace=hub, images=(IMAGE,), tolerations=[GPU_TOL, *pools])
        await prepare_user_namespace(api, first)
        job = gpu_job(k8s_plane, ns, f"life-{uuid.uuid4().hex[:6]}", tolerations=[GPU_TOL, *pools])
        code, body = call(k8s_plane, token, "POST", jobs_path(ns), job)
        assert code == 201, body
        item = f"{jobs_path(ns)}/{job['metadata']['name']}"
        # the parameters change under it (the user started another server, of a profile with another GPU
        # model, no queue and other images) and have no identity keys at all (made before the pinning)
        other = {
            "gpu_resource": "nvidia.com/mig-1g.10gb",
            "node_selector": {"nvidia.com/mig.config": "all-1g.10gb"},
            "tolerations": [],
            "required_tolerations": [],
            "queue": "",
            "images": ("other:1",),
        }
        await prepare_user_namespace(api, gpu_policy("ann", ns, hub_namespace=hub, **other))
    params = f"/api/v1/namespaces/{ns}/configmaps/{tenancy.POLICY_PARAMS}"
    live = k8s_plane.get(params)
    for key in ("runAsUser", "runAsGroup", "fsGroup", "supplementalGroups"):
        del live["data"][key]
    k8s_plane.request("PUT", params, live)

    def renew(j: dict) -> None:
        j["spec"]["activeDeadlineSeconds"] = 600

    code, body = updated(k8s_plane, token, item, renew)
    assert code == 200, body

    # the template stays frozen: a changed one is still refused
    def swap_image(j: dict) -> None:
        j["spec"]["template"]["spec"]["containers"][0]["image"] = "other:1"

    refused(updated(k8s_plane, token, item, swap_image))
    # and a new Job is held to the parameters of now
    fresh = gpu_job(k8s_plane, ns, "fresh")
    answer = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", fresh)
    refused(answer, "allows only the GPU resource")
    # but resuming a suspended Job is judged as its creation was: one kept suspended from before a policy
    # (or made by someone the policy does not see) is not resumed past it
    code, body = updated(k8s_plane, token, item, lambda j: j["spec"].update(suspend=False))
    refused((code, body), "allows only the GPU resource")


async def test_a_job_kept_suspended_from_before_the_policy_is_not_resumed_past_it(k8s_plane, ann):
    """A Job made before the admin applied this policy (here: by the admin, whom the policy does not
    judge), kept suspended, owned by the user's notebook, running as another user's UID: the UPDATE that
    resumes it is judged as a creation would be (review of this stop: the UPDATE exemption let it through),
    while renewing its deadline alone still passes (its template is frozen and runs nothing)."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"old-{uuid.uuid4().hex[:6]}")
    job["spec"]["template"]["spec"]["securityContext"] = {"runAsUser": 2001, "runAsGroup": 2001}
    k8s_plane.request("POST", jobs_path(ns), job)  # the cluster admin's token
    item = f"{jobs_path(ns)}/{job['metadata']['name']}"
    code, body = updated(k8s_plane, token, item, lambda j: j["spec"].update(activeDeadlineSeconds=600))
    assert code == 200, body
    refused(
        updated(k8s_plane, token, item, lambda j: j["spec"].update(suspend=False)),
        "must run as your notebook",
    )
    assert k8s_plane.get(item)["spec"]["suspend"] is True


def test_a_jobs_pod_gets_no_net_raw_and_no_root(k8s_plane, users):
    """NET_RAW would let a pod spoof ARP on the node's bridge and send packets as another pod; Pod Security
    `baseline` allowed it (and root). The Job is admitted; the Job controller gets no pod for it."""
    ns = users["bob"]
    token = _token(k8s_plane, ns, tenancy.NOTEBOOK_SA)
    name = f"raw-{uuid.uuid4().hex[:6]}"
    job = cpu_job(k8s_plane, ns, name)
    job["metadata"]["labels"] = {}
    job["spec"]["suspend"] = False
    # no securityContext: root, and the runtime's default capabilities, NET_RAW among them
    del job["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    code, body = call(k8s_plane, token, "POST", jobs_path(ns), job)
    assert code == 201, body
    deadline = time.monotonic() + 30
    while True:
        sel = "fieldSelector=reason%3DFailedCreate"
        evs = k8s_plane.get(f"/api/v1/namespaces/{ns}/events?{sel}")["items"]
        msgs = [e["message"] for e in evs if e["involvedObject"]["name"] == name]
        if msgs:
            break
        assert time.monotonic() < deadline, "the Job controller neither created a pod nor was refused"
        time.sleep(0.5)
    assert any("violates PodSecurity" in m and "restricted" in m for m in msgs), msgs
    assert not k8s_plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=job-name%3D{name}")["items"]


async def test_object_counts_are_capped(k8s_plane, users):
    """A user who creates Secrets (or Jobs, Services, claims) without end fills the API server for everyone:
    every user namespace's quota caps them by default."""
    ns = users["bob"]
    quota = k8s_plane.get(f"/api/v1/namespaces/{ns}/resourcequotas/{tenancy.QUOTA}")["spec"]["hard"]
    for key in (
        "count/jobs.batch",
        "count/pods",
        "services",
        "secrets",
        "count/networkpolicies.networking.k8s.io",
        "persistentvolumeclaims",
        "requests.storage",
    ):
        assert key in quota, quota
    assert "requests.ephemeral-storage" in quota and "limits.ephemeral-storage" in quota
    # the cap binds: one namespace with room for one Secret
    carl = f"{users['hub']}-carl-{uuid.uuid4().hex[:4]}"
    policy = tenancy.TenantPolicy(
        user="carl", namespace=carl, gpu_quota={"nvidia.com/gpu": 0}, secrets_quota=1, policies_quota=1
    )
    from tests.test_k8s_tenancy import _api_for_token, notebook_pod

    async with _api_for_token(k8s_plane, _token(k8s_plane, users["hub"], "hub")) as api:
        await prepare_user_namespace(api, policy)
    try:
        notebook_pod(k8s_plane, carl, "carl")
        token = _token(k8s_plane, carl, tenancy.NOTEBOOK_SA)
        owner = _owned_by_job(k8s_plane, token, carl)
        answers = [
            call(
                k8s_plane,
                token,
                "POST",
                f"/api/v1/namespaces/{carl}/secrets",
                {"metadata": {"name": f"s{i}", "ownerReferences": [owner]}, "stringData": {"k": "v"}},
            )
            for i in range(2)
        ]
        assert answers[0][0] == 201, answers[0]
        refused(answers[1], "exceeded quota")
        # NetworkPolicies too (each may carry a megabyte of ipBlock peers, and the network plugin programs
        # every one on every node): room for one of a job's beside the hub's own
        netpols = f"/apis/networking.k8s.io/v1/namespaces/{carl}/networkpolicies"
        hubs = len(k8s_plane.get(netpols)["items"])
        assert hubs <= tenancy.HUB_POLICIES
        answers = [
            call(
                k8s_plane,
                token,
                "POST",
                netpols,
                {
                    "metadata": {"name": f"p{i}", "ownerReferences": [owner]},
                    "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": []},
                },
            )
            for i in range(tenancy.HUB_POLICIES - hubs + 2)
        ]
        assert all(a[0] == 201 for a in answers[:-1]), answers
        refused(answers[-1], "exceeded quota")
    finally:
        k8s_plane.request("DELETE", f"/api/v1/namespaces/{carl}")


# ------------------------------------------------------------------ MEDIUM: the hub's own reach
async def test_the_hub_takes_over_no_namespace_it_did_not_make_for_that_user(k8s_plane, users):
    """A user whose namespace name is another team's (or kube-system): the spawn is refused, the namespace
    keeps its labels, and no Role of ours is bound there."""
    from tests.test_k8s_tenancy import _api_for_token, gpu_policy

    hub_ns = users["hub"]
    team = f"{hub_ns}-team-{uuid.uuid4().hex[:4]}"
    k8s_plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": team, "labels": {"team": "x"}}})
    try:
        async with _api_for_token(k8s_plane, _token(k8s_plane, hub_ns, "hub")) as api:
            with pytest.raises(tenancy.NamespaceTaken, match="will not take it over"):
                await prepare_user_namespace(api, gpu_policy("mallory", team))
            # nor a namespace made for another user
            with pytest.raises(tenancy.NamespaceTaken):
                await prepare_user_namespace(api, gpu_policy("mallory", users["ann"]))
        labels = k8s_plane.get(f"/api/v1/namespaces/{team}")["metadata"]["labels"]
        assert tenancy.L_TENANT not in labels and labels["team"] == "x"
        rb = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{team}/rolebindings/{tenancy.NOTEBOOK_SA}"
        assert k8s_plane.get(rb) is None
    finally:
        k8s_plane.request("DELETE", f"/api/v1/namespaces/{team}")


def test_the_hubs_token_writes_only_in_tenant_namespaces(k8s_plane, users):
    hub_ns = users["hub"]
    token = _token(k8s_plane, hub_ns, "hub")
    binding = {
        "metadata": {"name": f"x-{uuid.uuid4().hex[:6]}"},
        # a ClusterRole the hub holds everywhere, so RBAC's own escalation check lets it bind it anywhere
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "tfdist-hub-tenancy",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": "kube-system"}],
    }
    path = "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/rolebindings"
    refused(call(k8s_plane, token, "POST", path, binding), "only in its own namespace and in user namespaces")
    pod = {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": IMAGE}]}}
    refused(call(k8s_plane, token, "POST", "/api/v1/namespaces/kube-system/pods", pod))
    live = call(k8s_plane, token, "GET", "/api/v1/namespaces/kube-system")[1]
    live["metadata"].setdefault("labels", {})[tenancy.L_TENANT] = "true"
    refused(call(k8s_plane, token, "PUT", "/api/v1/namespaces/kube-system", live), "only user namespaces")
    assert tenancy.L_TENANT not in k8s_plane.get("/api/v1/namespaces/kube-system")["metadata"]["labels"]
    # a leaked hub token reads no Secret: not kube-system's, not a user's (job tokens), not the cluster's
    # (admission sees no reads: RBAC alone keeps them). The hub reads none; it read all of them before
    for path in (
        "/api/v1/secrets",
        "/api/v1/namespaces/kube-system/secrets",
        f"/api/v1/namespaces/{users['ann']}/secrets",
    ):
        assert call(k8s_plane, token, "GET", path)[0] == 403, path
    # its own work still goes through: a pod in a user namespace
    ann = users["ann"]
    nb = {
        "metadata": {"name": f"jupyter-{uuid.uuid4().hex[:4]}"},
        "spec": {"containers": [{"name": "c", "image": IMAGE, "securityContext": RESTRICTED}]},
    }
    code, body = call(k8s_plane, token, "POST", f"/api/v1/namespaces/{ann}/pods", nb)
    assert code == 201, body


# ----------------------------------------- review of 2026-12-05: tokens, pod-level resources, sizes
@pytest.mark.parametrize(
    "token_source",
    [
        {"audience": "vault", "path": "t"},  # for another system, which verifies it offline
        {"expirationSeconds": 4294967296, "path": "t"},  # 136 years
    ],
    ids=["audience", "lifetime"],
)
def test_no_service_account_token_that_outlives_the_pod(k8s_plane, ann, token_source):
    """A projected token for another audience (or of a lifetime of years) is verified by other systems with
    the cluster's public keys long after the pod, the server and the user are gone. The API server's own
    token (no audience, an hour) is the control."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"tok-{uuid.uuid4().hex[:6]}")
    pod = job["spec"]["template"]["spec"]
    pod["serviceAccountName"] = tenancy.NOTEBOOK_SA
    own = [  # Kubernetes' own kube-api-access volume, as its service-account admission writes it
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]
    pod["volumes"] = [{"name": "sa", "projected": {"sources": own}}]
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    pod["volumes"][0]["projected"]["sources"] = [{"serviceAccountToken": token_source}]
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "projected volume sa is not allowed")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        # hugepages (and CPU/memory Kueue does not read) at the pod's level, beside its containers'
        (
            {
                "resources": {
                    "requests": {"cpu": "1", "hugepages-2Mi": "1Gi"},
                    "limits": {"hugepages-2Mi": "1Gi"},
                }
            },
            "pod-level resources (spec.resources) are not allowed",
        ),
        ({"schedulerName": "my-scheduler"}, "schedulerName my-scheduler is not allowed"),
    ],
    ids=["pod-level-resources", "scheduler"],
)
def test_no_pod_level_resources_and_no_other_scheduler(k8s_plane, bob, pod, says):
    ns, token = bob
    job = cpu_job(k8s_plane, ns, f"pl-{uuid.uuid4().hex[:6]}")
    job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"] = {}, {}
    job["spec"]["template"]["spec"] |= {"schedulerName": "default-scheduler"}
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    job["spec"]["template"]["spec"] |= pod
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), says)
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


MIB = "x" * (1 << 20)


def test_a_user_cannot_write_megabytes_at_a_time(k8s_plane, ann):
    """Every write of an object is a new revision of all of it in etcd, and a full etcd refuses the
    whole cluster's writes: a loop creating and deleting a 1 MiB Secret (or updating a Job that big) would
    fill it in minutes. Each object a user may write is bounded; %%tfdist's own pass (the controls)."""
    ns, token = ann
    owner = _owned_by_job(k8s_plane, token, ns)
    secrets = f"/api/v1/namespaces/{ns}/secrets"

    def secret(**body: Any) -> dict[str, Any]:
        return {"metadata": {"name": f"big-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]}, **body}

    code, body = call(
        k8s_plane, token, "POST", secrets + "?dryRun=All", secret(stringData={"token": "t" * 64})
    )
    assert code == 201, body
    # (stringData reaches admission as data)
    refused(
        call(k8s_plane, token, "POST", secrets, secret(stringData={"k": MIB})), "too big", "data: at most"
    )
    many = {f"k{i}": "v" for i in range(5)}
    refused(call(k8s_plane, token, "POST", secrets, secret(stringData=many)), "too big")
    noted = secret(stringData={"token": "t"})
    noted["metadata"]["annotations"] = {"tfdist.io/x": MIB[:100_000]}
    refused(call(k8s_plane, token, "POST", secrets, noted), "too big", "annotations: at most")
    # a Job: its environment, its command, its annotations (a user may update them at will)
    for change, says in (
        (
            lambda c, m: c.setdefault("env", []).append({"name": "BIG", "value": MIB[:200_000]}),
            "environment: at most 64 KiB",
        ),
        (lambda c, m: c.__setitem__("args", [MIB[:20_000]]), "command and arguments: at most 16 KiB"),
        (
            lambda c, m: m.__setitem__("annotations", {"tfdist.io/spec": MIB[:20_000]}),
            "annotations: at most 16 KiB",
        ),
    ):
        job = gpu_job(k8s_plane, ns, f"big-{uuid.uuid4().hex[:6]}")
        change(job["spec"]["template"]["spec"]["containers"][0], job["metadata"])
        refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "is too big", says)
    # counts: containers, volumes, probes (free text outside the bounds), owner references

    def five_containers(pod: dict) -> None:
        first = pod["containers"][0]
        small = {"limits": {"cpu": "100m", "memory": "64Mi"}}
        pod["containers"] = [first] + [dict(first, name=f"c{i}", resources=small) for i in range(1, 5)]

    for change, says in (
        (five_containers, "containers: at most 4"),
        (
            lambda p: p.__setitem__("volumes", [{"name": f"v{i}", "emptyDir": {}} for i in range(17)]),
            "volumes",
        ),
        (
            lambda p: p["containers"][0].__setitem__(
                "readinessProbe", {"exec": {"command": ["x" * 100_000]}}
            ),
            "probes and lifecycle hooks are not allowed",
        ),
    ):
        job = gpu_job(k8s_plane, ns, f"big-{uuid.uuid4().hex[:6]}")
        change(job["spec"]["template"]["spec"])
        refused(call(k8s_plane, token, "POST", jobs_path(ns), job), says)
    job = gpu_job(k8s_plane, ns, f"own-{uuid.uuid4().hex[:6]}")
    job["metadata"]["ownerReferences"] += [  # the API server merges duplicates: other owners
        {"apiVersion": "batch/v1", "kind": "Job", "name": f"j{i}", "uid": str(uuid.uuid4())} for i in range(2)
    ]
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "owner references: at most 2")
    services = f"/api/v1/namespaces/{ns}/services"
    svc = {
        "metadata": {"name": f"s-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]},
        "spec": {"clusterIP": "None", "ports": [{"name": f"p{i}", "port": 2000 + i} for i in range(9)]},
    }
    refused(call(k8s_plane, token, "POST", services, svc), "ports: at most 8")
    netpol = {
        "metadata": {"name": f"n-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {}}]}] * 5,
        },
    }
    netpols = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
    refused(call(k8s_plane, token, "POST", netpols, netpol), "ingress: at most 4 rules")
    # and on UPDATE: a Job created small does not grow
    name = f"grow-{uuid.uuid4().hex[:6]}"
    code, made = call(k8s_plane, token, "POST", jobs_path(ns), gpu_job(k8s_plane, ns, name))
    assert code == 201, made
    big = {"tfdist.io/spec": MIB[:20_000]}
    item = f"{jobs_path(ns)}/{name}"
    answer = updated(k8s_plane, token, item, lambda j: j["metadata"].update(annotations=big))
    refused(answer, "is too big", "annotations: at most 16 KiB")


FIND_OWNER = "owner references must name their owner as Kubernetes names objects"


@pytest.mark.parametrize(
    ("name", "uid"),
    [(".", None), ("./.", None), ("./././.", None), ("a" * 300, None), ("ok", "not-a-uid")],
    ids=["dot", "dot-slash-dot", "dots", "too-long", "bad-uid"],
)
def test_an_owner_the_garbage_collector_cannot_look_up_is_refused(k8s_plane, ann, name, uid):
    """An owner named "." (or "./.") is joined into the collector's GET path and cleaned into the LIST of
    every Job, which never answers "not found": the collector retries for ever, and the Job (its pods,
    GPUs and queue admission) or the Secret, Service or policy outlives the server, the lifeline and
    culling (review of stop 44, seen on the real node: a Job owned by "." still there after 3 minutes, one
    owned by a missing name collected in 20 s). Refused on Jobs and on the objects a job owns."""
    ns, token = ann
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid or str(uuid.uuid4())}
    job = gpu_job(k8s_plane, ns, f"gc-{uuid.uuid4().hex[:6]}")
    job["metadata"]["ownerReferences"].append(owner)
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), FIND_OWNER)
    secret = {"metadata": {"name": f"gc-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]}}
    refused(call(k8s_plane, token, "POST", f"/api/v1/namespaces/{ns}/secrets", secret), FIND_OWNER)
    # the control: a real owner's name and UID
    good = _owned_by_job(k8s_plane, token, ns)
    secret["metadata"]["ownerReferences"] = [good]
    code, body = call(k8s_plane, token, "POST", f"/api/v1/namespaces/{ns}/secrets?dryRun=All", secret)
    assert code == 201, body.get("message", body)


def test_a_jobs_template_metadata_node_selector_and_paths_are_bounded(k8s_plane, ann):
    """What no bound counted (review of stop 44): a pod template's own name, generateName, UID, owners
    and managedFields (stored with the Job, never given to its pods), a node selector of thousands of
    labels, mount paths by `subPathExpr`, `terminationMessagePath`, a volume's items' paths: each 20 KB
    here, each admitted before, each growing a Job to etcd's limit. %%tfdist's own Job is the control."""
    ns, token = ann
    big = "x" * 20_000
    one_label = "a" * 63

    def template_meta(t: dict) -> None:
        t["metadata"]["generateName"] = big

    def template_self_link(t: dict) -> None:
        t["metadata"]["selfLink"] = "/" + big

    def token_path(t: dict) -> None:
        token = {"serviceAccountToken": {"path": "t" + big, "expirationSeconds": 3600}}
        t["spec"]["volumes"] = [{"name": "p", "projected": {"sources": [token]}}]

    def template_owner(t: dict) -> None:
        t["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": str(uuid.uuid4())}
        ]

    def node_selector(t: dict) -> None:
        t["spec"]["nodeSelector"] |= {f"x{i}.example/{one_label[:40]}": one_label for i in range(3000)}

    def sub_path_expr(t: dict) -> None:
        t["spec"]["volumes"] = [{"name": "v", "emptyDir": {}}]
        t["spec"]["containers"][0]["volumeMounts"] = [
            {"name": "v", "mountPath": f"/m{i}", "subPathExpr": "y" * 8000} for i in range(4)
        ]

    def termination_path(t: dict) -> None:
        t["spec"]["containers"][0]["terminationMessagePath"] = "/" + big

    def item_paths(t: dict) -> None:
        ref = {"fieldPath": "metadata.name"}
        items = [{"path": f"p{i}-" + "z" * 4000, "fieldRef": ref} for i in range(8)]
        t["spec"]["volumes"] = [{"name": "d", "downwardAPI": {"items": items}}]

    for change, says in (
        (template_meta, "may set only labels and annotations"),
        (template_owner, "may set only labels and annotations"),
        (template_self_link, "may set only labels and annotations"),
        (token_path, "command and arguments: at most 16 KiB"),
        (node_selector, "node selector: at most 8 labels"),
        (sub_path_expr, "command and arguments: at most 16 KiB"),
        (termination_path, "command and arguments: at most 16 KiB"),
        (item_paths, "command and arguments: at most 16 KiB"),
    ):
        job = gpu_job(k8s_plane, ns, f"tm-{uuid.uuid4().hex[:6]}")
        change(job["spec"]["template"])
        refused(call(k8s_plane, token, "POST", jobs_path(ns), job), says)
    code, body = call(
        k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", gpu_job(k8s_plane, ns, "tm-control")
    )
    assert code == 201, body.get("message", body)


def _filler(api_version: str, fields: dict[str, Any], manager: str = "filler") -> dict[str, Any]:
    """A managedFields entry as a client may send it: any manager, paths the object does not have."""
    return {
        "manager": manager,
        "operation": "Apply",
        "apiVersion": api_version,
        "fieldsType": "FieldsV1",
        "time": "2026-12-05T00:00:00Z",
        "fieldsV1": fields,
    }


def _deep(levels: int) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for i in range(levels):
        tree = {f"f:d{i}": tree}
    return tree


def test_managed_fields_a_user_sends_are_bounded(k8s_plane, ann):
    """The API server stores the managedFields entries a client sends with a write (any manager name, paths
    the object lacks) up to etcd's ~1.5 MiB an object: past every bound on the object's own fields, a loop
    of such writes would fill the store the whole cluster writes to. Measured on this API server before
    the policy: a Secret with 4 bytes of data and 20 000 made-up label paths was stored at 840 KB. Refused
    on CREATE and UPDATE, wide or deep; entries a client sends of its own size, and %%tfdist's objects
    (read back and written again as they are), pass."""
    ns, token = ann
    owner = _owned_by_job(k8s_plane, token, ns)
    secrets = f"/api/v1/namespaces/{ns}/secrets"
    wide = {"f:metadata": {"f:labels": {f"f:x-{i:05d}-{'y' * 16}": {} for i in range(4000)}}}

    def secret(*entries: dict[str, Any]) -> dict[str, Any]:
        meta = {"name": f"mf-{uuid.uuid4().hex[:6]}", "ownerReferences": [owner]}
        return {"metadata": meta | {"managedFields": list(entries)}, "stringData": {"token": "t"}}

    says = "metadata.managedFields: at most 16 entries with 32768 characters of field paths"
    refused(call(k8s_plane, token, "POST", secrets, secret(_filler("v1", wide))), says, "characters)")
    too_deep = secret(_filler("v1", _deep(13)))
    refused(call(k8s_plane, token, "POST", secrets, too_deep), "nested deeper than 12")
    code, body = call(k8s_plane, token, "POST", secrets + "?dryRun=All", secret(_filler("v1", _deep(12))))
    assert code == 201, body.get("message", body)  # the edge: 12 keys deep is what the walk reaches
    many = [_filler("v1", {"f:metadata": {}}, manager=f"m{i}") for i in range(17)]
    refused(call(k8s_plane, token, "POST", secrets, secret(*many)), says, "18 entries")  # + its own
    job = gpu_job(k8s_plane, ns, f"mf-{uuid.uuid4().hex[:6]}")
    job["metadata"]["managedFields"] = [_filler("batch/v1", wide)]
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), says)
    # the controls: a client's own entry of an ordinary size; a job written again as it was read
    small = _filler("v1", {"f:metadata": {"f:labels": {"f:team": {}}}}, manager="mine")
    code, made = call(k8s_plane, token, "POST", secrets, secret(small))
    assert code == 201, made.get("message", made)
    name = f"mf-{uuid.uuid4().hex[:6]}"
    code, made = call(k8s_plane, token, "POST", jobs_path(ns), gpu_job(k8s_plane, ns, name))
    assert code == 201, made.get("message", made)
    item = f"{jobs_path(ns)}/{name}"

    def update(change) -> tuple[int, dict]:
        return updated(k8s_plane, token, item, change)

    def deadline(j: dict) -> None:  # what the lifeline writes
        j["spec"]["activeDeadlineSeconds"] = 600

    code, body = update(deadline)
    assert code == 200, body.get("message", body)
    refused(update(lambda j: j["metadata"]["managedFields"].append(_filler("batch/v1", wide))), says)


@pytest.mark.parametrize(
    "peer",
    [{"namespaceSelector": {}}, {"ipBlock": {"cidr": "0.0.0.0/0"}}, None],
    ids=["other-namespaces", "address-block", "no-from"],
)
def test_a_jobs_network_policy_admits_only_its_namespaces_pods(k8s_plane, ann, peer):
    """A TF server runs any graph sent to it: a user's own policy could open their job's servers to every
    namespace (or address) of the cluster. %%tfdist's own policy is the control."""
    ns, token = ann
    netpols, ours = _our_network_policy(k8s_plane, ns, token)
    rule = {"ports": [{"protocol": "TCP", "port": 2222}]} | ({"from": [peer]} if peer else {})
    ours["spec"]["ingress"].append(rule)
    refused(call(k8s_plane, token, "POST", netpols, ours), "may admit only pods of your namespace")


TOLERATE_NOT_READY = {
    "key": "node.kubernetes.io/not-ready",
    "operator": "Exists",
    "effect": "NoExecute",
    "tolerationSeconds": 300,
}


@pytest.mark.parametrize(
    "change, says",
    [
        # a list the allowlist drops (the API server's own default tolerations) copied 20 000 times
        (
            lambda p: p.__setitem__("tolerations", p["tolerations"] + [TOLERATE_NOT_READY] * 20_000),
            "tolerations",
        ),
        (
            lambda p: p.__setitem__("securityContext", {"supplementalGroups": list(range(1000, 21000))}),
            "supplementalGroups",
        ),
        (
            lambda p: p.__setitem__(
                "topologySpreadConstraints",
                [
                    {
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {
                            "matchExpressions": [
                                {"key": "app", "operator": "In", "values": [f"v{i}" for i in range(20_000)]}
                            ]
                        },
                    }
                ],
            ),
            "topologySpreadConstraints",
        ),
        (
            lambda p: p.__setitem__(
                "readinessGates", [{"conditionType": f"x.io/c{i}"} for i in range(20_000)]
            ),
            "readinessGates",
        ),
        (
            lambda p: p.__setitem__(
                "dnsConfig", {"searches": ["a.b"], "options": [{"name": f"o{i}"} for i in range(20_000)]}
            ),
            "dnsConfig",
        ),
        (
            lambda p: p.__setitem__(
                "hostAliases", [{"ip": "10.0.0.1", "hostnames": [f"h{i}" for i in range(20_000)]}]
            ),
            "hostAliases",
        ),
        (
            lambda p: p.__setitem__(
                "volumes",
                [
                    {
                        "name": "cm",
                        "configMap": {
                            "name": "x",
                            "items": [{"key": f"k{i}", "path": f"p{i}"} for i in range(1_000)],
                        },
                    }
                ],
            ),
            "volumes: at most 16 items",
        ),
        (
            lambda p: p.__setitem__(
                "volumes",
                [
                    {
                        "name": "pr",
                        "projected": {"sources": [{"configMap": {"name": f"c{i}"}} for i in range(5_000)]},
                    }
                ],
            ),
            "4 projected sources",
        ),
        (
            lambda p: p["containers"][0].__setitem__(  # a copy: RESTRICTED is shared
                "securityContext",
                {**RESTRICTED, "capabilities": {"drop": ["ALL"] + [f"X{i}" for i in range(20_000)]}},
            ),
            "capabilities",
        ),
    ],
    ids=[
        "tolerations",
        "supplemental-groups",
        "spread",
        "readiness-gates",
        "dns-options",
        "host-aliases",
        "volume-items",
        "projected-sources",
        "capabilities",
    ],
)
def test_a_jobs_lists_no_bound_counted_are_refused(k8s_plane, ann, change, says):
    """Every write of a Job is a new revision of all of it in etcd, copied into each pod and Kueue Workload:
    a list outside the size bounds, filled to a megabyte and rewritten in a loop (activeDeadlineSeconds may
    change), fills the cluster's store. %%tfdist sets none of these (or a few entries): refused whole or
    bounded; the Job without them is the control."""
    ns, token = ann
    job = gpu_job(k8s_plane, ns, f"list-{uuid.uuid4().hex[:6]}")
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    change(job["spec"]["template"]["spec"])
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), says)
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


def test_a_job_cannot_adopt_pods_or_leave_for_another_controller(k8s_plane, ann):
    """manualSelector with the notebook's labels would have the Job controller adopt the user's own server
    pod (and delete it on suspend); managedBy hands the Job to another controller (MultiKueue's worker
    clusters, where these policies do not run)."""
    ns, token = ann
    nb = k8s_plane.get(f"/api/v1/namespaces/{ns}/pods/{NOTEBOOK}")["metadata"]["labels"]
    job = cpu_job(k8s_plane, ns, f"adopt-{uuid.uuid4().hex[:6]}")
    job["spec"]["manualSelector"] = True
    job["spec"]["selector"] = {"matchLabels": dict(nb)}
    job["spec"]["template"]["metadata"]["labels"].update(nb)
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "spec.manualSelector")
    job = cpu_job(k8s_plane, ns, f"mgd-{uuid.uuid4().hex[:6]}")
    job["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "spec.managedBy")
    assert k8s_plane.get(f"/api/v1/namespaces/{ns}/pods/{NOTEBOOK}") is not None


@pytest.mark.parametrize("where", ["policy", "peer"])
def test_a_network_policys_selectors_are_bounded(k8s_plane, ann, where):
    """Every node's network agent holds every NetworkPolicy and evaluates it: a selector with 20 000 values
    in a matchExpressions, rewritten in a loop, costs every node (a crashed agent enforces nothing, and
    enforcement is all that guards everyone's TensorFlow servers). %%tfdist's policy selects by matchLabels
    only (the control)."""
    ns, token = ann
    netpols, ours = _our_network_policy(k8s_plane, ns, token)
    huge = {
        "matchExpressions": [{"key": "app", "operator": "NotIn", "values": [f"v{i}" for i in range(20_000)]}]
    }
    if where == "policy":
        ours["spec"]["podSelector"] = {**ours["spec"]["podSelector"], **huge}
    else:
        ours["spec"]["ingress"][0]["from"][0]["podSelector"] = huge
    refused(call(k8s_plane, token, "POST", netpols, ours), "selectors: matchLabels only")


@pytest.mark.parametrize(
    "key, value",
    [
        ("component", "singleuser-server"),
        ("hub.jupyter.org/network-access-hub", "true"),
        ("app.kubernetes.io/component", "singleuser-server"),
    ],
)
def test_a_jobs_pods_cannot_pass_for_the_hubs_own(k8s_plane, ann, key, value):
    """KubeSpawner's reflector keeps every pod labelled component=singleuser-server of every user namespace
    in the hub's memory (finished ones too: 6 000 of them would be one user's doing), and z2jh's policies
    admit pods by hub.jupyter.org/network-access-* labels. The Job without them is the control."""
    ns, token = ann
    job = cpu_job(k8s_plane, ns, f"lbl-{uuid.uuid4().hex[:6]}")
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", job)
    assert code == 201, body
    job["spec"]["template"]["metadata"]["labels"][key] = value
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), f"label {key} is not allowed")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None


# ------------------------------------------- review of stop 42, finding 3: one GPU and a whole node's CPUs
SHARE_CPU, SHARE_MEMORY = 4, 16 * 2**30  # the model's cpu_per_gpu, memory_gib_per_gpu (as if 32 CPUs, 8 GPUs)


@pytest.fixture
async def ann_shared(k8s_plane, users, ann):
    """ann's namespace converged by the hub for a model with a node's share per GPU (GpuModel.cpu_per_gpu);
    returned once the admission policy reads the new parameters (a dry run of the share's overrun refused)."""
    ns, token = ann
    policy = tenancy_tests.gpu_policy(
        "ann", ns, hub_namespace=users["hub"], cpu_per_gpu=SHARE_CPU, memory_per_gpu_bytes=SHARE_MEMORY
    )
    async with tenancy_tests._api_for_token(k8s_plane, _token(k8s_plane, users["hub"], "hub")) as api:
        await prepare_user_namespace(api, policy)
    probe = gpu_job(k8s_plane, ns, "share-probe")
    probe["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "64"
    deadline = time.monotonic() + 30
    while call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", probe)[0] == 201:
        assert time.monotonic() < deadline, "the policy never read the share per GPU"
        time.sleep(0.2)
    return ns, token


def _resources(job: dict[str, Any], *containers: dict[str, Any]) -> dict[str, Any]:
    pod = job["spec"]["template"]["spec"]
    pod["containers"] = [
        {**pod["containers"][0], "name": f"c{i}", "resources": r} for i, r in enumerate(containers)
    ]
    return job


@pytest.mark.parametrize(
    ("containers", "says"),
    [
        ([{"limits": {"nvidia.com/gpu": "1", "cpu": "94", "memory": "1Gi"}}], "asks for 94 CPUs with 1"),
        # a request above the LimitRange's default limit counts as the request
        ([{"limits": {"nvidia.com/gpu": "1", "memory": "1Gi"}, "requests": {"cpu": "94000m"}}], "94 CPUs"),
        # the whole pod: two containers of 3 CPUs each with one GPU
        (
            [
                {"limits": {"nvidia.com/gpu": "1", "cpu": "3", "memory": "1Gi"}},
                {"limits": {"cpu": "3", "memory": "1Gi"}},
            ],
            "asks for 6 CPUs with 1",
        ),
        ([{"limits": {"nvidia.com/gpu": "1", "cpu": "1", "memory": "700Gi"}}], "GiB of memory per GPU"),
        ([{"limits": {"nvidia.com/gpu": "2", "cpu": "9", "memory": "1Gi"}}], "asks for 9 CPUs with 2"),
    ],
    ids=["cpu-limit", "cpu-request", "two-containers", "memory", "two-gpus"],
)
def test_a_gpu_pod_holds_at_most_its_gpus_share_of_a_node(k8s_plane, ann_shared, containers, says):
    """One GPU with 94 CPUs (or 700 GiB) of a 96-CPU, 8-GPU node keeps its 7 other GPUs from everyone and
    takes the team queue's CPUs. Admitted before (no CPU or memory rule, no LimitRange max)."""
    ns, token = ann_shared
    job = _resources(gpu_job(k8s_plane, ns, f"sh-{uuid.uuid4().hex[:6]}"), *containers)
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "per GPU", says)
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None
    # the controls: the shares exactly (a container without a limit counts the LimitRange's default, 1 CPU
    # and 2 GiB); a pod without GPUs is bounded by the quota only
    for fits in (
        [{"limits": {"nvidia.com/gpu": "1", "cpu": "4", "memory": "16Gi"}}],
        [{"limits": {"nvidia.com/gpu": "2", "cpu": "7", "memory": "1Gi"}}, {}],
    ):
        ok = _resources(gpu_job(k8s_plane, ns, f"ok-{uuid.uuid4().hex[:6]}"), *fits)
        code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", ok)
        assert code == 201, body
    code, body = call(k8s_plane, token, "POST", jobs_path(ns) + "?dryRun=All", cpu_job(k8s_plane, ns, "cpu"))
    assert code == 201, body


def test_an_init_containers_gpus_buy_no_share(k8s_plane, ann_shared):
    """A pod holds the larger of its init containers' and its containers' sum: an init container with 2 GPUs
    beside a container with 2 GPUs and 15 CPUs counts 4 GPUs (16 CPUs, within 4 shares) but holds 2 (found
    by the review of this stop's policy; admitted by it). The same pod without the init container's GPUs is
    refused by the share itself."""
    ns, token = ann_shared
    job = gpu_job(k8s_plane, ns, f"in-{uuid.uuid4().hex[:6]}")
    pod = job["spec"]["template"]["spec"]
    main = pod["containers"][0]
    main["resources"] = {"limits": {"nvidia.com/gpu": "2", "cpu": "15", "memory": "1Gi"}}
    pod["initContainers"] = [
        {
            **main,
            "name": "init",
            "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "1", "memory": "1Gi"}},
        }
    ]
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "in an init container")
    pod["initContainers"][0]["resources"]["limits"].pop("nvidia.com/gpu")
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "asks for 16 CPUs with 2")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None
