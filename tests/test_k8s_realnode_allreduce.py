"""`%%tfdist run --strategy allreduce` with the Kubernetes backend onto the one-machine cluster's real node:
the example's digits model trains under MultiWorkerMirroredStrategy in two real pods (chief-0 = replica 0
with the agent, worker-0 = replica 1 fetching the cell from the agent), the kernel gets the trained model
back, another user's pod cannot reach the job, and nothing of the job is left afterwards.

Same set-up as test_k8s_realnode_jobs.py: a host kernel plays the user's notebook (the notebook service
account's token, a namespace prepared by the spawner's code, a stand-in notebook pod owning the job).
"""

from __future__ import annotations

import time

import pytest

from tests import realnode
from tests.realnode_jobs import (
    GoneWatch,
    digits_kernel,
    job_pods,
    notebook_cells,
    probe_from,
    run_line,
    running,
    sampled_tasks,
    start_notebook_pod,
    wait_first_epoch,
    wait_for,
    wait_gone,
)
from tfdist.kube import names as kn

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]


def allreduce_line(name: str) -> str:
    """The example's run cell as an all-reduce job of two replicas (no --ps)."""
    line = run_line(name)
    first, _, body = line.partition("\n")
    assert "--ps 1" in first, first
    return first.replace("--ps 1", "--strategy allreduce") + "\n" + body


@pytest.mark.timeout(1800)
def test_allreduce_trains_in_real_pods_behind_the_policy_and_faults_end_as_said(
    real_cluster, job_image, tenants, tmp_path
):
    """One kernel, three jobs (each a real TensorFlow job on two cores, so they are few and each checks much):
    1. the example trains with all-reduce in two real pods, another user's pod cannot reach them, the model
       comes back trained and nothing of the job is left;
    2. a worker pod deleted mid-fit ends the job naming that worker (MWMS cannot take it back; the Job
       controller does not replace it) and nothing of it is left;
    3. an interrupted cell leaves no pod within 15 s."""
    ann, bob = tenants("arann"), tenants("arbob")
    ns = ann.namespace
    start_notebook_pod(real_cluster, ann)
    start_notebook_pod(real_cluster, bob, forged=ann.user)  # bob's pod claims to be ann's notebook
    k = digits_kernel(ann, job_image, tmp_path)
    try:
        since = k.mark()
        t0 = time.monotonic()
        cell = k.submit(allreduce_line("ardigits"))

        def both_running():
            if k.idle_after(cell):
                r = k.wait(cell, timeout=5)
                raise AssertionError(f"the cell ended before its pods ran: {r.error_text or r.text}")
            pods = running(job_pods(real_cluster, ns, "ardigits"))
            return pods if len(pods) == 2 else None

        pods = wait_for("the job's 2 pods running", both_running, 300)
        t_pods = time.monotonic() - t0
        assert sorted(p["metadata"]["labels"][kn.L_ROLE] for p in pods) == ["chief", "worker"]
        for p in pods:  # real containers on the real node
            assert p["spec"]["nodeName"] == realnode.NODE_NAME
            (cs,) = p["status"]["containerStatuses"]
            assert cs["containerID"].startswith("containerd://")
        jobs = real_cluster.get(f"/apis/batch/v1/namespaces/{ns}/jobs")["items"]
        assert sorted(j["metadata"]["name"] for j in jobs) == ["ardigits", "ardigits-worker"]  # no PS
        chief = next(p for p in pods if p["metadata"]["labels"][kn.L_ROLE] == "chief")
        worker = next(p for p in pods if p["metadata"]["labels"][kn.L_ROLE] == "worker")
        ips = (worker["status"]["podIP"], chief["status"]["podIP"], kn.TF_PORT, kn.AGENT_PORT)

        def both_listen():
            # controls, so that "BLOCKED" below is the policy and not a port nobody listens on yet: the chief
            # reaches worker-0's TF port (the collective's path), the owner's notebook reaches the agent
            replica = probe_from(ns, chief["metadata"]["name"], *ips)
            owner = probe_from(ns, ann.notebook_pod, *ips)
            listening = replica["TF"] == "CONNECTED" and owner["AGENT"] == "CONNECTED"
            return (replica, owner) if listening and owner["HEALTHZ"].startswith("200") else None

        _replica, owner = wait_for("worker-0's TF server and the agent listening", both_listen, 180, every=1)
        assert owner["TF"] == "BLOCKED", owner  # the TF port is for the job's own pods only
        # another user's pod, even labelled as the owner's notebook: neither a replica's TF port nor the
        # agent (which serves the cell to the replicas) lets it in
        theirs = probe_from(bob.namespace, bob.notebook_pod, *ips)
        assert theirs["TF"] == "BLOCKED" and theirs["AGENT"] == "BLOCKED", theirs
        assert theirs["HEALTHZ"].startswith("FAILED"), theirs
        assert not k.idle_after(cell), "the job ended before the probes: they proved nothing"

        wait_first_epoch(real_cluster, k, cell, since, ns, "ardigits")
        t_epoch = time.monotonic() - t0
        worker_log = real_cluster.logs(ns, worker["metadata"]["name"])
        assert "running the cell as an all-reduce replica" in worker_log, worker_log[-2000:]
        r = k.wait(cell, timeout=900)
        t_cell = time.monotonic() - t0
        assert r.error is None, r.error_text
        shown = sampled_tasks(k.widget_texts(since))
        for task in ("chief-0", "worker-0"):  # each replica sampled inside its pod
            assert task in shown and shown[task][1] > 100, (task, shown)
        ardigits_gone = GoneWatch(real_cluster, ns, "ardigits", 90)  # checked at the end: the TTL runs on
        r = k.run(notebook_cells()[3], timeout=120)
        assert r.error is None, r.error_text
        assert "weights changed: True" in r.text, r.text
        before = float(r.text.split("test accuracy ")[1].split(" ->")[0])
        after = float(r.text.split("->")[1].split(";")[0])
        assert after > 0.8 and after > before + 0.3, r.text
        r = k.run("print('epochs', len(history.history['loss']))")
        assert "epochs 8" in r.text, r.text
        print(
            f"\nall-reduce on the real node: pods running {t_pods:.1f}s, first epoch {t_epoch:.1f}s, "
            f"cell {t_cell:.1f}s after the cell started; accuracy {before:.3f} -> {after:.3f}"
        )

        # 2. worker-0's pod deleted mid-fit
        since = k.mark()
        cell = k.submit(allreduce_line("arlost").replace("epochs=8", "epochs=200"))
        wait_first_epoch(real_cluster, k, cell, since, ns, "arlost")
        (victim,) = job_pods(real_cluster, ns, "arlost", "worker")
        real_cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim['metadata']['name']}")
        t0 = time.monotonic()
        r = k.wait(cell, timeout=300)
        t_cell = time.monotonic() - t0
        # said by the pod watch (worker-0's pod failed) or by chief-0 (its collective lost worker-0)
        assert r.error is not None and "all-reduce worker worker-0" in r.error_text, r.error_text or r.text
        assert "cannot finish a step without it" in r.error_text, r.error_text
        replacements = [
            p
            for p in job_pods(real_cluster, ns, "arlost", "worker")
            if p["metadata"]["uid"] != victim["metadata"]["uid"]
        ]
        assert not replacements, "an all-reduce worker was replaced"
        # the kernel tells the coordinator it has the verdict: the root ends at once, its TTL frees the rest
        # (watched while the next job runs)
        arlost_gone = GoneWatch(real_cluster, ns, "arlost", 45)
        print(f"\nall-reduce worker pod deleted -> the cell failed {t_cell:.1f}s later")

        # 3. the cell interrupted: every pod gone within 15 s
        since = k.mark()
        cell = k.submit(allreduce_line("arstop").replace("epochs=8", "epochs=200"))
        wait_first_epoch(real_cluster, k, cell, since, ns, "arstop")
        t0 = time.monotonic()
        k.km.interrupt_kernel()
        wait_for("the interrupted job's pods gone", lambda: not job_pods(real_cluster, ns, "arstop"), 15)
        print(f"interrupt -> all-reduce pods gone: {time.monotonic() - t0:.1f}s")
        r = k.wait(cell, timeout=120)
        assert r.error and "tfdist job arstop interrupted; all its processes were ended" in r.error_text, (
            r.error_text
        )
        wait_gone(real_cluster, ns, "arstop", 30)
        took = arlost_gone.check()
        print(f"all-reduce worker pod deleted: nothing of that job left {took:.1f}s after its cell")
        print(f"the first job: nothing of it left {ardigits_gone.check():.1f}s after its cell ended")
    finally:
        k.shutdown()
