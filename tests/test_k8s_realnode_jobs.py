"""`%%tfdist run` with the Kubernetes backend onto the one-machine cluster's real node: the example's PS,
workers and coordinator train in containers, the kernel gets its model back trained, NetworkPolicy keeps
other users out of a running job, and faults on real pods (a worker deleted, the cell interrupted, the
notebook pod deleted, the kernel SIGKILLed) end as the README says.

The kernel runs on the host and acts as the user's notebook (its service account's token, in a user
namespace prepared by the spawner's own code); a stand-in notebook pod owns its jobs. Each job is a real
TensorFlow job on two cores: the tests are few and each checks several things.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tests import realnode
from tests.kernels import PACE_IMPORT, paced
from tests.realnode_jobs import (
    GoneWatch,
    digits_kernel,
    epochs_shown,
    job_pods,
    notebook_cells,
    probe_from,
    restarts_shown,
    run_line,
    running,
    sampled_tasks,
    start_notebook_pod,
    wait_first_epoch,
    wait_for,
    wait_gone,
)
from tfdist.jobrecords import JobSummary
from tfdist.kube import names as kn

if "tests.realnode_fixtures" not in sys.modules:
    from tests.realnode_fixtures import real_cluster  # noqa: F401

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]


def all_running(cluster, ns: str, job: str, n: int = 4, k=None, cell: str = ""):
    """The job's pods once all `n` run; with a kernel and its cell, fail at once if the cell ended first."""
    if k is not None and k.idle_after(cell):
        r = k.wait(cell, timeout=5)
        raise AssertionError(f"the cell ended before its pods ran: {r.error_text or r.text}")
    pods = running(job_pods(cluster, ns, job))
    return pods if len(pods) == n else None


def sampled_row(tenant, tmp_path) -> JobSummary | None:
    """`list_jobs()` of a second backend of the same server (same user, namespace and state directory, as
    the server extension makes it): the running job's row once it carries its pods' CPU samples."""
    import asyncio

    from tfdist.backends.kubernetes import KubernetesBackend
    from tfdist.settings import from_environ

    async def rows() -> list[JobSummary]:
        b = KubernetesBackend(
            from_environ(
                {
                    "TFDIST_NAMESPACE": tenant.namespace,
                    "TFDIST_USER": tenant.user,
                    "TFDIST_STATE_DIR": str(tmp_path / "state"),
                }
            ),
            kubeconfig=tenant.kubeconfig,
        )
        try:
            return await b.list_jobs()
        finally:
            await b.close()

    row = next((r for r in asyncio.run(rows()) if r.name == "digits"), None)
    return row if row and row.state == "running" and row.cpu_total > 0 else None


def by_role(pods: list[dict], role: str) -> dict:
    return next(p for p in pods if p["metadata"]["labels"][kn.L_ROLE] == role)


@pytest.mark.timeout(1800)
def test_digits_trains_in_real_pods_behind_an_enforced_policy_survives_faults_and_leaves_nothing(
    real_cluster, job_image, tenants, tmp_path
):
    """One kernel, three jobs (each a real TensorFlow job on two cores, so they are few and each checks much).
    1. The example trains in real containers behind an enforced NetworkPolicy, its samples reach the server's
       other processes, a worker pod deleted mid-fit is replaced and the fit completes, the model comes back
       trained and the finished job leaves nothing.
    2. The cell interrupted: the pods are gone within 15 s.
    3. The notebook pod deleted: the garbage collector takes every object of its job."""
    ann, bob = tenants("ann"), tenants("bob")
    ns = ann.namespace
    start_notebook_pod(real_cluster, ann)
    start_notebook_pod(real_cluster, bob, forged=ann.user)  # bob's pod claims to be ann's notebook
    k = digits_kernel(ann, job_image, tmp_path)
    try:
        # 1. 12 epochs, not the example's 8, over paced data (tests.kernels.paced: >= 24 s on any CPU): the
        # fit must outlast the probes and a worker's replacement (~10 s after the deletion), so the
        # coordinator takes the replaced worker back, as on a slow day
        r = k.run(f"{PACE_IMPORT}paced_ds = {paced('train_ds')}")
        assert r.error is None, r.error_text
        since = k.mark()
        cell = k.submit(
            run_line("digits").replace("epochs=8", "epochs=12").replace("fit(train_ds", "fit(paced_ds")
        )
        pods = wait_for(
            "the job's 4 pods running", lambda: all_running(real_cluster, ns, "digits", k=k, cell=cell), 300
        )
        for p in pods:  # real containers on the real node, from the job image
            assert p["spec"]["nodeName"] == realnode.NODE_NAME
            (cs,) = p["status"]["containerStatuses"]
            assert cs["containerID"].startswith("containerd://") and cs["image"].endswith(
                job_image.split("/")[-1]
            )
        chief, worker = by_role(pods, "chief"), by_role(pods, "worker")
        ips = (worker["status"]["podIP"], chief["status"]["podIP"], kn.TF_PORT, kn.AGENT_PORT)

        def owner_reaches_agent():
            # the control for every "BLOCKED" below: the job's own coordinator reaches worker-0's TF port
            # (which listens only once TensorFlow is imported there; a refused connect reads BLOCKED too)
            if probe_from(ns, chief["metadata"]["name"], *ips)["TF"] != "CONNECTED":
                return None
            got = probe_from(ns, ann.notebook_pod, *ips)
            # both of one probe: its TCP connect may come a moment before the agent listens (or before
            # the node's policy rules for the new pod are in), its health check after (CI on d243b60)
            return got if got["HEALTHZ"].startswith("200") and got["AGENT"] == "CONNECTED" else None

        # the owner's notebook pod: the agent answers (it listens before the payload comes); the TF port
        # is for the job's own pods only
        mine = wait_for("worker-0's TF port and the agent listening", owner_reaches_agent, 180, every=1)
        assert mine["TF"] == "BLOCKED", mine
        # another user's pod, even labelled as the owner's notebook: nothing gets through
        theirs = probe_from(bob.namespace, bob.notebook_pod, *ips)
        assert theirs["TF"] == "BLOCKED" and theirs["AGENT"] == "BLOCKED", theirs
        assert theirs["HEALTHZ"].startswith("FAILED"), theirs
        # this server's other processes (the lab panel; the hub's culler and admin page through the server
        # extension) see the job's pods' samples too: the kernel that follows the job leaves them
        row = wait_for(
            "the job's samples seen by another process of the server", lambda: sampled_row(ann, tmp_path), 90
        )
        print(f"\nanother process of the server sees the job: {row}")
        assert not k.idle_after(cell), "the job ended before the probes: they proved nothing"

        # a worker pod deleted mid-fit: the Job controller replaces it, TF re-sends its work
        wait_first_epoch(real_cluster, k, cell, since, ns, "digits")
        (victim,) = [
            p
            for p in job_pods(real_cluster, ns, "digits", "worker")
            if p["metadata"]["labels"][kn.L_INDEX] == "0"
        ]
        real_cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim['metadata']['name']}")
        t0 = time.monotonic()

        def replacement(live: bool = False) -> list[dict]:
            pods = job_pods(real_cluster, ns, "digits", "worker")
            return [
                p
                for p in (running(pods) if live else pods)
                if p["metadata"]["labels"][kn.L_INDEX] == "0"
                and p["metadata"]["uid"] != victim["metadata"]["uid"]
            ]

        assert not k.idle_after(cell) and epochs_shown(k.widget_texts(since)) < 12, "deleted after the fit"
        # The Job controller replaces it after its first-failure backoff (about 10 s; also tested on kwok
        # nodes with the same manifests), while the paced fit still runs: the coordinator takes it back
        ran = wait_for(
            "the replacement running or the fit over",
            lambda: replacement(live=True) or k.idle_after(cell),
            300,
        )
        assert ran is not True, (
            "the fit ended before worker-0's replacement ran: the Job controller took over "
            f"{time.monotonic() - t0:.0f} s; the cell said: {k.wait(cell, timeout=60).error_text[-2000:]}"
        )
        print(f"\nworker pod deleted -> replacement running {time.monotonic() - t0:.1f}s after")
        r = k.wait(cell, timeout=900)
        assert r.error is None, r.error_text
        r = k.run("print('epochs', len(history.history['loss']), 'final', history.history['loss'][-1])")
        assert "epochs 12 " in r.text, r.text
        # the monitor's task table counted the replacement (the watch's "restarting", as on kwok)
        assert max(restarts_shown(k.widget_texts(since), "worker-0")) >= 1, k.widget_texts(since)[-3:]
        # the monitor showed each server pod's own CPU and memory, sampled inside the pod
        shown = sampled_tasks(k.widget_texts(since))
        for task in ("ps-0", "worker-0", "worker-1"):
            assert task in shown and shown[task][1] > 100, (task, shown)
        assert any(cpu > 0 for cpu, _ in shown.values()), shown
        # the notebook's own model came back trained
        r = k.run(notebook_cells()[3], timeout=120)
        assert r.error is None, r.error_text
        assert "weights changed: True" in r.text, r.text
        acc = float(r.text.split("->")[1].split(";")[0])
        assert acc > 0.85, r.text
        # the finished job cleans up after itself (TTL, then the garbage collector), watched while the
        # next job runs (checked before the notebook pod's deletion below could take it away instead)
        digits_gone = GoneWatch(real_cluster, ns, "digits", 90)

        # 2. the cell interrupted: every pod of the job gone within 15 s
        cell = k.submit(run_line("stopme").replace("epochs=8", "epochs=200"))
        wait_for("pods running", lambda: all_running(real_cluster, ns, "stopme", k=k, cell=cell), 300)
        t0 = time.monotonic()
        k.km.interrupt_kernel()
        wait_for("the interrupted job's pods gone", lambda: not job_pods(real_cluster, ns, "stopme"), 15)
        print(f"\ninterrupt -> pods gone: {time.monotonic() - t0:.1f}s")
        r = k.wait(cell, timeout=120)
        print(f"interrupt -> the cell ended: {time.monotonic() - t0:.1f}s")
        assert r.error and "tfdist job stopme interrupted; all its processes were ended" in r.error_text, (
            r.error_text
        )
        wait_gone(real_cluster, ns, "stopme", 30)
        print(f"\nfinished -> nothing of the job left: {digits_gone.check():.1f}s")

        # 3. the notebook pod deleted: its jobs go with it (owner references, garbage collector)
        cell = k.submit(run_line("owned").replace("epochs=8", "epochs=200"))
        wait_for("pods running", lambda: all_running(real_cluster, ns, "owned", k=k, cell=cell), 300)
        root = real_cluster.get(f"/apis/batch/v1/namespaces/{ns}/jobs/owned")
        assert root["metadata"]["ownerReferences"][0]["uid"] == ann.notebook_uid
        t0 = time.monotonic()
        real_cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{ann.notebook_pod}")
        took = wait_gone(real_cluster, ns, "owned", 60)
        print(f"\nnotebook pod deleted -> every object of its job gone: {took:.1f}s")
        r = k.wait(cell, timeout=60)  # the cell sees its job gone and ends, without waiting on the agent
        print(f"notebook pod deleted -> the cell ended: {time.monotonic() - t0:.1f}s;", r.error_text[:300])
        assert r.error is not None and "the job was deleted in the cluster" in r.error_text, r.error_text
    finally:
        k.shutdown()


@pytest.mark.timeout(1200)
def test_a_sigkilled_kernels_job_is_gone_within_90s(real_cluster, job_image, tenants, tmp_path):
    ann = tenants("dee")
    ns = ann.namespace
    # the notebook pod owns the job, as in a real server, and stays up: only the lifeline can end the job
    start_notebook_pod(real_cluster, ann)
    # the admin's shortest grace (the spawner's lifeline_grace_seconds): the cluster, not the kernel, ends it
    k = digits_kernel(ann, job_image, tmp_path, TFDIST_LIFELINE_GRACE_S="15")
    try:
        since = k.mark()
        cell = k.submit(run_line("orphan").replace("epochs=8", "epochs=200"))
        wait_first_epoch(real_cluster, k, cell, since, ns, "orphan")
        os.kill(k.pid, signal.SIGKILL)
        took = wait_gone(real_cluster, ns, "orphan", 90)
        print(f"\nkernel SIGKILLed mid-fit -> every object of its job gone: {took:.1f}s")
    finally:
        k.shutdown()
