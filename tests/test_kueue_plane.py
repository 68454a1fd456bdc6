"""Kueue admitting `%%tfdist run` jobs on the kwok plane (real API server, scheduler, Kueue's manager and
its webhooks; kwok GPU nodes): one job is one admission, all of its pods or none.

One plane for the module (``ControlPlane(kueue=True)``) with one 8-GPU H100 node and one queue of 8 H100s,
made by tfdist.kube.queueing_apply from a profiles section; two users, each with the queue's LocalQueue.
Jobs are submitted by the real Kubernetes backend with TFDIST_KUEUE_QUEUE set.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import sys
import time
from pathlib import Path

import pytest

from tests.kueue_fixtures import api_client, kueue_plane, until
from tests.kueue_proc import GATE
from tests.test_k8s_escapes import call, gpu_job, refused
from tests.test_k8s_tenancy import _api_for_token, _token, gpu_policy, notebook_pod, wait_policy_in_force
from tfdist.backends.base import Launch
from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.errors import JobSpecError
from tfdist.jobspec import JobSpec
from tfdist.kube import manifests as mf
from tfdist.kube import names as kn
from tfdist.kube import preemption as pre
from tfdist.kube import queueing as q
from tfdist.kube import queueing_apply as qa
from tfdist.kube import queueline as ql
from tfdist.kube import tenancy
from tfdist.kube.apply import prepare_user_namespace, prepare_user_queues, user_kubeconfig
from tfdist.settings import from_environ
from tfdist.spawner.profiles import parse_profiles

pytestmark = [pytest.mark.k8s]
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
QUEUE = "team"
USERS = ("kq-ann", "kq-bob")
PROFILES = {
    "gpu_models": {"h100": {"display_name": "H100", "node_selector": H100}},
    "kueue": {"cohort": "pool", "queues": {QUEUE: {"cpu": 32, "gpus": {"h100": 8}}}},
    "profiles": [
        {
            "slug": "gpu",
            "display_name": "GPU",
            "groups": ["ml"],
            "cpu": {"min": 1, "max": 8, "default": 1},
            "memory_gib": {"min": 1, "max": 8, "default": 1},
            "gpus": {"max": 8},
            "gpu_models": ["h100"],
            "kueue_queue": QUEUE,
            "images": ["img"],
        }
    ],
}
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def kq(request):
    """The process's one plane with Kueue (tests/kueue_fixtures.py), with this module's node, users and
    queues."""
    t0 = time.monotonic()
    plane = kueue_plane(request.config, __name__)
    TIMES["plane_with_kueue_s"] = time.monotonic() - t0
    TIMES["kueue_start_s"] = plane.kueue_seconds or 0.0
    try:
        plane.add_gpu_nodes(1, 8, H100["nvidia.com/gpu.product"])
        for u in USERS:
            plane.create_namespace(u)

        async def setup():
            async with await api_client(plane) as api:
                cfg = parse_profiles(PROFILES)
                await qa.converge(api, cfg)
                for u in USERS:
                    await qa.converge_user(api, cfg, u, ["ml"])

        asyncio.run(setup())
        yield plane
    finally:
        print(f"\nkueue plane timings: {TIMES}")


def backend(plane, ns: str, queue: str = QUEUE) -> KubernetesBackend:
    b = KubernetesBackend(
        from_environ(
            {
                "TFDIST_NAMESPACE": ns,
                "TFDIST_WORKER_IMAGE": "example.org/tfdist-job:1",
                "USER": ns,
                "TFDIST_KUEUE_QUEUE": queue,
            }
        ),
        kubeconfig=plane.kubeconfig,
    )
    b.node_selector = H100
    return b


def spec(name: str, ns: str, **kw) -> JobSpec:
    base = {"name": name, "user": ns, "namespace": ns, "backend": "kubernetes", "timeout_s": 300}
    return JobSpec(**(base | kw))


def pods(plane, ns: str, job: str) -> list[dict]:
    return plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3D{job}")["items"]


def bound(p: dict) -> bool:
    return bool(p["spec"].get("nodeName"))


def gated(p: dict) -> bool:
    return any(g["name"] == GATE for g in p["spec"].get("schedulingGates", []))


def all_bound(plane, ns, job, n):
    ps = pods(plane, ns, job)
    return len(ps) == n and all(bound(p) for p in ps)


async def test_queues_converge_idempotently_and_kueue_accepts_them(kq):
    async with await api_client(kq) as api:
        cfg = parse_profiles(PROFILES)
        again = await qa.converge(api, cfg)
        assert again.created == again.updated == again.deleted == []
        assert sorted(again.unchanged) == [
            "ClusterQueue/team",
            "Cohort/pool",
            "ResourceFlavor/default",
            "ResourceFlavor/h100",
            "WorkloadPriorityClass/tfdist-notebook",
        ]
        # Kueue took the queue as valid and active (its flavors exist), and each user's LocalQueue too
        cq = kq.get("/apis/kueue.x-k8s.io/v1beta2/clusterqueues/team")
        await until(
            "ClusterQueue active", lambda: _active(kq, "/apis/kueue.x-k8s.io/v1beta2/clusterqueues/team")
        )
        assert cq["spec"]["cohortName"] == "pool"
        for u in USERS:
            await until(
                "LocalQueue active",
                lambda u=u: _active(kq, f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{u}/localqueues/{QUEUE}"),
            )
        # a queue the profiles no longer name is removed, the rest stays
        extra = parse_profiles(
            PROFILES | {"kueue": {"cohort": "pool", "queues": {QUEUE: {"gpus": {"h100": 8}}, "spare": {}}}}
        )
        changed = await qa.converge(api, extra)
        assert changed.created == ["ClusterQueue/spare"] and changed.updated == ["ClusterQueue/team"]
        back = await qa.converge(api, cfg)
        assert back.deleted == ["ClusterQueue/spare"] and back.updated == ["ClusterQueue/team"]


def _active(plane, path: str) -> bool:
    obj = plane.get(path) or {}
    return any(
        c["type"] == "Active" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", [])
    )


async def test_second_users_job_stays_gated_while_the_first_runs_then_starts(kq):
    """8 GPUs, two jobs of 8 (2 workers x 4): the second has no pod bound while the first runs, its place
    in line is shown, and it is admitted (every pod at once) when the first ends."""
    ann, bob = USERS
    a, b = backend(kq, ann), backend(kq, bob)
    t0 = time.monotonic()
    try:
        await a.submit(spec("big", ann, workers=2, ps=1, gpus_per_worker=4), b"p", Launch())
        await until("ann's job bound", lambda: all_bound(kq, ann, "big", 4))
        TIMES["first_job_admitted_and_bound_s"] = time.monotonic() - t0
        await b.submit(spec("big", bob, workers=2, ps=1, gpus_per_worker=4), b"p", Launch())
        await until("bob's 4 pods created", lambda: len(pods(kq, bob, "big")) == 4)
        # what the cell and the panel get: the backend's watch says where the job waits
        seen = []

        async def follow():
            async for ev in b.watch("big"):
                seen.append(ev)

        watching = asyncio.ensure_future(follow())
        await until("a queue event in bob's watch", lambda: [e for e in seen if e.type == "queue"], 30)
        assert [(e.position, e.queue) for e in seen if e.type == "queue"] == [(1, QUEUE)]
        assert not any(e.type == "state" and e.state.terminal for e in seen)
        watching.cancel()
        # `%tfdist list` and the panel (status, also from a server that did not submit it) say the same
        view = await b.status("big")
        assert view.queue is not None and (view.queue.position, view.queue.queue) == (1, QUEUE)
        assert view.state_word == "queued" and view.message == "queued: 1st in team"
        other = backend(kq, bob)
        try:
            (listed,) = [j for j in await other.list_jobs() if j.name == "big"]
            assert listed.queue is not None and listed.queue.position == 1
        finally:
            await other.close()
        async with await api_client(kq) as api:
            line = qa.queue_events(api, bob, "big", QUEUE, every_s=0.3)
            ev = await asyncio.wait_for(anext(line), 30)  # the job protocol's QueueEvent
            assert (ev.type, ev.position, ev.ahead, ev.queue) == ("queue", 1, 0, QUEUE)
            pos = await qa.read_position(api, bob, "big", QUEUE)
            assert (pos.position, pos.ahead, pos.source, pos.admitted) == (1, 0, "visibility", False)
            # it stays that way while ann's job runs: gated, nothing bound, ann's pods untouched
            for _ in range(10):
                bp = pods(kq, bob, "big")
                assert all(gated(p) and not bound(p) for p in bp), [p["spec"] for p in bp]
                assert all_bound(kq, ann, "big", 4)
                await asyncio.sleep(0.3)
            assert await a.stop("big")
            t_end = time.monotonic()
            await until("bob's job bound", lambda: all_bound(kq, bob, "big", 4), timeout=90)
            TIMES["second_admitted_after_first_ended_s"] = time.monotonic() - t_end
            with pytest.raises(StopAsyncIteration):  # admitted: the line is over
                await asyncio.wait_for(anext(line), 30)
            bp = pods(kq, bob, "big")
            assert not any(gated(p) for p in bp)
            workers = [p for p in bp if p["metadata"]["labels"][kn.L_ROLE] == "worker"]
            assert len(workers) == 2 and all(
                kq.get(f"/api/v1/nodes/{p['spec']['nodeName']}")["metadata"]["labels"][
                    "nvidia.com/gpu.product"
                ]
                == H100["nvidia.com/gpu.product"]
                for p in workers
            )
            assert (await qa.read_position(api, bob, "big", QUEUE)).admitted
        assert await b.stop("big")
    finally:
        await a.close()
        await b.close()
    await until("both jobs gone", lambda: not pods(kq, ann, "big") and not pods(kq, bob, "big"), timeout=60)


async def test_job_larger_than_the_queue_is_refused_with_the_numbers_before_anything_exists(kq):
    """12 GPUs on a queue of 8 (no cohort peer to borrow from): the backend refuses it at submit with the
    numbers, and nothing of it exists (no Job, pod or Workload); the pure check on the live queues agrees."""
    ann = USERS[0]
    s = spec("huge", ann, workers=3, ps=1, gpus_per_worker=4)
    why = (
        "the job needs 12 nvidia.com/gpu of h100, but queue team can never hold more than 8 nvidia.com/gpu "
        "(its quota 8 nvidia.com/gpu + 0 nvidia.com/gpu it may borrow): make the job smaller"
    )
    async with await api_client(kq) as api:
        caps = ql.capacities(await qa.cluster_queues(api), QUEUE)
    demand = ql.job_demand(
        [mf.root_job(s, None), *mf.job_objects(s, token="t", queue=QUEUE, node_selector=H100)]
    )
    assert ql.refusal(demand, caps, gpu_flavor="h100") == why
    a = backend(kq, ann)
    try:
        with pytest.raises(JobSpecError) as refused:
            await a.submit(s, b"p", Launch())
        assert str(refused.value) == why
        assert kq.get(f"/apis/batch/v1/namespaces/{ann}/jobs/huge") is None
        assert pods(kq, ann, "huge") == []
        assert kq.get(f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{ann}/workloads/huge") is None
        # a job that fits the queue (8 of 8) passes the same check
        assert (
            await a._check_queue(
                spec("fits", ann, workers=2, ps=1, gpus_per_worker=4),
                mf,
                mf.root_job(spec("fits", ann), None),
            )
            is None
        )
    finally:
        await a.close()


async def test_two_partially_fitting_jobs_never_deadlock(kq):
    """Two jobs of 6 GPUs on 8, submitted together: without all-or-nothing each could hold part of the
    GPUs the other waits for. Here, at every sample, no pod is bound without its whole job's quota reserved
    (Kueue's Workload admitted) and never both jobs at once; the first runs, the other once it ends."""
    ann, bob = USERS
    a, b = backend(kq, ann), backend(kq, bob)
    try:
        await asyncio.gather(
            a.submit(spec("six", ann, workers=2, ps=1, gpus_per_worker=3), b"p", Launch()),
            b.submit(spec("six", bob, workers=2, ps=1, gpus_per_worker=3), b"p", Launch()),
        )
        samples = 0
        first = None
        deadline = time.monotonic() + 60
        while first is None:
            assert time.monotonic() < deadline, "neither job was admitted"
            admitted = []
            for ns in (ann, bob):
                wl = kq.get(f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/six") or {}
                # Kueue reserves the whole group's quota, then lifts the pods' gates one request each and
                # the scheduler binds them one by one: a partial start is a pod bound without that
                # reservation, or both jobs holding one at once
                ps = pods(kq, ns, "six")
                n_bound = sum(bound(p) for p in ps)
                assert not n_bound or ql.is_admitted(wl), f"{ns}: {n_bound} of 4 bound, not admitted"
                if ql.is_admitted(wl):
                    admitted.append(ns)
                if n_bound == 4:
                    first = ns
            assert len(admitted) < 2, "both jobs admitted on 8 GPUs"
            samples += 1
            await asyncio.sleep(0.2)
        other = bob if first == ann else ann
        for _ in range(10):
            ps = pods(kq, other, "six")
            assert sum(bound(p) for p in ps) == 0 and all(gated(p) for p in ps)
            await asyncio.sleep(0.3)
        assert await (a if first == ann else b).stop("six")
        await until("the other job runs", lambda: all_bound(kq, other, "six", 4), timeout=90)
        assert await (a if other == ann else b).stop("six")
    finally:
        await a.close()
        await b.close()


# ------------------------------------------------------------------ fair sharing between users
FAIR = "fair"
BURST = 6  # jobs per user, each of the whole queue (8 GPUs): one runs at a time


def _fair_profiles() -> dict:
    """PROFILES with the queue ``fair`` (fair_sharing on) instead of ``team``: a fresh ClusterQueue, since
    Kueue v0.17.0 reads a queue's admissionScope when it first sees the queue (docs/queueing.md)."""
    d = copy.deepcopy(PROFILES)
    d["kueue"]["queues"] = {FAIR: {**d["kueue"]["queues"][QUEUE], "fair_sharing": True}}
    d["profiles"][0]["kueue_queue"] = FAIR
    return d


async def _converge_all(plane, profiles: dict) -> None:
    async with await api_client(plane) as api:
        cfg = parse_profiles(profiles)
        await qa.converge(api, cfg)
        for u in USERS:
            await qa.converge_user(api, cfg, u, ["ml"])


def _running_workloads(plane) -> list[tuple[str, str]]:
    """(namespace, job) of every Workload Kueue holds quota for and that has not finished."""
    out = []
    for ns in USERS:
        for wl in plane.get(f"{KUEUE_API}/namespaces/{ns}/workloads")["items"]:
            if ql.is_admitted(wl) and not ql.is_finished(wl):
                out.append((ns, wl["metadata"]["name"]))
    return out


async def _admission_order(plane, queue: str, prefix: str, rounds: int) -> list[tuple[str, str]]:
    """Ann submits BURST jobs of 8 GPUs, then Bob BURST; each admitted job runs a second (its pods bound)
    and is stopped, ``rounds`` times. Returns the jobs in the order Kueue admitted them."""
    backends = {u: backend(plane, u, queue) for u in USERS}
    order: list[tuple[str, str]] = []
    names = {u: [f"{prefix}-{i}" for i in range(1, BURST + 1)] for u in USERS}
    try:
        for u in USERS:
            await asyncio.gather(
                *(
                    backends[u].submit(spec(name, u, workers=1, ps=1, gpus_per_worker=8), b"p", Launch())
                    for name in names[u]
                )
            )
            # each burst a Workload per job before the next user's: Kueue's queue order is the Workload's
            # creation time in whole seconds (the same second: any order), so a second between the users.
            # And every pod of each job: Kueue admits a pod group only once all its pods exist, and
            # BestEffortFIFO passes over one still missing a pod (CI on a252c2b, under load: Bob's job
            # admitted before Ann's third, whose pods the Job controller had not all made yet)
            await until(
                f"{u}'s burst queued",
                lambda u=u: (
                    len(plane.get(f"{KUEUE_API}/namespaces/{u}/workloads")["items"]) >= BURST
                    and all(len(pods(plane, u, n)) == 3 for n in names[u])
                ),
                timeout=90,
            )
            await asyncio.sleep(1.1)
        for _ in range(rounds):
            (running,) = await until("one job admitted", lambda: _running_workloads(plane) or None, 90)
            assert running not in order
            order.append(running)
            ns, job = running
            await until(f"{job} of {ns} bound", lambda ns=ns, job=job: all_bound(plane, ns, job, 3), 90)
            await asyncio.sleep(1.0)  # it runs: Kueue samples its user's usage every second
            assert await backends[ns].stop(job)
            await until(f"{job} of {ns} over", lambda r=running: r not in _running_workloads(plane), 60)
        return order
    finally:
        await asyncio.gather(
            *(backends[u].stop(name) for u in USERS for name in names[u]), return_exceptions=True
        )
        for b in backends.values():
            await b.close()
        await until(
            "the bursts gone",
            lambda: not any(pods(plane, u, n) for u in USERS for n in names[u]),
            timeout=120,
        )


async def test_without_fair_sharing_the_queue_admits_first_come_first_served(kq):
    """The queue ``team`` (fair_sharing off): Ann's burst came first, so all of it goes first."""
    ann, _ = USERS
    t0 = time.monotonic()
    order = await _admission_order(kq, QUEUE, "fifo", rounds=3)
    TIMES["fifo_burst_s"] = time.monotonic() - t0
    assert [ns for ns, _ in order] == [ann, ann, ann], order


async def test_with_fair_sharing_the_second_user_gets_a_turn_after_the_first_users_first_job(kq):
    """The queue ``fair`` (fair_sharing on, Kueue's Admission Fair Sharing): Ann submitted 6 jobs before
    Bob's 6, yet once Ann's first ends Bob's first is admitted, not Ann's second: Ann's LocalQueue has used
    the GPUs, Bob's has not."""
    ann, bob = USERS
    t0 = time.monotonic()
    await _converge_all(kq, _fair_profiles())
    try:
        cq = kq.get(f"{KUEUE_API}/clusterqueues/{FAIR}")
        assert cq["spec"]["admissionScope"] == {"admissionMode": q.FAIR}
        await until("ClusterQueue fair active", lambda: _active(kq, f"{KUEUE_API}/clusterqueues/{FAIR}"))
        order = await _admission_order(kq, FAIR, "fair", rounds=2)
        # Kueue's own account of it: Ann's LocalQueue is charged for the GPUs it held
        lq = kq.get(f"{KUEUE_API}/namespaces/{ann}/localqueues/{FAIR}")
        used = lq["status"]["fairSharing"]["admissionFairSharingStatus"]["consumedResources"]
        assert ql._parse_quantity(used["nvidia.com/gpu"]) > 0, lq["status"]
    finally:
        await _converge_all(kq, PROFILES)
    TIMES["fair_burst_s"] = time.monotonic() - t0
    assert [ns for ns, _ in order] == [ann, bob], order
    assert kq.get(f"{KUEUE_API}/namespaces/{ann}/localqueues/{QUEUE}") is not None  # the module's again


def label_pod(plane, ns: str, name: str, labels: dict[str, str]) -> None:
    import json
    import urllib.request

    body = json.dumps({"metadata": {"labels": labels}}).encode()
    req = urllib.request.Request(
        f"{plane.server}/api/v1/namespaces/{ns}/pods/{name}", data=body, method="PATCH"
    )
    req.add_header("Authorization", f"Bearer {plane.token}")
    req.add_header("Content-Type", "application/merge-patch+json")
    urllib.request.urlopen(req, context=plane._ssl, timeout=10).read()


async def test_a_failed_worker_is_replaced_inside_the_admitted_group(kq):
    """The group is marked not retriable (so that it ends when its job does), yet a worker that fails while
    the others run is replaced by the Job controller and Kueue lets the replacement run: the job keeps its
    admission and its restarts (kwok's pod-fail stage fails the worker)."""
    ann = USERS[0]
    a = backend(kq, ann)
    try:
        await a.submit(spec("heal", ann, workers=2, ps=1, gpus_per_worker=4), b"p", Launch())
        await until("bound", lambda: all_bound(kq, ann, "heal", 4))
        w0 = next(p for p in pods(kq, ann, "heal") if p["metadata"]["name"].startswith("heal-worker-0-"))
        label_pod(kq, ann, w0["metadata"]["name"], {"sim.tfdist.io/outcome": "fail"})

        def replaced():
            ps = pods(kq, ann, "heal")
            new = [p for p in ps if p["metadata"]["name"].startswith("heal-worker-0-")]
            return any(
                p["metadata"]["uid"] != w0["metadata"]["uid"] and bound(p) and not gated(p) for p in new
            )

        await until("the replacement worker bound", replaced, timeout=60)
        wl = kq.get(f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{ann}/workloads/heal")
        assert ql.is_admitted(wl) and not ql.is_finished(wl)
        assert await a.stop("heal")
    finally:
        await a.close()
    await until("the job gone", lambda: not pods(kq, ann, "heal"), timeout=60)


# ------------------------------------------------------------------------ tenancy: what a user may do
REPO = Path(__file__).resolve().parent.parent
KUEUE_API = "/apis/kueue.x-k8s.io/v1beta2"


@pytest.fixture(scope="module")
def tenant(kq):
    """The admission policy and the hub's RBAC from hub_config/ on the Kueue plane; a user namespace
    prepared with the HUB's own token, its LocalQueue and queue Role as the spawner converges them; the
    user's notebook token."""
    kq.kubectl("apply", "-f", str(REPO / "hub_config" / "admission-policy.yaml"))
    wait_policy_in_force(kq)
    hub_ns = kq.create_namespace("kq-hub")
    kq.request("POST", f"/api/v1/namespaces/{hub_ns}/serviceaccounts", {"metadata": {"name": "hub"}})
    rbac = Path(kq.workdir) / "hub-rbac.yaml"
    rbac.write_text((REPO / "hub_config" / "rbac-hub-tenancy.yaml").read_text().replace("NAMESPACE", hub_ns))
    kq.kubectl("apply", "-f", str(rbac))
    ns = "kq-hub-cat"
    policy = gpu_policy("cat", ns, hub_namespace=hub_ns, queue=QUEUE, node_selector=H100)

    async def prepare():
        async with _api_for_token(kq, _token(kq, hub_ns, "hub")) as api:
            await prepare_user_namespace(api, policy)
            return await prepare_user_queues(api, parse_profiles(PROFILES), policy, ["ml"])

    got = asyncio.run(prepare())
    assert got.created == [f"LocalQueue/{QUEUE}"]
    notebook_pod(kq, ns, "cat")
    return ns, _token(kq, ns, tenancy.NOTEBOOK_SA)


def _queued_job(plane, ns: str, name: str, job_labels: dict, pod_labels: dict, **pod) -> dict:
    """A Job the policy admits for a GPU profile on queue `team` when given the queue label on both."""
    job = gpu_job(plane, ns, name, **pod)
    job["metadata"]["labels"] = job_labels
    job["spec"]["template"]["metadata"]["labels"] = pod_labels
    return job


def test_a_user_reads_their_place_in_line_and_cannot_write_kueue_or_leave_the_queue(kq, tenant):
    ns, token = tenant
    lq = f"{KUEUE_API}/namespaces/{ns}/localqueues/{QUEUE}"
    code, got = call(kq, token, "GET", lq)
    assert code == 200 and q.A_LIMITS in got["metadata"]["annotations"]
    assert call(kq, token, "GET", f"{KUEUE_API}/namespaces/{ns}/workloads")[0] == 200
    # Kueue's objects are Kueue's and the hub's: no own Workload (an admission past the quota), no
    # LocalQueue pointing elsewhere, no ClusterQueue, no change to the LocalQueue
    wl = {"apiVersion": q.API_VERSION, "kind": "Workload", "metadata": {"name": "mine"}, "spec": {}}
    assert call(kq, token, "POST", f"{KUEUE_API}/namespaces/{ns}/workloads", wl)[0] == 403
    other = {"apiVersion": q.API_VERSION, "kind": "LocalQueue", "metadata": {"name": "x"}, "spec": {}}
    assert call(kq, token, "POST", f"{KUEUE_API}/namespaces/{ns}/localqueues", other)[0] == 403
    assert call(kq, token, "PUT", lq, got)[0] == 403
    assert call(kq, token, "DELETE", lq)[0] == 403
    assert call(kq, token, "POST", f"{KUEUE_API}/clusterqueues", {**other, "kind": "ClusterQueue"})[0] == 403
    assert call(kq, token, "GET", f"{KUEUE_API}/namespaces/kq-ann/workloads")[0] == 403  # not others'
    # the queue label on the Job and its pods, the profile's queue, no priority of one's own (dry runs)
    jobs = f"/apis/batch/v1/namespaces/{ns}/jobs?dryRun=All"
    mine = {q.L_QUEUE: QUEUE}
    assert call(kq, token, "POST", jobs, _queued_job(kq, ns, "ok", mine, mine))[0] == 201
    for job_labels, pod_labels, pod in (
        # the pods would skip the queue and its quota (a Job without labels takes its template's: no escape)
        (mine, {}, {}),
        (mine, {q.L_QUEUE: "other"}, {}),
        (mine, {**mine, "kueue.x-k8s.io/priority-class": "urgent"}, {}),
        (mine, mine, {"priorityClassName": "system-node-critical"}),
    ):
        refused(call(kq, token, "POST", jobs, _queued_job(kq, ns, "x", job_labels, pod_labels, **pod)))


async def test_the_users_notebook_refuses_a_job_larger_than_the_queue_from_the_localqueue(kq, tenant):
    """The user may not read ClusterQueues: the notebook's refusal comes from the limits the hub wrote on
    the LocalQueue, with the same numbers, and nothing is created."""
    ns, token = tenant
    kc = Path(kq.workdir) / "cat.kubeconfig"
    ca = base64.b64encode(Path(kq.ca_file).read_bytes()).decode()
    kc.write_text(json.dumps(user_kubeconfig(kq.server, ca, token, ns, "cat")))
    b = KubernetesBackend(
        from_environ(
            {
                "TFDIST_NAMESPACE": ns,
                "TFDIST_WORKER_IMAGE": "example.org/tfdist-job:1",
                "USER": "cat",
                "TFDIST_KUEUE_QUEUE": QUEUE,
            }
        ),
        kubeconfig=str(kc),
    )
    b.node_selector = H100
    try:
        with pytest.raises(JobSpecError) as why:
            await b.submit(spec("huge", ns, workers=3, ps=1, gpus_per_worker=4), b"p", Launch())
        assert "needs 12 nvidia.com/gpu of h100, but queue team can never hold more than 8" in str(why.value)
        assert kq.get(f"/apis/batch/v1/namespaces/{ns}/jobs/huge") is None
    finally:
        await b.close()


# ------------------------------------------------------------------------ the spawner converges them
@pytest.fixture
async def spawners(kq, monkeypatch):
    """Real TfdistKubeSpawners on the plane (KubeSpawner's client pointed at it): make(user, profiles).
    KubeSpawner's reflectors are class-level: a stop() starts one on this plane, stopped at teardown, or
    the next module's spawner (another plane) would watch this one and never see its pod."""
    import kubernetes_asyncio.config.kube_config as kc
    import yaml
    from kubernetes_asyncio.client import Configuration
    from kubespawner.clients import load_config

    from tfdist.spawner import kube as spawner_kube
    from tfdist.spawner.kube import TfdistKubeSpawner

    sys.path.insert(0, str(REPO / "tests" / "doubles"))
    from hub_objects import FakeGroup, FakeHub, FakeHubUser

    saved = Configuration.get_default_copy()
    monkeypatch.setenv("KUBECONFIG", kq.kubeconfig)
    monkeypatch.setattr(kc, "KUBE_CONFIG_DEFAULT_LOCATION", kq.kubeconfig)
    monkeypatch.setattr(spawner_kube, "_queues_converged", {})
    # the hub's one GPU view and queue count, on this plane (the form's availability check is on)
    monkeypatch.setattr(spawner_kube, "_view", None)
    monkeypatch.setattr(spawner_kube, "_queue_line", {})
    load_config.cache_clear()

    def make(name: str, profiles: dict) -> TfdistKubeSpawner:
        prof = Path(kq.workdir) / f"profiles-{name}.yaml"
        prof.write_text(yaml.safe_dump(profiles))
        user = FakeHubUser(name=name, groups=[FakeGroup("ml")])
        sp = TfdistKubeSpawner(
            user=user,
            hub=FakeHub(),
            profiles_file=str(prof),
            enable_user_namespaces=True,
            namespace="kq",
            start_timeout=120,
            k8s_api_request_retry_timeout=20,
        )
        sp.api_token = "secret-token"
        user.spawners[""] = sp
        return sp

    yield make
    await TfdistKubeSpawner._stop_all_reflectors()
    load_config.cache_clear()
    Configuration.set_default(saved)


def _writes(obj: dict) -> tuple:
    """An object's generation and who last wrote it outside its status, and when (managedFields)."""
    meta = obj["metadata"]
    fields = meta.get("managedFields") or []
    return meta.get("generation"), sorted(
        (f["manager"], f["operation"], f.get("time", "")) for f in fields if f.get("subresource") != "status"
    )


async def test_the_spawner_converges_the_queues_and_the_users_local_queues(kq, spawners):
    """A spawn converges the cluster's Kueue objects (a queue the profiles add appears) and the user's
    LocalQueues and queue Role; the next spawn changes nothing. The module's own queues are restored."""
    more = copy.deepcopy(PROFILES)
    more["kueue"]["queues"]["spare"] = {"gpus": {"h100": 0}}
    more["profiles"].append({**more["profiles"][0], "slug": "spare", "kueue_queue": "spare"})
    try:
        sp = spawners("dan", more)
        await sp._ensure_namespace()
        ns = sp.namespace
        assert kq.get(f"{KUEUE_API}/clusterqueues/spare") is not None
        lqs = kq.get(f"{KUEUE_API}/namespaces/{ns}/localqueues")["items"]
        assert sorted(x["metadata"]["name"] for x in lqs) == ["spare", QUEUE]
        role = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{tenancy.QUEUE_ROLE}"
        assert kq.get(role)["rules"] == tenancy.QUEUE_RULES
        # Kueue writes each LocalQueue's status every second (its fair-sharing usage): what counts is
        # that nobody wrote the objects themselves (spec, labels, annotations)
        versions = {x["metadata"]["name"]: _writes(x) for x in lqs}
        await sp._ensure_namespace()  # the next spawn: nothing to change
        again = kq.get(f"{KUEUE_API}/namespaces/{ns}/localqueues")["items"]
        assert {x["metadata"]["name"]: _writes(x) for x in again} == versions
    finally:
        async with await api_client(kq) as api:
            await qa.converge(api, parse_profiles(PROFILES))


async def test_a_gpu_server_waits_in_the_queue_with_its_place_and_starts_when_a_gpu_frees(kq, spawners):
    """Two 8-GPU servers on a queue (and a node) of 8, the form's availability check on: the second is
    accepted though no GPU is free (the form says so and how many wait), its pod is gated, never bound,
    while the first runs, its spawn progress says where it waits and why, and it starts once the first
    stops. A server larger than the queue can ever hold is refused with the numbers and creates nothing."""
    from tornado import web

    from tfdist.spawner import kube as spawner_kube

    opts = {"profile": "gpu", "cpu": 1, "memory": 1, "gpus": 8, "gpu_model": "h100", "image": "img"}
    big = copy.deepcopy(PROFILES)
    big["profiles"][0]["gpus"]["max"] = 16  # the profile allows it; the queue never can
    first, second, third = spawners("eve", PROFILES), spawners("fay", PROFILES), spawners("gil", big)
    models = first.tfdist_profiles().gpu_models
    view = spawner_kube.shared_gpu_view()

    def h100_free() -> int | None:
        av = view.availability(models)
        return av["h100"].free if av is not None else None

    async def form() -> str:
        spawner_kube._queue_line.clear()  # past the form's few seconds of cache
        return " ".join((await second.tfdist_render_form()).split())

    try:
        await until("the GPU view loaded", lambda: h100_free() == 8, 30)
        first.user_options = dict(opts)
        await first._run_apply_user_options(dict(opts))
        await asyncio.wait_for(first.start(), 90)
        await until("the first server's GPUs counted", lambda: h100_free() == 0, 30)
        second.user_options = dict(opts)
        await second._run_apply_user_options(dict(opts))  # no GPU free: accepted, it waits in the queue
        assert "H100 (0 free · 0 waiting in team: your server will start when a GPU frees)" in await form()

        too_big = {**opts, "gpus": 9}
        with pytest.raises(web.HTTPError) as refused_big:
            await third._run_apply_user_options(too_big)
        assert refused_big.value.jupyterhub_message == (
            "H100: you asked for 9 GPUs, but queue team can never hold more than 8 (its quota 8 + 0 it may "
            "borrow), so this server could never start. Ask for at most 8."
        )
        assert third.tfdist_choice is None
        assert kq.get(f"/api/v1/namespaces/{third.namespace}/pods/{third.pod_name}") is None
    except BaseException:
        for sp in (first, second):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sp.stop(now=True), 60)
        await view.stop()
        raise
    pod_path = f"/api/v1/namespaces/{second.namespace}/pods/{second.pod_name}"
    starting = asyncio.ensure_future(second.start())
    said: list[str] = []

    async def follow():
        async for ev in second.progress():
            said.append(ev.get("message", ""))

    following = asyncio.ensure_future(follow())
    try:
        await until("a queue message", lambda: [m for m in said if m.startswith("Waiting for a GPU")], 60)
        msg = next(m for m in said if m.startswith("Waiting for a GPU"))
        assert msg.startswith("Waiting for a GPU: queued: 1st in team (") and "nvidia.com/gpu" in msg, msg
        pod = kq.get(pod_path)
        assert pod["metadata"]["labels"][q.L_QUEUE] == QUEUE and gated(pod) and not bound(pod)
        # the notebooks' priority (evicted after every job of a borrowing queue), a class the hub converged
        assert pod["metadata"]["labels"][pre.L_PRIORITY] == pre.NOTEBOOK_PRIORITY
        assert kq.get(f"/apis/kueue.x-k8s.io/v1beta2/workloadpriorityclasses/{pre.NOTEBOOK_PRIORITY}")
        waiting = "H100 (0 free · 1 waiting in team: your server will start when a GPU frees)"
        shown: list[str] = []

        async def shows_one_waiting() -> bool:
            shown[:] = [await form()]
            return waiting in shown[0]

        t_end = time.monotonic() + 30
        while not await shows_one_waiting():
            assert time.monotonic() < t_end, f"the form never said {waiting!r}: {shown}"
            await asyncio.sleep(0.5)
        assert not starting.done()
        await asyncio.wait_for(first.stop(now=True), 60)
        await asyncio.wait_for(starting, 90)
        assert bound(kq.get(pod_path)) and not gated(kq.get(pod_path))
    finally:
        following.cancel()
        if not starting.done():
            starting.cancel()
        for sp in (first, second):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sp.stop(now=True), 60)
        await view.stop()
