"""`--strategy allreduce` jobs through the Kubernetes backend against a real API server, scheduler, Job
controller and garbage collector (kwok nodes: pods are scheduled and "run", no container runs; the pods'
code trains in test_pod_runtime_allreduce.py and on the real node in test_k8s_realnode_allreduce.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from tests.kube_plane import nothing_created
from tests.test_k8s_backend import (
    H100,
    backend,
    collect,
    follow_until_running,
    get,
    left,
    private_agent_port,
    spec,
    wait_gone,
)
from tfdist.backends.base import Launch
from tfdist.errors import JobSpecError
from tfdist.jobspec import default_ps, validate
from tfdist.kube import names as kn

pytestmark = [pytest.mark.k8s, pytest.mark.usefixtures("private_agent_port")]
__all__ = ["private_agent_port"]  # the fixture, imported for this module's tests


def ar(name: str, ns: str, **kw):
    return spec(name, ns, **({"strategy": "allreduce", "ps": 0, "workers": 3} | kw))


def job_pods(plane, ns: str, job: str) -> list[dict]:
    return get(plane, f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3D{job}")["items"]


async def test_allreduce_job_is_a_root_and_a_worker_job_on_gpu_nodes_and_stop_leaves_nothing(
    k8s_plane, k8s_namespace
):
    b = backend(k8s_plane, k8s_namespace)
    b.node_selector = H100
    ns = k8s_namespace
    try:
        await b.submit(ar("ar1", ns, gpus_per_worker=1), b"payload", Launch())
        evs = await collect(b, "ar1", lambda ev, _: ev.type == "state" and ev.state == "running")
        assert {str(e.task) for e in evs if e.type == "task"} == {"chief-0", "worker-0", "worker-1"}
        jobs = get(k8s_plane, f"/apis/batch/v1/namespaces/{ns}/jobs")["items"]
        assert sorted(j["metadata"]["name"] for j in jobs) == ["ar1", "ar1-worker"]  # no PS Job
        pods = job_pods(k8s_plane, ns, "ar1")
        assert sorted(p["metadata"]["labels"][kn.L_ROLE] for p in pods) == ["chief", "worker", "worker"]
        for p in pods:  # every replica, chief-0 included, has its GPU and sits on a GPU node
            (c,) = p["spec"]["containers"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1", p["metadata"]["name"]
            node = get(k8s_plane, f"/api/v1/nodes/{p['spec']['nodeName']}")
            assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == H100["nvidia.com/gpu.product"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["TFDIST_STRATEGY"] == "allreduce" and '"ps"' not in env["TFDIST_CLUSTER"]
        worker = next(p for p in pods if p["metadata"]["labels"][kn.L_ROLE] == "worker")
        assert worker["spec"]["containers"][0]["command"][-1] == "allreduce-worker"
        view = await b.status("ar1")
        assert view.state == "running" and view.total_tasks == 3
        assert sorted(view.tasks) == ["chief-0", "worker-0", "worker-1"]
        assert await b.stop("ar1")
        took = await wait_gone(k8s_plane, ns, "ar1", 30)
        print(f"\nstop -> nothing of the all-reduce job left: {took:.1f}s")
    finally:
        await b.close()


async def test_a_failed_allreduce_worker_ends_the_job_and_is_not_replaced(k8s_plane, k8s_namespace):
    """MWMS cannot take one worker back mid-step: the watch ends the job naming the worker (task-failed),
    where a PS job's worker would be replaced."""
    b = backend(k8s_plane, k8s_namespace)
    ns = k8s_namespace
    try:
        await b.submit(ar("ar2", ns, workers=2), b"p", Launch())
        events, task = await follow_until_running(b, "ar2")
        k8s_plane.kubectl(
            "-n", ns, "label", "pod", "-l", f"{kn.L_JOB}=ar2,{kn.L_ROLE}=worker", "sim.tfdist.io/outcome=fail"
        )
        await asyncio.wait_for(task, 60)
        final = events[-1]
        assert final.type == "state" and final.state == "failed", events[-5:]
        assert "all-reduce worker worker-0 failed" in final.message, final
        assert final.error.reason == "task-failed"
        assert not any(e.type == "task" and e.state == "restarting" for e in events)
        view = await b.status("ar2")
        assert view.state == "failed" and view.reason == "task-failed", (view.state, view.reason)
        workers = [
            p for p in job_pods(k8s_plane, ns, "ar2") if p["metadata"]["labels"][kn.L_ROLE] == "worker"
        ]
        assert len(workers) == 1, "the failed worker was replaced"
        await b.stop("ar2")
        await wait_gone(k8s_plane, ns, "ar2", 30)
    finally:
        await b.close()


async def test_refused_allreduce_jobs_create_nothing(k8s_plane, k8s_namespace):
    ns = k8s_namespace
    # bad input, refused before the backend is asked: what `%%tfdist run` checks
    with pytest.raises(JobSpecError, match="--ps 1 does not go with --strategy allreduce"):
        default_ps("allreduce", 1)
    # and the same through the backend a cell's job goes through (a check skipped there would create)
    b = backend(k8s_plane, ns)
    try:
        for name, kw, says in (
            ("bad1", {"ps": 2}, "--ps 2 does not go with --strategy allreduce"),
            ("bad2", {"checkpoint_every": 5}, "--checkpoint-every is for --strategy ps"),
        ):
            with pytest.raises(JobSpecError, match=says):
                validate(ar(name, ns, **kw), None)
            with nothing_created(k8s_plane, ns, name), pytest.raises(JobSpecError, match=says):
                await b.submit(ar(name, ns, **kw), b"p", Launch())
    finally:
        await b.close()
    # refused by the API server: the root itself carries the replicas' node selector here, so nothing
    # is created at all
    b = backend(k8s_plane, ns, TFDIST_GPU_NODE_SELECTOR='{"not a key!": "x"}')
    try:
        with (
            nothing_created(k8s_plane, ns, "bad3"),
            pytest.raises(JobSpecError, match="the API server refused Job 'bad3'"),
        ):
            await b.submit(ar("bad3", ns, gpus_per_worker=1), b"p", Launch())
    finally:
        await b.close()
    for job in ("bad1", "bad2", "bad3"):
        assert left(k8s_plane, ns, job) == []
    assert job_pods(k8s_plane, ns, "bad3") == []


async def test_one_replica_allreduce_job_is_the_root_alone(k8s_plane, k8s_namespace):
    b = backend(k8s_plane, k8s_namespace)
    ns = k8s_namespace
    try:
        await b.submit(ar("ar4", ns, workers=1), b"p", Launch())
        evs = await collect(b, "ar4", lambda ev, _: ev.type == "state" and ev.state == "running")
        assert {str(e.task) for e in evs if e.type == "task"} == {"chief-0"}
        jobs = get(k8s_plane, f"/apis/batch/v1/namespaces/{ns}/jobs")["items"]
        assert [j["metadata"]["name"] for j in jobs] == ["ar4"]
        assert await b.stop("ar4")
        await wait_gone(k8s_plane, ns, "ar4", 30)
    finally:
        await b.close()


def test_the_magic_refuses_bad_allreduce_lines_in_one_sentence_and_creates_nothing(
    k8s_plane, k8s_namespace, tmp_path
):
    """The same refusals through a real kernel with the Kubernetes backend: one sentence, no traceback, no
    object; a good all-reduce line is accepted by the same kernel (its job created, then stopped)."""
    from tests.conftest import SETUP_CODE
    from tests.kernels import Kernel, kernel_env

    ns = k8s_namespace
    env = kernel_env(
        str(tmp_path / "state"),
        KUBECONFIG=k8s_plane.kubeconfig,
        TFDIST_BACKEND="kubernetes",
        TFDIST_NAMESPACE=ns,
        TFDIST_USER="ann",
        TFDIST_WORKER_IMAGE="example.org/tfdist-job:1",
        TFDIST_AGENT_PORT=str(kn.AGENT_PORT),  # the private port: kwok's pod IPs may be real pods' here
    )
    fit = "history = model.fit(train_ds, epochs=1, steps_per_epoch=2)\n"
    k = Kernel(env, cwd=str(tmp_path))
    try:
        assert k.execute(SETUP_CODE, timeout=240).error is None
        for line, says in [
            ("--strategy allreduce --ps 1 --name arbad1", "--ps 1 does not go with --strategy allreduce"),
            (
                "--strategy allreduce --checkpoint-every 5 --name arbad2",
                "--checkpoint-every is for --strategy ps",
            ),
            ("--strategy allreduce --workers 0 --name arbad3", "--workers"),
            ("--strategy mirrored --name arbad4", "mirrored"),
        ]:
            r = k.execute(f"%%tfdist run {line}\n{fit}", timeout=120)
            assert r.error and says in r.error_text, (line, r.error_text)
            assert "Traceback (most recent call last)" not in r.error_text + r.text, r.error_text
        for job in ("arbad1", "arbad2", "arbad3", "arbad4"):
            assert left(k8s_plane, ns, job) == []
        # accepted: the job's root and worker Job exist while the cell hands the job its cell. kwok runs no
        # container, so no agent ever takes it: a detached job is then stopped, not left (said at --timeout
        # + the agent's grace), where it was once reported "started detached" and left waiting for good.
        # (the agent's grace past --timeout, 30 s, made 8 s in this kernel: the same path, sooner)
        assert k.execute("import tfdist.kube.transport as _t; _t.AGENT_GRACE_S = 8.0").error is None
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            cell = pool.submit(
                k.execute,
                f"%%tfdist run --strategy allreduce --workers 2 --name argood --detach --timeout 2\n{fit}",
                timeout=120,
            )
            deadline = time.time() + 60
            while sorted(o for o in left(k8s_plane, ns, "argood") if o.startswith("jobs/")) != [
                "jobs/argood",
                "jobs/argood-worker",
            ]:
                assert time.time() < deadline and not cell.done(), left(k8s_plane, ns, "argood")
                time.sleep(0.5)
            r = cell.result()
        assert r.error and "within --timeout 2s" in r.error_text, r.error_text or r.text
        assert "started detached" not in r.text, r.text
        assert "Traceback (most recent call last)" not in r.error_text + r.text, r.error_text
    finally:
        k.shutdown()
    deadline = time.time() + 30
    while left(k8s_plane, ns, "argood"):
        assert time.time() < deadline, left(k8s_plane, ns, "argood")
        time.sleep(0.5)
