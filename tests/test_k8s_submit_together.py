"""Submitting creates a job's objects together and resumes its Jobs together (issue 26: no serial waits
before the pods), and a refusal at any step still takes back everything created (a real API server, Job
controller and garbage collector: the kwok plane of tests/kube_plane.py)."""

from __future__ import annotations

import pytest

from tests.test_k8s_backend import backend, get, left, spec, wait_gone
from tfdist.backends.base import Launch
from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.errors import BackendUnavailable, JobSpecError
from tfdist.kube import names as kn
from tfdist.settings import from_environ

pytestmark = [pytest.mark.k8s, pytest.mark.usefixtures("private_agent_port")]


@pytest.fixture
def private_agent_port(monkeypatch):
    """As in test_k8s_backend: kwok's pod IPs may be a real pod's on this machine."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setattr(kn, "AGENT_PORT", s.getsockname()[1])


def jobs_of(plane, ns: str, job: str) -> dict[str, dict]:
    body = get(plane, f"/apis/batch/v1/namespaces/{ns}/jobs?labelSelector={kn.L_JOB}%3D{job}")
    return {j["metadata"]["name"]: j for j in body["items"]}


async def test_every_job_is_created_suspended_and_resumed_together(k8s_plane, k8s_namespace):
    """No task Job runs pods before the job's other objects (its token Secret above all) exist: each one
    was created suspended and resumed only once everything was in.

    The API server's watch is the record: the Job controller's JobResumed condition is not, since a
    controller that first syncs a Job after its resume never writes one (CI on e3612d4)."""
    from tests.test_k8s_backend import collect

    ns = k8s_namespace
    b = backend(k8s_plane, ns)
    selector = f"labelSelector={kn.L_JOB}%3Dtogether"
    try:
        with (
            k8s_plane.watching(f"/apis/batch/v1/namespaces/{ns}/jobs?{selector}") as job_events,
            k8s_plane.watching(f"/api/v1/namespaces/{ns}/secrets") as secret_events,
        ):
            await b.submit(spec("together", ns, workers=2, ps=1), b"p", Launch())
            await collect(b, "together", lambda ev, _: ev.type == "state" and ev.state == "running")
        assert sorted(jobs_of(k8s_plane, ns, "together")) == ["together", "together-ps", "together-worker"]

        def suspend(ev: dict) -> bool:
            return ev["object"]["spec"].get("suspend") is True

        added = {ev["object"]["metadata"]["name"]: ev for ev in job_events if ev["type"] == "ADDED"}
        assert sorted(added) == ["together", "together-ps", "together-worker"]
        assert all(map(suspend, added.values())), "a Job was created running"
        first_resume: dict[str, int] = {}  # each Job's first event with suspend false: its resume
        for i, ev in enumerate(job_events):
            if ev["type"] == "MODIFIED" and not suspend(ev):
                first_resume.setdefault(ev["object"]["metadata"]["name"], i)
        assert sorted(first_resume) == sorted(added), "a Job was never resumed"
        # Every Job was created before any was resumed: all of the job's objects were in by then.
        assert max(job_events.index(ev) for ev in added.values()) < min(first_resume.values())
        # And the token Secret before them (one etcd: resourceVersions of one store are ordered).
        tokens = [
            ev
            for ev in secret_events
            if ev["type"] == "ADDED" and ev["object"]["metadata"]["name"] == "together-token"
        ]
        assert tokens, "no token Secret was created"
        token_rv = int(tokens[0]["object"]["metadata"]["resourceVersion"])
        resume_rvs = [
            int(job_events[i]["object"]["metadata"]["resourceVersion"]) for i in first_resume.values()
        ]
        assert token_rv < min(resume_rvs)
    finally:
        await b.close()


async def test_a_refusal_among_objects_created_together_takes_back_the_others(k8s_plane, k8s_namespace):
    """The token Secret's name is taken: the Jobs, Service and policy created in the same step are deleted,
    no pod ever ran, and the Secret that was there before is left alone."""
    path = f"/api/v1/namespaces/{k8s_namespace}/secrets"
    k8s_plane.request("POST", path, {"metadata": {"name": "taken-token"}, "stringData": {"token": "x"}})
    b = backend(k8s_plane, k8s_namespace)
    try:
        with pytest.raises(JobSpecError, match="already exists"):
            await b.submit(spec("taken", k8s_namespace, workers=2, ps=1), b"p", Launch())
        assert left(k8s_plane, k8s_namespace, "taken") == []
        assert get(k8s_plane, f"{path}/taken-token")["data"] == {"token": "eA=="}  # base64 of "x"
    finally:
        await b.close()


def limited_kubeconfig(plane, ns: str, tmp_path, update_only: str) -> str:
    """A service account with the backend's verbs, except that it may update (resume) only the Job named
    `update_only`: the other Jobs' resume is refused after everything was created."""
    plane.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "partial"}})
    rules = [
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "create", "delete"]},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["update"], "resourceNames": [update_only]},
        {"apiGroups": [""], "resources": ["services", "secrets"], "verbs": ["create", "delete"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create", "delete"]},
        {"apiGroups": [""], "resources": ["resourcequotas", "pods"], "verbs": ["list"]},
    ]
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}"
    plane.request("POST", f"{rbac}/roles", {"metadata": {"name": "partial"}, "rules": rules})
    plane.request(
        "POST",
        f"{rbac}/rolebindings",
        {
            "metadata": {"name": "partial"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "partial"},
            "subjects": [{"kind": "ServiceAccount", "name": "partial", "namespace": ns}],
        },
    )
    return plane.service_account_kubeconfig(ns, "partial", tmp_path / "partial.kubeconfig")


async def test_a_refused_resume_deletes_everything_even_what_already_runs(k8s_plane, k8s_namespace, tmp_path):
    """The last step half done: the root is resumed (its pod is created), the task Jobs' resume is refused.
    Everything created goes, the root's pod with it."""
    kc = limited_kubeconfig(k8s_plane, k8s_namespace, tmp_path, update_only="half")
    b = KubernetesBackend(
        from_environ({"TFDIST_NAMESPACE": k8s_namespace, "TFDIST_WORKER_IMAGE": "img:1", "USER": "ann"}),
        kubeconfig=kc,
    )
    try:
        with pytest.raises(BackendUnavailable, match="Job 'half-"):
            await b.submit(spec("half", k8s_namespace, workers=2, ps=1), b"p", Launch())
        assert jobs_of(k8s_plane, k8s_namespace, "half") == {}  # deleted at once; pods by the collector
        await wait_gone(k8s_plane, k8s_namespace, "half", 60)
    finally:
        await b.close()


async def test_a_root_a_dead_submit_never_resumed_is_swept_by_the_next_submit(
    k8s_plane, k8s_namespace, monkeypatch
):
    """The kernel SIGKILLed between the root's creation and its resume: the suspended root never starts,
    so its deadline (the lifeline) never fires, and it held its name and the quota's counts until the
    notebook's pod went. The next submit of the user deletes it (here: any age; 120 s in the product);
    a root that was resumed, and another user's, are left alone."""
    from tfdist.backends import kubesubmit
    from tfdist.kube import manifests as mf

    ns = k8s_namespace
    b = backend(k8s_plane, ns)
    other = backend(k8s_plane, ns, USER="bob")
    try:
        dead = mf.root_job(spec("dead", ns, image="img:1"), None, suspend=True)
        k8s_plane.request("POST", f"/apis/batch/v1/namespaces/{ns}/jobs", dead)
        bobs = mf.root_job(spec("bobs", ns, user="bob", image="img:1"), None, suspend=True)
        k8s_plane.request("POST", f"/apis/batch/v1/namespaces/{ns}/jobs", bobs)
        # resumed, then suspended again (the user's own update, or Kueue's): suspended, no start time, but
        # written since its creation: not a dead submit's
        paused = mf.root_job(spec("paused", ns, image="img:1"), None, suspend=True)
        item = f"/apis/batch/v1/namespaces/{ns}/jobs/paused"
        k8s_plane.request("POST", f"/apis/batch/v1/namespaces/{ns}/jobs", paused)
        for suspend in (False, True):
            for _ in range(10):  # the Job controller writes its status in between: read again on a conflict
                live = get(k8s_plane, item)
                live["spec"]["suspend"] = suspend
                try:
                    k8s_plane.request("PUT", item, live)
                    break
                except Exception:
                    continue
        await b.submit(spec("alive", ns, workers=1, ps=1), b"p", Launch())  # resumed: not a leftover
        monkeypatch.setattr(kubesubmit, "UNRESUMED_AFTER_S", 0.0)
        await b.submit(spec("next", ns, workers=1, ps=1), b"p", Launch())
        assert get(k8s_plane, f"/apis/batch/v1/namespaces/{ns}/jobs/dead") is None
        assert get(k8s_plane, f"/apis/batch/v1/namespaces/{ns}/jobs/bobs") is not None
        assert get(k8s_plane, f"/apis/batch/v1/namespaces/{ns}/jobs/alive") is not None
        assert get(k8s_plane, item)["spec"]["suspend"] is True  # still there, still paused
    finally:
        for name in ("alive", "next", "paused"):
            await b.stop(name)
        await other.stop("bobs")
        await b.close()
        await other.close()
