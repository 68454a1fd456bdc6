"""Kueue on the one-machine cluster's real node, CPU as the contended resource: `%%tfdist run` jobs of two
users in real containers, admitted by Kueue as one unit (docs/queueing.md; the kwok plane's GPU version is
tests/test_kueue_plane.py).

Kueue's manager runs as a host process against the node's API server for this module only
(tests.realnode.start_kueue; its webhook configurations are removed after it, so the other real-node tests
pay nothing; `scripts/cluster up --kueue` starts the same for people). One ClusterQueue of 1.5 CPU, made by
tfdist.kube.queueing_apply from a profiles section; two users whose namespaces the spawner's own code
prepares, each with the queue's LocalQueue. A job is coordinator + 1 worker + 1 PS at 0.45 CPU each
(1.35 CPU): one fits the queue, two do not (2.7 CPU; the 2-core node alone would have let a part of the
second start, the partial start issue 25 found). Each host kernel acts as its user's notebook.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import urllib.error
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests import realnode
from tests.kernels import PACE_IMPORT, paced
from tests.realnode_jobs import (
    Tenant,
    WatchedKernel,
    digits_kernel,
    drop_tenant,
    job_pods,
    job_state,
    left,
    make_tenant,
    running,
    start_notebook_pod,
    wait_first_epoch,
    wait_for,
)
from tfdist.kube import manifests as mf

if "tests.realnode_fixtures" not in sys.modules:
    from tests.realnode_fixtures import job_image, real_cluster  # noqa: F401

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]

QUEUE = "rn-team"
QUEUE_CPU = 1.5
PROFILES = {
    "kueue": {"cohort": "rn-pool", "queues": {QUEUE: {"cpu": QUEUE_CPU}}},
    "profiles": [
        {
            "slug": "cpu",
            "display_name": "CPU",
            "groups": ["ml"],
            "cpu": {"min": 0.5, "max": 2, "default": 1},
            "memory_gib": {"min": 1, "max": 4, "default": 1},
            "kueue_queue": QUEUE,
            "images": ["img"],
        }
    ],
}
# a job of 3 pods at 0.45 CPU: 1.35 of the queue's 1.5. Paced data (tests.kernels.paced): the fit lasts
# >= 10 s on any CPU, so the first job still trains while the second is watched waiting
CELL = (
    "%%tfdist run --workers {workers} --ps 1 --name {name} --cpu 0.45 --memory 1536Mi\n"
    "history = model.fit(paced_ds, epochs=2, steps_per_epoch=10)\n"
)
TIMES: dict[str, float] = {}
WL = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/{job}"


def cell(name: str, workers: int = 1) -> str:
    return CELL.format(name=name, workers=workers)


async def admin_api(state: dict):
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=state["kubeconfig"], client_configuration=cfg)
    return client.ApiClient(cfg)


@pytest.fixture(scope="module")
def kueue_rn(real_cluster):
    """Kueue on the real node for this module (reused where `scripts/cluster up --kueue` runs one), the
    queue converged from PROFILES; afterwards the queue, and the module's Kueue with its webhooks, go."""
    from tfdist.kube import queueing_apply as qa
    from tfdist.spawner.profiles import parse_profiles

    state = real_cluster.state
    own = None
    if not realnode.kueue_running(state):
        own, TIMES["kueue_start_s"] = realnode.start_kueue(state)

    async def converge(profiles: dict) -> None:
        async with await admin_api(state) as api:
            await qa.converge(api, parse_profiles(profiles))

    try:
        asyncio.run(converge(PROFILES))
        yield parse_profiles(PROFILES)
    finally:
        # this module's queue, cohort, flavor and priority class, gone while Kueue still runs (it holds a
        # finalizer on each ClusterQueue and flavor in use: a stopped Kueue would leave them terminating)
        queue_objects = [
            f"/apis/kueue.x-k8s.io/v1beta2/{kind}/{name}"
            for kind, name in (
                ("clusterqueues", QUEUE),
                ("cohorts", "rn-pool"),
                ("resourceflavors", "default"),
                ("workloadpriorityclasses", "tfdist-notebook"),  # the notebooks' (queueing.cluster_objects)
            )
        ]
        with contextlib.suppress(OSError):  # the cluster went down: nothing is left to remove
            for path in queue_objects:
                with contextlib.suppress(urllib.error.HTTPError):
                    real_cluster.request("DELETE", path)
            wait_for(
                "the module's queue objects gone",
                lambda: all(real_cluster.get(p) is None for p in queue_objects),
                60,
            )
        if own is not None:
            realnode.stop_kueue(state, own)


@dataclass
class User:
    tenant: Tenant
    kernel: WatchedKernel


@pytest.fixture(scope="module")
def users(real_cluster, kueue_rn, job_image, tmp_path_factory):
    """Two users' namespaces as the spawner prepares them (tenancy, then their LocalQueue and queue Role),
    a stand-in notebook pod each, and a host kernel each with the example's model and (paced) data. The
    namespaces go before Kueue does (its finalizers on the job pods need it running)."""
    from tfdist.kube.apply import prepare_user_queues
    from tfdist.kube.tenancy import TenantPolicy

    workdir = tmp_path_factory.mktemp("kueue-rn")
    tenants: list[Tenant] = []
    out: list[User] = []
    try:
        for prefix in ("kqa", "kqb"):
            t = make_tenant(real_cluster, prefix, workdir, queue=QUEUE)
            tenants.append(t)

            async def queues(t: Tenant = t) -> None:
                async with await admin_api(real_cluster.state) as api:
                    await prepare_user_queues(
                        api, kueue_rn, TenantPolicy(user=t.user, namespace=t.namespace, queue=QUEUE), ["ml"]
                    )

            asyncio.run(queues())
            start_notebook_pod(real_cluster, t)
        # the two kernels import TensorFlow side by side
        made: dict[int, Any] = {}

        def start(i: int) -> None:
            try:
                made[i] = digits_kernel(tenants[i], job_image, workdir, TFDIST_KUEUE_QUEUE=QUEUE)
            except BaseException as e:  # raised below, in the test's thread
                made[i] = e

        threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for i in range(2):
            if isinstance(made[i], BaseException):
                raise made[i]
            out.append(User(tenants[i], made[i]))
            r = made[i].run(f"{PACE_IMPORT}paced_ds = {paced('train_ds', 0.5)}")
            assert r.error is None, r.error_text
        yield out
    finally:
        for u in out:
            u.kernel.shutdown()
        for t in tenants:
            drop_tenant(real_cluster, t)
        for t in tenants:
            deadline = time.monotonic() + 120
            while real_cluster.get(f"/api/v1/namespaces/{t.namespace}") is not None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)


# ------------------------------------------------------------------------------------- the pod sampler


@dataclass
class Sample:
    t: float
    # (namespace, job) -> [(pod, node, phase, deleting)]
    pods: dict[tuple[str, str], list[tuple[str, str, str, bool]]]
    # (namespace, job) -> (Workload admitted, Workload finished)
    workload: dict[tuple[str, str], tuple[bool, bool]] = field(default_factory=dict)


class PodSampler:
    """Lists the jobs' pods (and, with `workloads`, whether each job's Workload is admitted) every 0.25 s:
    what the scheduler bound, when, against what Kueue admitted."""

    def __init__(self, cluster: Any, jobs: list[tuple[str, str]], workloads: bool = False) -> None:
        self.cluster, self.jobs, self.workloads = cluster, jobs, workloads
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        from tfdist.kube import queueline as ql

        while not self._stop.is_set():
            s = Sample(time.monotonic(), {})
            try:
                for ns, job in self.jobs:
                    if self.workloads:
                        wl = self.cluster.get(WL.format(ns=ns, job=job)) or {}
                        s.workload[(ns, job)] = (ql.is_admitted(wl), ql.is_finished(wl))
                    s.pods[(ns, job)] = mf_pods(self.cluster, ns, job)
            except Exception:  # one failed poll: the next one counts
                self._stop.wait(0.25)
                continue
            self.samples.append(s)
            self._stop.wait(0.25)

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._t.join()
        return self.samples


def live(pods: list[tuple[str, str, str, bool]]) -> list[tuple[str, str, str, bool]]:
    """Pods that hold (or wait for) the node: not ended."""
    return [p for p in pods if p[2] not in ("Succeeded", "Failed")]


def bound(pods: list[tuple[str, str, str, bool]]) -> list[tuple[str, str, str, bool]]:
    return [p for p in live(pods) if p[1]]


def cell_error(k: WatchedKernel, msg_id: str) -> str | None:
    r = k.wait(msg_id, timeout=5)
    return r.error_text if r.error else None


# ------------------------------------------------------------------------------------------ the tests


def test_a_job_larger_than_the_queue_is_refused_at_once_with_the_numbers(real_cluster, users):
    """2 workers + PS + coordinator = 1.8 CPU on a queue of 1.5: the cell fails at once, from the limits
    the hub wrote on the user's LocalQueue (the user may not read ClusterQueues), and nothing of it exists."""
    u = users[0]
    t0 = time.monotonic()
    r = u.kernel.run(cell("huge", workers=2), timeout=60)
    TIMES["refusal_s"] = time.monotonic() - t0
    assert r.error is not None
    assert (
        "the job needs 1.8 CPUs, but queue rn-team can never hold more than 1.5 CPUs "
        "(its quota 1.5 CPUs + 0 CPUs it may borrow): make the job smaller"
    ) in r.error_text, r.error_text
    assert (
        TIMES["refusal_s"] < 30
    )  # nothing is created: 1.6 s at load 6, 12.7 s at load 20 (the kernel's share)
    assert left(real_cluster, u.tenant.namespace, "huge") == []
    assert real_cluster.get(WL.format(ns=u.tenant.namespace, job="huge")) is None


def test_second_users_job_waits_whole_while_the_first_trains_then_trains(real_cluster, users):
    """Ann's job trains; Bob's, submitted then, is queued (his cell and `status()` say 1st in the queue),
    none of its pods has a node while any of Ann's still runs, and it trains to the end once hers ends.

    Meanwhile, what only real pods do: one of Ann's workers is deleted while her admitted job trains. It
    ends for real (Kueue's finalizer holds it until it has) and the Job controller's replacement joins the
    admitted group (no gate, bound, running, the Workload still admitted and not finished), her fit ends
    trained, and Bob's waiting job does not slip into the quota the deleted pod had."""
    from tfdist.kube import queueline as ql

    ann, bob = users
    a_ns, b_ns = ann.tenant.namespace, bob.tenant.namespace
    a_job, b_job = f"qa{uuid.uuid4().hex[:4]}", f"qb{uuid.uuid4().hex[:4]}"
    sampler = PodSampler(real_cluster, [(a_ns, a_job), (b_ns, b_job)])
    try:
        t0 = time.monotonic()
        a_since = ann.kernel.mark()
        a_cell = ann.kernel.submit(cell(a_job).replace("epochs=2", "epochs=8"))

        def a_running():
            if ann.kernel.idle_after(a_cell):
                raise AssertionError(
                    f"ann's cell ended before her pods ran: {cell_error(ann.kernel, a_cell)}"
                )
            pods = [p for p in mf_pods(real_cluster, a_ns, a_job) if p[2] == "Running"]
            return len(pods) == 3

        wait_for("ann's 3 pods running", a_running, 300)
        TIMES["first_job_running_s"] = time.monotonic() - t0
        since = bob.kernel.mark()
        b_cell = bob.kernel.submit(cell(b_job))

        def b_shown_queued() -> bool:
            if bob.kernel.idle_after(b_cell):
                raise AssertionError(
                    f"bob's cell ended while it should wait: {cell_error(bob.kernel, b_cell)}"
                )
            return any(f"queued: 1st in {QUEUE}" in t for t in bob.kernel.widget_texts(since))

        try:
            wait_for("bob's cell showing its place in line", b_shown_queued, 60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; bob's cell showed {bob.kernel.widget_texts(since)[-3:]}") from None
        assert not ann.kernel.idle_after(a_cell), "ann's job ended before bob's was seen waiting"
        # the typed record the panel and `%tfdist list` read (another backend of bob's, its own query)
        view = asyncio.run(status_of(bob.tenant, b_job))
        assert view.queue is not None and (view.queue.position, view.queue.queue) == (1, QUEUE), view
        assert view.state_word == "queued"

        # one of ann's workers deleted while her admitted job trains (bob's still waiting)
        wait_first_epoch(real_cluster, ann.kernel, a_cell, a_since, a_ns, a_job, timeout=300)
        (victim,) = [p for p in job_pods(real_cluster, a_ns, a_job, "worker") if running([p])]
        real_cluster.request("DELETE", f"/api/v1/namespaces/{a_ns}/pods/{victim['metadata']['name']}")
        t_del = time.monotonic()

        def replacement() -> list[dict]:
            if ann.kernel.idle_after(a_cell):
                raise AssertionError(
                    f"the fit ended before the replacement ran: {cell_error(ann.kernel, a_cell)}"
                )
            pods = job_pods(real_cluster, a_ns, a_job, "worker")
            return [p for p in running(pods) if p["metadata"]["uid"] != victim["metadata"]["uid"]]

        (new,) = wait_for("the replacement worker running", replacement, 180)
        TIMES["replacement_running_s"] = time.monotonic() - t_del
        assert new["spec"].get("nodeName") and not new["spec"].get("schedulingGates")
        wl = real_cluster.get(WL.format(ns=a_ns, job=a_job)) or {}
        assert ql.is_admitted(wl) and not ql.is_finished(wl), wl.get("status")

        ra = ann.kernel.wait(a_cell, timeout=600)
        assert ra.error is None, f"{ra.error_text}\n{job_state(real_cluster, a_ns, a_job)}"
        epochs = ann.kernel.run("print(len(history.history['loss']))")
        assert epochs.text.strip() == "8", epochs.text
        wait_for("ann's pods ended", lambda: not live(mf_pods(real_cluster, a_ns, a_job)), 120)
        t_a_end = time.monotonic()
        wait_for(
            "bob's 3 pods bound",
            lambda: len(bound(mf_pods(real_cluster, b_ns, b_job))) == 3 or bob.kernel.idle_after(b_cell),
            180,
        )
        TIMES["second_bound_after_first_ended_s"] = time.monotonic() - t_a_end
        rb = bob.kernel.wait(b_cell, timeout=600)
        assert rb.error is None, f"{rb.error_text}\n{job_state(real_cluster, b_ns, b_job)}"
        epochs = bob.kernel.run("print(len(history.history['loss']))")
        assert epochs.text.strip() == "2", epochs.text
        TIMES["both_jobs_s"] = time.monotonic() - t0
    finally:
        samples = sampler.stop()
    # every sample: while any of ann's pods was not over (the deleted worker's end included), none of
    # bob's had a node
    overlap = [s for s in samples if live(s.pods.get((a_ns, a_job), []))]
    waited = [s for s in overlap if s.pods.get((b_ns, b_job))]
    assert len(waited) >= 4, "bob's pods were never seen while ann's job ran"
    for s in overlap:
        assert not bound(s.pods.get((b_ns, b_job), [])), (s.pods, "bob's pod bound while ann's job ran")
    # bob's job waited whole: it had all 3 pods (gated) before any was bound
    first_bound = next(s for s in samples if bound(s.pods.get((b_ns, b_job), [])))
    assert any(len(s.pods.get((b_ns, b_job), [])) == 3 for s in samples if s.t < first_bound.t)


def test_two_jobs_submitted_together_never_deadlock(real_cluster, users):
    """Both users submit at once (each job alone fits, both do not): at every sample at most one job holds
    the queue's quota (its Workload admitted and not finished), no pod is bound without its job admitted,
    and never are pods of both jobs on the node; one trains, then the other."""
    ann, bob = users
    a_ns, b_ns = ann.tenant.namespace, bob.tenant.namespace
    job = f"qt{uuid.uuid4().hex[:4]}"
    quick = cell(job).replace(
        "fit(paced_ds, epochs=2, steps_per_epoch=10)", "fit(train_ds, epochs=1, steps_per_epoch=5)"
    )
    sampler = PodSampler(real_cluster, [(a_ns, job), (b_ns, job)], workloads=True)
    try:
        t0 = time.monotonic()
        cells = [ann.kernel.submit(quick), bob.kernel.submit(quick)]
        results = [ann.kernel.wait(cells[0], timeout=600), bob.kernel.wait(cells[1], timeout=600)]
        TIMES["together_s"] = time.monotonic() - t0
        for r, ns in zip(results, (a_ns, b_ns), strict=True):
            assert r.error is None, f"{r.error_text}\n{job_state(real_cluster, ns, job)}"
    finally:
        samples = sampler.stop()
    assert len(samples) > 20
    order: list[str] = []
    for s in samples:
        holding = [ns for (ns, _), (adm, fin) in s.workload.items() if adm and not fin]
        assert len(holding) < 2, "both jobs hold the quota of a queue that holds one"
        on_node = [ns for (ns, _), pods in s.pods.items() if bound(pods)]
        assert len(on_node) < 2, f"pods of both jobs on the node at once: {s.pods}"
        for (ns, _), pods in s.pods.items():
            admitted = s.workload.get((ns, job), (False, False))[0]
            assert not bound(pods) or admitted, f"{ns}: a pod bound, its job not admitted"
        if on_node and (not order or order[-1] != on_node[0]):
            order.append(on_node[0])
    # one ran, then the other (never back and forth)
    assert sorted(order) == sorted([a_ns, b_ns]), order


# ------------------------------------------------------------------------------------------ helpers


def mf_pods(cluster: Any, ns: str, job: str) -> list[tuple[str, str, str, bool]]:
    listed = cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={mf.L_JOB}%3D{job}") or {}
    return [
        (
            p["metadata"]["name"],
            p["spec"].get("nodeName") or "",
            (p.get("status") or {}).get("phase") or "",
            bool(p["metadata"].get("deletionTimestamp")),
        )
        for p in listed.get("items", [])
    ]


async def status_of(tenant: Tenant, job: str):
    """The job's view as another backend of the same user reads it (status(), as `%tfdist list` does)."""
    import tempfile

    from tfdist.backends.kubernetes import KubernetesBackend
    from tfdist.settings import from_environ

    b = KubernetesBackend(
        from_environ(
            {
                "TFDIST_NAMESPACE": tenant.namespace,
                "TFDIST_USER": tenant.user,
                "TFDIST_STATE_DIR": tempfile.mkdtemp(),
                "TFDIST_KUEUE_QUEUE": QUEUE,
            }
        ),
        kubeconfig=tenant.kubeconfig,
    )
    try:
        return await b.status(job)
    finally:
        await b.close()


def teardown_module() -> None:
    print(f"\nkueue real-node timings: { {k: round(v, 1) for k, v in TIMES.items()} }")
