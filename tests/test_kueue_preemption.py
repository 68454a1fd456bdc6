"""Kueue giving a queue its lent GPUs back (tfdist.kube.preemption) on the kwok plane: real API server,
scheduler, Kueue's manager and webhooks, one 8-GPU H100 node. Two queues of 4 H100s in one cohort, ``qa``
(user ann) and ``qb`` (user bob); jobs are submitted by the real Kubernetes backend.

Pure checks of the policy and of reading an eviction come first (no plane)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest

from tests import kube_plane
from tests.kueue_fixtures import kueue_bin_dir
from tests.test_checkpoint_handover import write_checkpoint
from tests.test_kueue_plane import api_client, bound, spec, until
from tfdist.backends.base import Launch
from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.job.checkpoint import Resume
from tfdist.job.vocab import JobState, Reason
from tfdist.jobview import JobView
from tfdist.kube import checkpoints
from tfdist.kube import names as kn
from tfdist.kube import preemption as pre
from tfdist.kube import queueing as q
from tfdist.kube import queueing_apply as qa
from tfdist.kube.podfold import PodFold
from tfdist.runtime import ckptbundle
from tfdist.settings import from_environ
from tfdist.spawner.profiles import parse_profiles

H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
ANN, BOB = "kp-ann", "kp-bob"
QA, QB = "qa", "qb"
KUEUE_API = "/apis/kueue.x-k8s.io/v1beta2"
TIMES: dict[str, float] = {}


def _profile(slug: str, queue: str) -> dict:
    return {
        "slug": slug,
        "display_name": slug,
        "groups": [slug],
        "cpu": {"min": 1, "max": 8, "default": 1},
        "memory_gib": {"min": 1, "max": 8, "default": 1},
        "gpus": {"max": 8},
        "gpu_models": ["h100"],
        "kueue_queue": queue,
        "images": ["img"],
    }


PROFILES = {
    "gpu_models": {"h100": {"display_name": "H100", "node_selector": H100}},
    "kueue": {"cohort": "lend", "queues": {QA: {"gpus": {"h100": 4}}, QB: {"gpus": {"h100": 4}}}},
    "profiles": [_profile("a", QA), _profile("b", QB)],
}
KUEUE_MESSAGE = (
    "Preempted to accommodate a workload (UID: 1f, JobUID: UNKNOWN) due to reclamation within the "
    "cohort; preemptor path: /lend/qb; preemptee path: /lend/qa"
)


# --------------------------------------------------------------------------------- pure, no plane


def test_every_queue_reclaims_what_it_lent_and_never_evicts_inside_itself():
    cqs = q.cluster_queues(parse_profiles(PROFILES))
    assert [c["spec"]["preemption"] for c in cqs] == [pre.policy()] * 2
    assert pre.policy() == {
        "reclaimWithinCohort": "Any",
        "withinClusterQueue": "Never",
        "borrowWithinCohort": {"policy": "Never"},
    }
    (pc,) = pre.priority_classes()
    assert pc["kind"] == "WorkloadPriorityClass" and pc["value"] > 0  # jobs have none: 0
    assert pre.notebook_labels() == {"kueue.x-k8s.io/priority-class": pc["metadata"]["name"]}


def _pod(conditions: list[dict], phase: str = "Running") -> dict:
    return {"metadata": {"name": "j-worker-0"}, "status": {"phase": phase, "conditions": conditions}}


def test_an_eviction_is_read_from_kueues_pod_condition_and_nothing_else():
    # a pod group's reason (Kueue's ComposableJob stop), and a single pod's
    cond = {"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvictedDueToPreempted"}
    got = pre.eviction(_pod([cond | {"message": KUEUE_MESSAGE}]))
    assert got == pre.Preemption(reclaimed_by=QB, message=KUEUE_MESSAGE)
    single = cond | {"reason": "WorkloadEvicted", "message": KUEUE_MESSAGE}
    assert pre.eviction(_pod([single])) == got
    assert got.sentence() == "preempted by Kueue to give queue qb its quota back"
    # the Workload deleted (the job stopped), a pod not stopped by Kueue, an unknown preemptor
    deleted = cond | {"reason": "WorkloadDeleted", "message": "Workload is deleted"}
    assert pre.eviction(_pod([deleted])) is None
    assert pre.eviction(_pod([{"type": "Ready", "status": "True"}])) is None
    assert pre.eviction({"metadata": {}}) is None
    unknown = KUEUE_MESSAGE.replace("/lend/qb", "UNKNOWN")
    assert pre.eviction(_pod([cond | {"message": unknown}])).reclaimed_by == ""


def test_a_preempted_job_is_said_so_not_a_failed_coordinator():
    """The fold's verdict for a job whose pods Kueue stopped: the job protocol's PREEMPTED reason and
    Kueue's sentence, not "the coordinator failed"."""
    cond = {
        "type": "TerminationTarget",
        "status": "True",
        "reason": "WorkloadEvictedDueToPreempted",
        "message": KUEUE_MESSAGE,
    }
    fold = PodFold(expected=2)
    labels = {kn.L_JOB: "j", kn.L_TASK: "chief-0"}
    chief = {"metadata": {"name": "j-abc", "labels": labels}, "status": {"phase": "Running"}}
    fold.listed([chief])
    assert fold.verdict() is None
    failed = {**chief, "status": {"phase": "Failed", "conditions": [cond]}}
    fold.changed("MODIFIED", failed)
    v = fold.verdict()
    assert v is not None and v.state == JobState.FAILED
    assert v.error is not None and v.error.reason == Reason.PREEMPTED.value
    assert "to give queue qb its quota back" in v.message
    # a coordinator that exited 0 on the eviction's SIGTERM did not finish: still preempted
    fold = PodFold(expected=2)
    fold.listed([chief])
    fold.changed("MODIFIED", {**chief, "status": {"phase": "Succeeded", "conditions": [cond]}})
    assert (fold.verdict() or v).error.reason == Reason.PREEMPTED.value
    # one that finished before a worker was evicted did
    fold = PodFold(expected=2)
    worker = {"metadata": {"name": "j-w", "labels": {kn.L_JOB: "j", kn.L_TASK: "worker-0"}}}
    fold.listed([chief, {**worker, "status": {"phase": "Failed", "conditions": [cond]}}])
    fold.changed("MODIFIED", {**chief, "status": {"phase": "Succeeded"}})
    assert fold.verdict().state == JobState.SUCCEEDED


def test_the_verdict_comes_once_the_evicted_coordinator_is_gone_not_when_every_pod_is():
    """What the real node showed (stop 36): Kueue evicts the group; the chief's pod is deleted; the evicted
    run's PS and worker Jobs replace their failed pods (the Job controller's backoff, ~9 s later) until the
    root's TTL takes them. The verdict is due once the coordinator's pod stops, not once every pod is gone."""
    cond = {
        "type": "TerminationTarget",
        "status": "True",
        "reason": "WorkloadEvictedDueToPreempted",
        "message": KUEUE_MESSAGE,
    }

    def pod(task: str, name: str, phase: str, conditions: list | None = None, deleting: bool = False) -> dict:
        md = {"name": name, "labels": {kn.L_JOB: "j", kn.L_TASK: task}}
        if deleting:
            md["deletionTimestamp"] = "2026-12-04T11:30:00Z"
        return {"metadata": md, "status": {"phase": phase, "conditions": conditions or []}}

    running = [
        pod("chief-0", "j-c", "Running"),
        pod("ps-0", "j-ps-0-a", "Running"),
        pod("worker-0", "j-w-a", "Running"),
    ]
    fold = PodFold(expected=3)
    fold.listed(running)
    fold.changed("MODIFIED", pod("chief-0", "j-c", "Running", [cond]))
    assert fold.verdict() is None  # marked, its coordinator still running
    for task, name in (("ps-0", "j-ps-0-a"), ("chief-0", "j-c"), ("worker-0", "j-w-a")):
        fold.changed("MODIFIED", pod(task, name, "Running", [cond], deleting=True))
    v = fold.verdict()  # the coordinator's pod is being deleted: this run is over
    assert v is not None and v.error is not None and v.error.reason == Reason.PREEMPTED.value, v

    # the order the real node showed: the chief's pod gone, then the old Jobs' replacements; the code
    # before waited for every pod to go, which these replacements put off until the root's TTL
    fold = PodFold(expected=3)
    fold.listed(running)
    fold.changed("MODIFIED", pod("ps-0", "j-ps-0-a", "Failed", [cond]))
    fold.changed("MODIFIED", pod("worker-0", "j-w-a", "Failed", [cond]))
    fold.changed("DELETED", pod("chief-0", "j-c", "Failed", [cond], deleting=True))
    fold.changed("ADDED", pod("ps-0", "j-ps-0-b", "Pending"))
    fold.changed("ADDED", pod("worker-0", "j-w-b", "Pending"))
    v = fold.verdict()
    assert v is not None and v.error is not None and v.error.reason == Reason.PREEMPTED.value, v


def test_the_requeued_cell_says_where_it_waits_and_whether_it_starts_over():
    said = "preempted by Kueue to give queue qb its quota back"
    assert pre.requeued(said, QA, None) == (
        f"{said}; waiting in queue qa again, it starts from the beginning when admitted "
        "(without --checkpoint-every)"
    )
    assert pre.requeued(said, QA, 50).endswith("(no checkpoint had reached the notebook yet)")
    resume = Resume(epoch=2, step=90)
    assert pre.requeued(said, QA, 50, resume).endswith(
        "it resumes from epoch 3 (the checkpoint at step 90) when admitted"
    )


# --------------------------------------------------------------------------------- the kwok plane


@pytest.fixture(scope="module")
def kp():
    """A Kueue plane of this module's own, with its node, users and queues. It shared the one of
    tests/kueue_fixtures.py once: a resubmitted job then met its old worker Job, which the garbage collector
    removes after the root (the backend now waits for them to go: 549005c). Shared again on 2026-12-04,
    test_kueue_plane.py's gating test failed once when it came after this module and the visibility one
    (not yet understood; it passed in the other order), so this module keeps its own."""
    bin_dir = kueue_bin_dir()
    t0 = time.monotonic()
    plane = kube_plane.ControlPlane(bin_dir, kueue=True)
    try:
        plane.start()
        TIMES["plane_with_kueue_s"] = time.monotonic() - t0
        plane.add_gpu_nodes(1, 8, H100["nvidia.com/gpu.product"])
        for ns in (ANN, BOB):
            plane.create_namespace(ns)

        async def setup():
            async with await api_client(plane) as api:
                cfg = parse_profiles(PROFILES)
                await qa.converge(api, cfg)
                await qa.converge_user(api, cfg, ANN, ["a"])
                await qa.converge_user(api, cfg, BOB, ["b"])

        asyncio.run(setup())
        for pc in pre.priority_classes():  # the hub converged it beside the queues
            assert plane.get(f"{KUEUE_API}/workloadpriorityclasses/{pc['metadata']['name']}")
        yield plane
    finally:
        print(f"\npreemption plane timings: {TIMES}")
        plane.stop()


def backend(plane, ns: str, queue: str, state_dir: str = "") -> KubernetesBackend:
    b = KubernetesBackend(
        from_environ(
            {
                "TFDIST_NAMESPACE": ns,
                "TFDIST_WORKER_IMAGE": "example.org/tfdist-job:1",
                "USER": ns,
                "TFDIST_KUEUE_QUEUE": queue,
            }
            | ({"TFDIST_STATE_DIR": state_dir} if state_dir else {})
        ),
        kubeconfig=plane.kubeconfig,
    )
    b.node_selector = H100
    return b


def job_pods(plane, ns: str, job: str) -> list[dict]:
    return plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3D{job}")["items"]


def live(p: dict) -> bool:
    return not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") not in (
        "Failed",
        "Succeeded",
    )


def workload(plane, ns: str, name: str) -> dict | None:
    items = plane.get(f"{KUEUE_API}/namespaces/{ns}/workloads")["items"]
    return next((w for w in items if w["metadata"]["name"] == name), None)


def notebook(plane, ns: str, queue: str, gpus: int) -> str:
    """A GPU notebook server's pod as the spawner makes it for a queued profile: the queue label and the
    notebook priority class (tfdist.kube.preemption.notebook_labels)."""
    name = "jupyter-nb"
    plane.request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "metadata": {"name": name, "labels": {q.L_QUEUE: queue, **pre.notebook_labels()}},
            "spec": {
                "nodeSelector": H100,
                "containers": [
                    {
                        "name": "notebook",
                        "image": "example.org/notebook:1",
                        "resources": {
                            "requests": {"cpu": "100m", "nvidia.com/gpu": str(gpus)},
                            "limits": {"nvidia.com/gpu": str(gpus)},
                        },
                    }
                ],
            },
        },
    )
    return name


@pytest.mark.k8s
async def test_a_borrowing_job_is_evicted_whole_and_comes_back_when_the_lender_is_done(kp, tmp_path):
    """ann's job (2 x 4 GPUs, --checkpoint-every) borrows qb's 4 idle GPUs; bob's job (4 GPUs, qb's own
    quota) arrives: ann's job is evicted whole (no pod of it left bound), bob's is admitted, ann's cell
    says preempted and queued again with the checkpoint her kernel kept, and ann's job is readmitted whole
    (the same cell, submitted again, that checkpoint waiting to be handed to its coordinator) when bob's
    ends. Another server of ann's reads it as preempted, waiting to be readmitted, meanwhile."""
    a, b = backend(kp, ANN, QA, str(tmp_path)), backend(kp, BOB, QB)
    seen: list = []

    def states() -> list:
        return [e for e in seen if e.type == "state"]

    try:
        await a.submit(
            spec("big", ANN, workers=2, ps=1, gpus_per_worker=4, checkpoint_every=5), b"p", Launch()
        )
        await until("ann's job bound", lambda: sum(map(bound, job_pods(kp, ANN, "big"))) == 4, 90)
        first_run = {p["metadata"]["uid"] for p in job_pods(kp, ANN, "big")}
        first_workload = (workload(kp, ANN, "big") or {}).get("metadata", {}).get("uid")
        # what the kernel's keeper fetched from the coordinator's agent while it trained (kwok pods run
        # nothing: tests/test_pod_runtime_preempt_resume.py fetches a real one)
        kept = checkpoints.kept_path(str(tmp_path), ANN, "big", checkpoints.payload_digest(b"p"))
        write_checkpoint(tmp_path / "pod-ckpt", 40, epoch=2)
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        ckptbundle.pack(str(tmp_path / "pod-ckpt"), kept)

        async def follow():
            async for ev in a.watch("big"):
                seen.append(ev)

        watching = asyncio.ensure_future(follow())
        t0 = time.monotonic()
        await b.submit(spec("small", BOB, workers=1, ps=1, gpus_per_worker=4), b"p", Launch())
        await until("bob's job bound", lambda: sum(map(bound, job_pods(kp, BOB, "small"))) == 3, 90)
        TIMES["reclaimed_and_bound_s"] = time.monotonic() - t0
        # Kueue's own record: evicted by preemption, reclaimed within the cohort by qb. Read from its Event on
        # the evicted Workload, which outlives it: the kernel deletes the evicted root as soon as its
        # coordinator is gone and submits it again, so the Workload of that name may already be the new one
        events = f"/api/v1/namespaces/{ANN}/events?fieldSelector=involvedObject.kind%3DWorkload"
        (said,) = await until(
            "Kueue's Preempted event on ann's Workload",
            lambda: [
                e
                for e in kp.get(events)["items"]
                if e["involvedObject"]["name"] == "big" and e["reason"] == "Preempted"
            ],
            30,
        )
        assert said["involvedObject"]["uid"] == first_workload, (said["involvedObject"], first_workload)
        # its reason, InCohortReclamation, in Kueue's words
        assert "due to reclamation within the cohort" in said["message"], said["message"]
        assert "preemptor path: /lend/qb" in said["message"], said["message"]
        # the cell: preempted, not failed, and in line again
        await until("ann's cell told", lambda: [e for e in states() if "preempted" in (e.message or "")], 60)
        (told,) = [e for e in states() if "preempted" in (e.message or "")]
        assert told.state == JobState.PENDING, told
        assert told.message.startswith(
            "preempted by Kueue to give queue qb its quota back; waiting in queue qa"
        )
        assert told.message.endswith("it resumes from epoch 3 (the checkpoint at step 40) when admitted")
        assert told.reason == Reason.PREEMPTED
        # the new run's delivery holds the checkpoint for its coordinator (handed over before the payload)
        assert os.path.exists(checkpoints.resume_path(kept)) and not os.path.exists(kept)
        other = backend(kp, ANN, QA)  # another server of ann's: it reads the cluster
        try:
            await until(
                "the new root marked",
                lambda: (
                    pre.A_RESUBMITTED
                    in (
                        kp.get(f"/apis/batch/v1/namespaces/{ANN}/jobs/big")["metadata"].get("annotations")
                        or {}
                    )
                ),
                30,
            )
            elsewhere = await other.status("big")
            assert elsewhere.state_word == "preempted, waiting to be readmitted", elsewhere.summary()
            (row,) = [r for r in await other.list_jobs() if r.name == "big"]
            assert row.reason == Reason.PREEMPTED and row.state in (JobState.PENDING, JobState.STARTING)
        finally:
            await other.close()
        await until(
            "ann's place in line", lambda: [e for e in seen[seen.index(told) :] if e.type == "queue"], 60
        )
        # while bob's job runs: nothing of ann's job on the node, its new pods gated (one admission)
        for _ in range(10):
            pods = job_pods(kp, ANN, "big")
            assert not [p for p in pods if live(p) and bound(p)], [p["metadata"]["name"] for p in pods]
            await asyncio.sleep(0.3)
        assert not any(e.state.terminal for e in states())
        assert await b.stop("small")
        t1 = time.monotonic()
        await until(
            "ann's job readmitted whole",
            lambda: sum(bound(p) and live(p) for p in job_pods(kp, ANN, "big")) == 4,
            120,
        )
        TIMES["readmitted_after_lender_ended_s"] = time.monotonic() - t1
        again = {p["metadata"]["uid"] for p in job_pods(kp, ANN, "big") if live(p)}
        assert again and not again & first_run  # new pods: a new run of the same cell
        await until("ann's cell says running", lambda: states()[-1].state == JobState.RUNNING, 60)
        view = JobView.from_dict(seen[0].view)
        for ev in seen[1:]:
            view.apply(ev)
        assert view.state == JobState.RUNNING and view.queue is None and view.error is None
        assert view.state_word == "running" and view.reason == ""
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
    finally:
        with contextlib.suppress(Exception):
            await a.stop("big")
        with contextlib.suppress(Exception):
            await b.stop("small")
        await a.close()
        await b.close()
    await until("both jobs gone", lambda: not job_pods(kp, ANN, "big") and not job_pods(kp, BOB, "small"), 60)


@pytest.mark.k8s
async def test_a_notebook_admitted_while_its_queue_borrows_stays_its_job_goes(kp):
    """ann's job (4 GPUs, her own quota) then her notebook (4 more: qa now borrows qb's); bob's job of
    4 arrives: Kueue evicts ann's job, never the notebook, and bob's job runs."""
    a, b = backend(kp, ANN, QA), backend(kp, BOB, QB)
    nb = ""
    try:
        await a.submit(spec("mine", ANN, workers=1, ps=1, gpus_per_worker=4), b"p", Launch())
        await until("ann's job bound", lambda: sum(map(bound, job_pods(kp, ANN, "mine"))) == 3, 90)
        nb = notebook(kp, ANN, QA, 4)
        await until("ann's notebook bound", lambda: bound(kp.get(f"/api/v1/namespaces/{ANN}/pods/{nb}")), 60)
        uid = kp.get(f"/api/v1/namespaces/{ANN}/pods/{nb}")["metadata"]["uid"]
        await b.submit(spec("small", BOB, workers=1, ps=1, gpus_per_worker=4), b"p", Launch())
        await until("bob's job bound", lambda: sum(map(bound, job_pods(kp, BOB, "small"))) == 3, 90)
        await until(
            "ann's job evicted",
            lambda: not [p for p in job_pods(kp, ANN, "mine") if live(p) and bound(p)],
            60,
        )
        for _ in range(10):  # and it stays that way: the notebook is the same pod, bound, not told to go
            pod = kp.get(f"/api/v1/namespaces/{ANN}/pods/{nb}")
            assert pod["metadata"]["uid"] == uid and bound(pod) and live(pod), pod["status"]
            assert pre.eviction(pod) is None
            await asyncio.sleep(0.3)
    finally:
        with contextlib.suppress(Exception):
            await a.stop("mine")
        with contextlib.suppress(Exception):
            await b.stop("small")
        if nb:
            with contextlib.suppress(Exception):
                kp.request("DELETE", f"/api/v1/namespaces/{ANN}/pods/{nb}")
        await a.close()
        await b.close()


@pytest.mark.k8s
@pytest.mark.parametrize("stopper", ["the-cell", "the-lab-panel"])
async def test_a_job_stopped_while_it_waits_to_go_back_in_line_is_not_submitted_again(
    kp, monkeypatch, tmp_path, stopper
):
    """Preempted, its cell waits for the evicted run's objects to go before submitting it again; the user
    interrupts the cell (or presses Stop) meanwhile. It was submitted again all the same: a new job on GPUs,
    its lifeline renewed by the live kernel, its results never taken. The verdict stands in for Kueue's
    (test above); the wait is held open until the stop is in."""
    from tfdist.backends import kubewatch
    from tfdist.job.events import ErrorInfo, StateEvent

    a = backend(kp, ANN, QA, str(tmp_path))
    in_wait, go_on = asyncio.Event(), asyncio.Event()
    real = kubewatch.workload_of

    async def held(api, ns, name):
        in_wait.set()
        await go_on.wait()
        return await real(api, ns, name)

    try:
        await a.submit(spec("again", ANN, workers=1, ps=1, gpus_per_worker=1), b"p", Launch())
        # a checkpoint the kernel kept for it (model weights): handed back at the resubmit, or dropped
        kept = checkpoints.kept_path(str(tmp_path), ANN, "again", checkpoints.payload_digest(b"p"))
        write_checkpoint(tmp_path / "pod-ckpt", 40, epoch=2)
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        ckptbundle.pack(str(tmp_path / "pod-ckpt"), kept)
        monkeypatch.setattr(kubewatch, "workload_of", held)
        verdict = StateEvent(
            state=JobState.FAILED,
            message="preempted by Kueue",
            error=ErrorInfo(type="Preempted", message="preempted by Kueue", reason=Reason.PREEMPTED),
        )
        back = asyncio.ensure_future(a._resubmit("again", verdict))
        await asyncio.wait_for(in_wait.wait(), 60)
        if stopper == "the-cell":
            await a.stop("again", Reason.INTERRUPTED)  # the cell's interrupt, as kernel_magics sends it
        else:  # the server's other process, with its own backend (labserver): the same state directory
            panel = backend(kp, ANN, QA, str(tmp_path))
            try:
                await panel.stop("again")
            finally:
                await panel.close()
        go_on.set()
        said = await asyncio.wait_for(back, 120)
        assert said.state == JobState.STOPPED and "not submitted again" in said.message, said
        root = f"/apis/batch/v1/namespaces/{ANN}/jobs/again"
        await until(
            "the evicted run gone", lambda: kp.get(root) is None and not job_pods(kp, ANN, "again"), 60
        )
        await asyncio.sleep(3)  # and no new run appears
        assert kp.get(root) is None and not job_pods(kp, ANN, "again")
        left = [f for f in os.listdir(os.path.dirname(kept)) if ".ckpt" in f or f.endswith(".resume")]
        assert not left, "the stopped job's checkpoint stayed behind"
    finally:
        go_on.set()
        with contextlib.suppress(Exception):
            await a.stop("again")
        await a.close()
