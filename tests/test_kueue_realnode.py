"""Kueue on the one-machine cluster's real node, CPU as the contended resource: `%%tfdist run` jobs of two
users in real containers, admitted by Kueue as one unit (docs/queueing.md; the kwok plane's GPU version is
tests/test_kueue_plane.py).

Kueue's manager runs as a host process against the node's API server for this module and
test_kueue_realnode_preempt.py only (`shared_kueue`: one start for both; its webhook configurations are
removed after them, so the other real-node tests pay nothing; `scripts/cluster up --kueue` starts the same
for people). One ClusterQueue of 1.5 CPU, made by tfdist.kube.queueing_apply from a profiles section; two
users whose namespaces the spawner's own code prepares, each with the queue's LocalQueue. A job is
coordinator + 1 worker + 1 PS at 0.45 CPU each (1.35 CPU): one fits the queue, two do not (2.7 CPU; the
2-core node alone would have let a part of the second start, the partial start issue 25 found). Each host
kernel acts as its user's notebook.
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

from tests import groupend, realnode
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
from tfdist.kube import names as kn

if "tests.realnode_fixtures" not in sys.modules:
    from tests.realnode_fixtures import job_image, real_cluster  # noqa: F401

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]

QUEUE = "rn-team"
QUEUE_CPU = 1.5


def cpu_profile(slug: str, queue: str) -> dict[str, Any]:
    """A CPU-only profile of group "ml" whose servers' jobs go to `queue`."""
    return {
        "slug": slug,
        "display_name": f"CPU ({queue})",
        "groups": ["ml"],
        "cpu": {"min": 0.5, "max": 2, "default": 1},
        "memory_gib": {"min": 1, "max": 4, "default": 1},
        "kueue_queue": queue,
        "images": ["img"],
    }


PROFILES = {
    "kueue": {"cohort": "rn-pool", "queues": {QUEUE: {"cpu": QUEUE_CPU}}},
    "profiles": [cpu_profile("cpu", QUEUE)],
}
# a job of 3 pods at 0.45 CPU: 1.35 of the queue's 1.5. Paced data (tests.kernels.paced): the fit lasts
# >= 10 s on any CPU, so the first job still trains while the second is watched waiting
CELL = (
    "%%tfdist run --workers {workers} --ps 1 --name {name} --cpu 0.45 --memory 1536Mi\n"
    "history = model.fit(paced_ds, epochs=2, steps_per_epoch=10)\n"
)
TIMES: dict[str, float] = {}
WL = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/{job}"
WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/workloads"  # every namespace's, in one answer


def cell(name: str, workers: int = 1) -> str:
    return CELL.format(name=name, workers=workers)


async def admin_api(state: dict):
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=state["kubeconfig"], client_configuration=cfg)
    return client.ApiClient(cfg)


KUEUE_MODULES = ("test_kueue_realnode", "test_kueue_realnode_preempt")
_kueue: list = []  # the Kueue this process started for the modules above, while their tests run


def shared_kueue(state: dict):
    """One Kueue manager for the Kueue modules (adjacent in the real-node group): started by the first,
    stopped with its webhooks after the last test of theirs, its module's queue objects already gone."""
    if not _kueue:
        own, TIMES["kueue_start_s"] = realnode.start_kueue(state)
        _kueue.append(own)

        def stop() -> None:
            realnode.stop_kueue(state, _kueue.pop())

        groupend.while_next(lambda item: item.path.stem in KUEUE_MODULES, stop)
    return _kueue[0]


@contextlib.contextmanager
def queues_converged(real_cluster, profiles: dict):
    """Kueue on the real node (reused where `scripts/cluster up --kueue` runs one) with the queues of
    `profiles`; afterwards those queue objects, and Kueue with its webhooks if started here, go."""
    from tfdist.kube import queueing as q
    from tfdist.kube import queueing_apply as qa
    from tfdist.spawner.profiles import parse_profiles

    state = real_cluster.state
    cfg = parse_profiles(profiles)
    if not realnode.kueue_running(state):
        shared_kueue(state)

    async def converge() -> None:
        async with await admin_api(state) as api:
            await qa.converge(api, cfg)

    try:
        asyncio.run(converge())
        yield cfg
    finally:
        # the queues, cohort, flavors and priority classes, gone while Kueue still runs (it holds a
        # finalizer on each ClusterQueue and flavor in use: a stopped Kueue would leave them terminating)
        queue_objects = [
            f"/apis/kueue.x-k8s.io/v1beta2/{o['kind'].lower()}s/{o['metadata']['name']}"
            for o in reversed(q.cluster_objects(cfg))
        ]
        queue_objects = [p.replace("classs/", "classes/") for p in queue_objects]
        with contextlib.suppress(OSError):  # the cluster went down: nothing is left to remove
            for path in queue_objects:
                with contextlib.suppress(urllib.error.HTTPError):
                    real_cluster.request("DELETE", path)
            wait_for(
                "the module's queue objects gone",
                lambda: all(real_cluster.get(p) is None for p in queue_objects),
                60,
            )


@pytest.fixture(scope="module")
def kueue_rn(real_cluster):
    with queues_converged(real_cluster, PROFILES) as cfg:
        yield cfg


@dataclass
class User:
    tenant: Tenant
    kernel: WatchedKernel
    state_dir: str = ""  # the kernel's (tests.realnode_jobs.digits_kernel)


@contextlib.contextmanager
def two_users(real_cluster, cfg, job_image, workdir, queues: tuple[str, str], pace_s: float = 0.5):
    """Two users' namespaces as the spawner prepares them (tenancy, then their LocalQueue and queue Role),
    each with its queue, a stand-in notebook pod each, and a host kernel each with the example's model and
    (paced) data. The namespaces go before Kueue does (its finalizers on the job pods need it running)."""
    from tfdist.kube.apply import prepare_user_queues
    from tfdist.kube.tenancy import TenantPolicy

    tenants: list[Tenant] = []
    out: list[User] = []
    try:
        for prefix, queue in zip(("kqa", "kqb"), queues, strict=True):
            t = make_tenant(real_cluster, prefix, workdir, queue=queue)
            tenants.append(t)

            async def prepare(t: Tenant = t, queue: str = queue) -> None:
                async with await admin_api(real_cluster.state) as api:
                    await prepare_user_queues(
                        api, cfg, TenantPolicy(user=t.user, namespace=t.namespace, queue=queue), ["ml"]
                    )

            asyncio.run(prepare())
            start_notebook_pod(real_cluster, t)
        # the two kernels import TensorFlow side by side
        made: dict[int, Any] = {}

        def start(i: int) -> None:
            try:
                made[i] = digits_kernel(tenants[i], job_image, workdir, TFDIST_KUEUE_QUEUE=queues[i])
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
            out.append(User(tenants[i], made[i], str(workdir / "state")))
            r = made[i].run(f"{PACE_IMPORT}paced_ds = {paced('train_ds', pace_s)}")
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


@pytest.fixture(scope="module")
def users(real_cluster, kueue_rn, job_image, tmp_path_factory):
    with two_users(
        real_cluster, kueue_rn, job_image, tmp_path_factory.mktemp("kueue-rn"), (QUEUE, QUEUE)
    ) as u:
        yield u


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
                if self.workloads:
                    # every job's Workload from one list: one revision of the store. Read one by one, a
                    # sample could hold the first job's Workload from before it finished and the second's
                    # from after it was admitted (CI on f18cf32: "both jobs hold the quota"), a moment
                    # that never was
                    listed = self.cluster.get(WORKLOADS) or {}
                    items = listed.get("items", [])
                    by_key = {(w["metadata"]["namespace"], w["metadata"]["name"]): w for w in items}
                    for key in self.jobs:
                        wl = by_key.get(key, {})
                        s.workload[key] = (ql.is_admitted(wl), ql.is_finished(wl))
                for ns, job in self.jobs:
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


def test_two_users_jobs_submitted_together_run_whole_one_after_the_other(real_cluster, users):
    """Ann and Bob submit at once (each job alone fits the queue, both do not). Kueue admits one; the other
    is queued whole (its cell and `status()` say 1st in the queue) with all its pods gated and none bound
    while any pod of the first is not over; at no sample do both hold the queue's quota, and no pod is
    bound without its job admitted. The second trains to the end once the first has ended: no deadlock.

    Meanwhile, what only real pods do: one worker of the admitted job is deleted while it trains. It ends
    for real (Kueue's finalizer holds it until it has) and the Job controller's replacement joins the
    admitted group (no gate, bound, running, the Workload still admitted and not finished), the fit ends
    trained, and the waiting job does not slip into the quota the deleted pod had. (The kwok plane's
    tests/test_kueue_plane.py runs the same queueing with GPUs and many more orders.)"""
    from tfdist.kube import queueline as ql

    ann, bob = users
    jobs = {id(ann): f"qa{uuid.uuid4().hex[:4]}", id(bob): f"qb{uuid.uuid4().hex[:4]}"}
    key = {id(u): (u.tenant.namespace, jobs[id(u)]) for u in users}
    sampler = PodSampler(real_cluster, list(key.values()), workloads=True)
    try:
        t0 = time.monotonic()
        marks = {id(u): u.kernel.mark() for u in users}
        # both long enough (5 paced epochs, >= 25 s) that the worker deletion below happens mid-fit,
        # whichever job Kueue admits first (the fit waits while its one worker is gone: it cannot run out
        # before the replacement joins)
        cells = {id(u): u.kernel.submit(cell(jobs[id(u)]).replace("epochs=2", "epochs=5")) for u in users}

        def admitted_first() -> User | None:
            for u in users:
                if u.kernel.idle_after(cells[id(u)]):
                    raise AssertionError(
                        f"a cell ended before either job ran: {cell_error(u.kernel, cells[id(u)])}"
                    )
                if ql.is_admitted(real_cluster.get(WL.format(ns=key[id(u)][0], job=key[id(u)][1])) or {}):
                    return u
            return None

        first = wait_for("one job admitted", admitted_first, 300)
        second = bob if first is ann else ann
        f_ns, f_job = key[id(first)]
        s_ns, s_job = key[id(second)]
        f_cell, s_cell = cells[id(first)], cells[id(second)]

        def second_shown_queued() -> bool:
            if first.kernel.idle_after(f_cell):
                raise AssertionError(
                    f"the admitted job's cell ended early: {cell_error(first.kernel, f_cell)}"
                )
            if second.kernel.idle_after(s_cell):
                raise AssertionError(
                    f"the second cell ended while it should wait: {cell_error(second.kernel, s_cell)}"
                )
            return any(f"queued: 1st in {QUEUE}" in t for t in second.kernel.widget_texts(marks[id(second)]))

        try:
            wait_for("the second cell showing its place in line", second_shown_queued, 120)
        except AssertionError as exc:
            shown = second.kernel.widget_texts(marks[id(second)])[-3:]
            raise AssertionError(f"{exc}; the second cell showed {shown}") from None
        # the typed record the panel and `%tfdist list` read (another backend of that user, its own query)
        view = asyncio.run(status_of(second.tenant, s_job))
        assert view.queue is not None and (view.queue.position, view.queue.queue) == (1, QUEUE), view
        assert view.state_word == "queued"

        # one worker of the admitted job deleted while it trains (the other still waiting)
        wait_first_epoch(real_cluster, first.kernel, f_cell, marks[id(first)], f_ns, f_job, timeout=300)
        TIMES["first_job_first_epoch_s"] = time.monotonic() - t0
        assert not first.kernel.idle_after(f_cell), "the first job ended before the deletion"
        (victim,) = [p for p in job_pods(real_cluster, f_ns, f_job, "worker") if running([p])]
        real_cluster.request("DELETE", f"/api/v1/namespaces/{f_ns}/pods/{victim['metadata']['name']}")
        t_del = time.monotonic()

        def replacement() -> list[dict]:
            if first.kernel.idle_after(f_cell):
                raise AssertionError(
                    f"the fit ended before the replacement ran: {cell_error(first.kernel, f_cell)}"
                )
            pods = job_pods(real_cluster, f_ns, f_job, "worker")
            return [p for p in running(pods) if p["metadata"]["uid"] != victim["metadata"]["uid"]]

        (new,) = wait_for("the replacement worker running", replacement, 180)
        TIMES["replacement_running_s"] = time.monotonic() - t_del
        assert new["spec"].get("nodeName") and not new["spec"].get("schedulingGates")
        wl = real_cluster.get(WL.format(ns=f_ns, job=f_job)) or {}
        assert ql.is_admitted(wl) and not ql.is_finished(wl), wl.get("status")

        rf = first.kernel.wait(f_cell, timeout=600)
        assert rf.error is None, f"{rf.error_text}\n{job_state(real_cluster, f_ns, f_job)}"
        epochs = first.kernel.run("print(len(history.history['loss']))")
        assert epochs.text.strip() == "5", epochs.text
        wait_for("the first job's pods ended", lambda: not live(mf_pods(real_cluster, f_ns, f_job)), 120)
        t_f_end = time.monotonic()
        wait_for(
            "the second job's 3 pods bound",
            lambda: len(bound(mf_pods(real_cluster, s_ns, s_job))) == 3 or second.kernel.idle_after(s_cell),
            180,
        )
        TIMES["second_bound_after_first_ended_s"] = time.monotonic() - t_f_end
        rs = second.kernel.wait(s_cell, timeout=600)
        assert rs.error is None, f"{rs.error_text}\n{job_state(real_cluster, s_ns, s_job)}"
        epochs = second.kernel.run("print(len(history.history['loss']))")
        assert epochs.text.strip() == "5", epochs.text
        TIMES["both_jobs_s"] = time.monotonic() - t0
    finally:
        samples = sampler.stop()
    assert len(samples) > 20
    for s in samples:
        holding = [k for k, (adm, fin) in s.workload.items() if adm and not fin]
        assert len(holding) < 2, "both jobs hold the quota of a queue that holds one"
        for k, pods in s.pods.items():
            assert not bound(pods) or s.workload.get(k, (False, False))[0], (
                f"{k}: a pod bound, its job not admitted"
            )
    # while any of the first job's pods was not over (the deleted worker's end included), none of the
    # second's had a node
    overlap = [s for s in samples if live(s.pods.get((f_ns, f_job), []))]
    assert len([s for s in overlap if s.pods.get((s_ns, s_job))]) >= 4, (
        "the second job's pods were never seen waiting"
    )
    for s in overlap:
        assert not bound(s.pods.get((s_ns, s_job), [])), (
            s.pods,
            "a pod of the second job bound while the first ran",
        )
    # the second job waited whole: it had all 3 pods (gated) before any was bound
    first_bound = next(s for s in samples if bound(s.pods.get((s_ns, s_job), [])))
    assert any(len(s.pods.get((s_ns, s_job), [])) == 3 for s in samples if s.t < first_bound.t)


# ------------------------------------------------------------------------------------------ helpers


def mf_pods(cluster: Any, ns: str, job: str) -> list[tuple[str, str, str, bool]]:
    listed = cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3D{job}") or {}
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
