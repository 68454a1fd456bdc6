"""Issue 10 against a real control plane (kwok nodes): the cluster, not the kernel, runs a Kubernetes job.
A worker pod lost while nobody watches is replaced by the Job controller; a SIGKILLed kernel's job is ended
by the cluster within 90 s (the lifeline); a finished job deletes itself; a detached job outlives its
kernel and can be attached from a later one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.realpods import runs_in_real_pods
from tests.test_k8s_backend import backend, left, private_agent_port, spec, wait_gone  # noqa: F401
from tfdist.backends.base import Launch
from tfdist.backends.local import LocalBackend
from tfdist.errors import JobSpecError, NoSuchJob
from tfdist.kube import manifests as mf
from tfdist.kube import names as kn
from tfdist.settings import ENV_RESULT_WAIT_S

pytestmark = [pytest.mark.k8s, pytest.mark.usefixtures("private_agent_port")]


@pytest.fixture
def agent_takes_the_cell(monkeypatch):
    """kwok runs no container, so no agent ever takes a payload; a detached submit waits for that handover
    (the kernel may die right after the cell). Here the chief pod's address is still found for real, and
    the upload itself is taken as an agent would take it: these tests are about the job's record."""
    from tfdist.kube import transport

    async def delivered(client, payload, created, timeout_s) -> None:
        return None

    monkeypatch.setattr(transport, "deliver", delivered)


def pods_of(plane, ns: str, job: str, role: str | None = None) -> list[dict]:
    sel = f"{kn.L_JOB}%3D{job}" + (f",{kn.L_ROLE}%3D{role}" if role else "")
    return plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={sel}")["items"]


async def wait_for(what: str, probe, timeout: float = 60.0):
    t0 = time.time()
    while True:
        got = probe()
        if got:
            return got
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.3)


def running(pods: list[dict]) -> list[dict]:
    return [
        p
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


async def test_a_worker_pod_deleted_while_nobody_watches_is_replaced_by_the_cluster(k8s_plane, k8s_namespace):
    ns = k8s_namespace
    b = backend(k8s_plane, ns)
    try:
        await b.submit(spec("heal", ns, workers=2), b"p", Launch())  # nobody iterates watch()
        await wait_for("4 pods running", lambda: len(running(pods_of(k8s_plane, ns, "heal"))) == 4)
        victim = next(
            p for p in pods_of(k8s_plane, ns, "heal", "worker") if p["metadata"]["labels"][kn.L_INDEX] == "0"
        )
        t0 = time.time()
        k8s_plane.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim['metadata']['name']}")

        def replacement():
            return [
                p
                for p in running(pods_of(k8s_plane, ns, "heal", "worker"))
                if p["metadata"]["labels"][kn.L_INDEX] == "0"
                and p["metadata"]["uid"] != victim["metadata"]["uid"]
            ]

        await wait_for("worker-0 replaced and running", replacement, timeout=60)
        print(f"\nworker pod deletion -> replacement Running: {time.time() - t0:.2f}s")
        view = await b.status("heal")
        assert view.state == "running" and view.tasks["worker-0"]["state"] == "running"
    finally:
        await b.close()


@runs_in_real_pods("tests/test_k8s_realnode_jobs.py, a real kernel SIGKILLed")
async def test_the_cluster_ends_a_job_whose_kernel_was_sigkilled_within_90s(
    k8s_plane, k8s_namespace, tmp_path
):
    ns = k8s_namespace
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from tfdist.backends.base import Launch
        from tfdist.backends.kubernetes import KubernetesBackend
        from tfdist.jobspec import JobSpec
        from tfdist.settings import from_environ

        async def main():
            b = KubernetesBackend(from_environ({{"TFDIST_NAMESPACE": {ns!r}, "TFDIST_USER": "ann",
                                                 "TFDIST_WORKER_IMAGE": "example.org/tfdist-job:1",
                                                 "TFDIST_STATE_DIR": {str(tmp_path)!r},
                                                 "TFDIST_LIFELINE_GRACE_S": "15"}}),
                                  kubeconfig={k8s_plane.kubeconfig!r})
            await b.submit(JobSpec(name="orphan", user="ann", backend="kubernetes"), b"p", Launch())
            print("submitted", flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout is not None and kernel.stdout.readline().strip() == "submitted"
        await wait_for("pods running", lambda: len(running(pods_of(k8s_plane, ns, "orphan"))) == 4)
        # past the 15 s grace: the kernel renewed its lifeline, so the job is still there
        await asyncio.sleep(20)
        assert len(running(pods_of(k8s_plane, ns, "orphan"))) == 4
        os.kill(kernel.pid, signal.SIGKILL)
        t0 = time.time()
    finally:
        kernel.kill()
        kernel.wait()
    took = await wait_gone(k8s_plane, ns, "orphan", 90)
    print(f"\nkernel SIGKILLed -> every object of its job gone: {time.time() - t0:.1f}s (wait {took:.1f}s)")


async def test_a_finished_job_deletes_itself(k8s_plane, k8s_namespace):
    ns = k8s_namespace
    b = backend(k8s_plane, ns)
    try:
        await b.submit(spec("done", ns), b"p", Launch())
        await wait_for("chief running", lambda: running(pods_of(k8s_plane, ns, "done", "chief")))
        # kwok: a pod labelled so ends Succeeded, as the coordinator's pod does when the fit is over
        k8s_plane.kubectl(
            "-n",
            ns,
            "label",
            "pod",
            "-l",
            f"{kn.L_JOB}=done,{kn.L_ROLE}=chief",
            "sim.tfdist.io/outcome=succeed",
        )
        t0 = time.time()
        await wait_gone(k8s_plane, ns, "done", 60)
        print(f"\nfinished -> every object gone: {time.time() - t0:.1f}s (TTL {mf.FINISHED_TTL_S}s)")
    finally:
        await b.close()


async def test_a_mistyped_retention_starts_the_detached_job_with_the_default_and_the_local_sentence(
    k8s_plane, k8s_namespace, tmp_path, monkeypatch, agent_takes_the_cell
):
    """TFDIST_RESULT_RETENTION_S mistyped: the job starts (it was a ValueError traceback), its coordinator
    keeps the results for the default and the record says so, with the local backend's sentence."""
    monkeypatch.setenv("TFDIST_RESULT_RETENTION_S", "1 day")
    ns = k8s_namespace
    b = backend(k8s_plane, ns, TFDIST_STATE_DIR=str(tmp_path))
    try:
        assert b.retention() == LocalBackend(str(tmp_path / "local")).retention()
        assert b.retention().problem and "'1 day' is not a number of seconds" in b.retention().problem
        await b.submit(spec("typo", ns, detach=True), b"p", Launch())
        root = k8s_plane.get(f"/apis/batch/v1/namespaces/{ns}/jobs/typo")
        env = {e["name"]: e.get("value") for e in root["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env[ENV_RESULT_WAIT_S] == f"{24 * 3600:g}"
        assert b.detach_summary("typo", ended=1000.0).kept_until == 1000.0 + 24 * 3600
    finally:
        await b.stop("typo")
        await b.close()


async def test_a_detached_job_outlives_its_kernel_and_is_attached_from_the_next(
    k8s_plane, k8s_namespace, tmp_path, agent_takes_the_cell
):
    ns = k8s_namespace
    env = {"TFDIST_STATE_DIR": str(tmp_path)}
    first = backend(k8s_plane, ns, **env)
    await first.submit(spec("away", ns, extra={"detach": True}), b"p", Launch())
    root = k8s_plane.get(f"/apis/batch/v1/namespaces/{ns}/jobs/away")
    assert "activeDeadlineSeconds" not in root["spec"]  # no lifeline
    await first.close()  # the kernel restarts
    await asyncio.sleep(2)
    assert "jobs/away" in left(k8s_plane, ns, "away")
    second = backend(k8s_plane, ns, **env)
    try:
        with pytest.raises(NoSuchJob):
            await second.attach("never-started")
        await second.attach("away")
        view = await second.status("away")
        assert view.spec["name"] == "away" and view.state in ("starting", "running")
        [row] = await second.list_jobs()
        assert row.name == "away" and row.detached is True and row.results == "pending"
        assert first.detach_summary("away", ended=1000.0).fields() == {
            "detached": True,
            "results": "waiting",
            "kept_until": 1000.0 + 24 * 3600,  # the default retention, recorded when the job started
        }
        assert await second.stop("away")
        await wait_gone(k8s_plane, ns, "away", 30)
        with pytest.raises((NoSuchJob, JobSpecError)):
            await second.attach("away")  # stopped: nothing to attach to
    finally:
        await second.close()
