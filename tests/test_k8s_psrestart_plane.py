"""A PS that comes back, against a real API server and Job controller (kwok nodes: no container runs, so
no coordinator resumes here; that is tests/test_k8s_realnode_psrestart.py): with --checkpoint-every the
objects the backend creates carry the restart policy and the coordinator's setting, and a failed PS pod is
replaced at its index while the kernel's watch shows it restarting, not the job's end."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.test_k8s_backend import backend, follow_until_running, get, private_agent_port, spec, wait_gone  # noqa: F401
from tfdist.backends.base import Launch
from tfdist.kube import names as kn
from tfdist.runtime import psrecovery

pytestmark = [pytest.mark.k8s, pytest.mark.usefixtures("private_agent_port")]


async def test_a_failed_ps_pod_is_replaced_and_the_job_goes_on(k8s_plane, k8s_namespace):
    ns = k8s_namespace
    b = backend(k8s_plane, ns)
    try:
        await b.submit(spec("psback", ns, workers=1, checkpoint_every=5), b"p", Launch())
        root = get(k8s_plane, f"/apis/batch/v1/namespaces/{ns}/jobs/psback")
        env = {e["name"]: e.get("value") for e in root["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env[psrecovery.ENV_EVERY] == "5"
        ps_job = get(k8s_plane, f"/apis/batch/v1/namespaces/{ns}/jobs/psback-ps")
        assert ps_job["spec"]["backoffLimitPerIndex"] == 3 and ps_job["spec"]["maxFailedIndexes"] == 0
        assert ps_job["spec"]["podReplacementPolicy"] == "TerminatingOrFailed"
        # the PS has a stable address: its own ClusterIP Service, named in every task's cluster spec
        svc = get(k8s_plane, f"/api/v1/namespaces/{ns}/services/psback-ps-0")
        assert svc["spec"]["clusterIP"] not in ("", "None")
        assert svc["metadata"]["ownerReferences"][0]["uid"] == root["metadata"]["uid"]
        assert f"psback-ps-0.{ns}.svc:{kn.TF_PORT}" in env["TFDIST_CLUSTER"], env["TFDIST_CLUSTER"]
        events, task = await follow_until_running(b, "psback")
        n_before = len(events)
        k8s_plane.kubectl(
            "-n", ns, "label", "pod", "-l", f"{kn.L_JOB}=psback,{kn.L_ROLE}=ps", "sim.tfdist.io/outcome=fail"
        )
        deadline = time.time() + 60
        while not [
            e
            for e in events[n_before:]
            if e.type == "task" and str(e.task) == "ps-0" and e.state == "running"
        ]:
            assert time.time() < deadline, events[-8:]
            await asyncio.sleep(0.2)
        after = events[n_before:]
        assert any(e.type == "task" and str(e.task) == "ps-0" and e.state == "restarting" for e in after)
        assert not [e for e in after if e.type == "state" and e.state in ("failed", "stopped")], after
        assert (await b.status("psback")).state == "running"
        # ... and the Service routes to the replacement PS pod, the only one it selects
        ps_pods = get(
            k8s_plane, f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3Dpsback,{kn.L_ROLE}%3Dps"
        )
        (new_ps,) = [p for p in ps_pods["items"] if p["status"].get("phase") == "Running"]

        def routed() -> list[str]:
            sel = "kubernetes.io%2Fservice-name%3Dpsback-ps-0"
            slices = get(
                k8s_plane, f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector={sel}"
            )
            return [a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]]

        deadline = time.time() + 30
        while routed() != [new_ps["status"]["podIP"]]:
            assert time.time() < deadline, (routed(), new_ps["status"]["podIP"])
            await asyncio.sleep(0.5)
        task.cancel()
        assert await b.stop("psback")
        await wait_gone(k8s_plane, ns, "psback", 30)
    finally:
        await b.close()
