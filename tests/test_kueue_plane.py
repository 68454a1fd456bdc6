"""Kueue admitting `%%tfdist run` jobs on the kwok plane (real API server, scheduler, Kueue's manager and
its webhooks; kwok GPU nodes): one job is one admission, all of its pods or none.

One plane for the module (``ControlPlane(kueue=True)``) with one 8-GPU H100 node and one queue of 8 H100s,
made by tfdist.kube.queueing_apply from a profiles section; two users, each with the queue's LocalQueue.
Jobs are submitted by the real Kubernetes backend with TFDIST_KUEUE_QUEUE set.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests import kube_plane
from tests.kueue_proc import GATE, kueue_missing
from tfdist.backends.base import Launch
from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.jobspec import JobSpec
from tfdist.kube import manifests as mf
from tfdist.kube import queueing as q
from tfdist.kube import queueing_apply as qa
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


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


async def api_client(plane):
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=plane.kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


@pytest.fixture(scope="module")
def kq():
    bin_dir = kube_plane.find_bin_dir()
    why = ", ".join(kube_plane.missing_binaries(bin_dir)) or kueue_missing()
    if why:
        if _in_ci():
            pytest.fail(f"{why} [CI is set, so this is an error]", pytrace=False)
        pytest.skip(why)
    t0 = time.monotonic()
    plane = kube_plane.ControlPlane(bin_dir, kueue=True)
    try:
        plane.start()
        TIMES["plane_with_kueue_s"] = time.monotonic() - t0
        TIMES["kueue_start_s"] = plane.kueue_seconds or 0.0
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
        plane.stop()


def backend(plane, ns: str) -> KubernetesBackend:
    b = KubernetesBackend(
        from_environ(
            {
                "TFDIST_NAMESPACE": ns,
                "TFDIST_WORKER_IMAGE": "example.org/tfdist-job:1",
                "USER": ns,
                "TFDIST_KUEUE_QUEUE": QUEUE,
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
    return plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={mf.L_JOB}%3D{job}")["items"]


def bound(p: dict) -> bool:
    return bool(p["spec"].get("nodeName"))


def gated(p: dict) -> bool:
    return any(g["name"] == GATE for g in p["spec"].get("schedulingGates", []))


async def until(what: str, check, timeout: float = 60, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every)


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
        async with await api_client(kq) as api:
            line = qa.queue_events(api, bob, "big", QUEUE, every_s=0.3)
            ev = await asyncio.wait_for(anext(line), 30)  # the job protocol's QueueEvent
            assert (ev.type, ev.position, ev.ahead, ev.queue) == ("queue", 1, 0, QUEUE)
            pos = await qa.read_position(api, bob, "big", QUEUE)
            assert (pos.position, pos.ahead, pos.source, pos.admitted) == (1, 0, "workloads", False)
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
            workers = [p for p in bp if p["metadata"]["labels"][mf.L_ROLE] == "worker"]
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


async def test_job_larger_than_the_queue_is_refused_with_the_numbers(kq):
    """12 GPUs on a queue of 8 (no cohort peer to borrow from): the pre-check says so before anything is
    created, and Kueue's own verdict on such a workload agrees."""
    ann = USERS[0]
    s = spec("huge", ann, workers=3, ps=1, gpus_per_worker=4)
    async with await api_client(kq) as api:
        caps = q.capacities(await qa.cluster_queues(api), QUEUE)
    demand = q.job_demand(
        [mf.root_job(s, None), *mf.job_objects(s, token="t", queue=QUEUE, node_selector=H100)]
    )
    why = q.refusal(demand, caps, gpu_flavor="h100")
    assert why == (
        "the job needs 12 nvidia.com/gpu of h100, but queue team can never hold more than 8 nvidia.com/gpu "
        "(its quota 8 nvidia.com/gpu + 0 nvidia.com/gpu it may borrow): make the job smaller"
    )
    a = backend(kq, ann)
    try:
        await a.submit(s, b"p", Launch())
        wl_path = f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{ann}/workloads/huge"
        msg = await until("Kueue's verdict", lambda: q.workload_refusal(kq.get(wl_path) or {}), timeout=60)
        assert "nvidia.com/gpu" in msg and "maximum capacity" in msg
        assert not any(bound(p) for p in pods(kq, ann, "huge"))
        assert await a.stop("huge")
    finally:
        await a.close()


async def test_two_partially_fitting_jobs_never_deadlock(kq):
    """Two jobs of 6 GPUs on 8, submitted together: without all-or-nothing each could hold part of the
    GPUs the other waits for. Here a job has all of its pods bound or none, at every sample; the first
    admitted runs, and the other runs once it ends."""
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
            for ns in (ann, bob):
                ps = pods(kq, ns, "six")
                n_bound = sum(bound(p) for p in ps)
                assert n_bound in (0, 4), f"{ns}: {n_bound} of 4 pods bound (a partial start)"
                if n_bound == 4:
                    first = ns
            samples += 1
            await asyncio.sleep(0.2)
        other = bob if first == ann else ann
        for _ in range(10):
            assert sum(bound(p) for p in pods(kq, other, "six")) == 0
            await asyncio.sleep(0.3)
        assert await (a if first == ann else b).stop("six")
        await until("the other job runs", lambda: all_bound(kq, other, "six", 4), timeout=90)
        assert await (a if other == ann else b).stop("six")
    finally:
        await a.close()
        await b.close()


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
        assert q.is_admitted(wl) and not q.is_finished(wl)
        assert await a.stop("heal")
    finally:
        await a.close()
    await until("the job gone", lambda: not pods(kq, ann, "heal"), timeout=60)
