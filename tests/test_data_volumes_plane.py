"""Shared data volumes against a real API server (tests/kube_plane.py): the spawner refuses a server whose
profile names a claim the user's namespace lacks, saying which, and creates no pod; once the admin made the
claim, the notebook pod mounts it. The admission policy (hub_config/admission-policy.yaml), attacked with the
user's own notebook token: a job's pods mount the profile's claims and nothing else, a read-only one only
read-only (before, any claim of the namespace could be mounted, writable), and hostPath stays Pod Security's
to refuse. The policy's parameter lists split on their lines (two allowed RuntimeClasses were read as one)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from tornado import web

from tests import test_k8s_tenancy as tenancy_tests
from tests.test_k8s_escapes import call, cpu_job, jobs_path, refused
from tests.test_k8s_spawner import make_spawner, plane_kubeconfig  # noqa: F401
from tests.test_k8s_tenancy import _api_for_token, _token, cpu_policy, notebook_pod
from tfdist import settings
from tfdist.datamounts import DataMount
from tfdist.kube import datavolumes as dv
from tfdist.kube import tenancy
from tfdist.kube.apply import prepare_user_namespace

if "tests.k8s_fixtures" not in sys.modules:
    from tests.k8s_fixtures import k8s_api, k8s_namespace, k8s_plane  # noqa: F401

pytestmark = [pytest.mark.k8s]
hub = tenancy_tests.hub  # the admission policy and the hub's RBAC, as an admin applies them

REPO = Path(__file__).resolve().parent.parent
IMAGENET = DataMount("imagenet", "/data/imagenet", read_only=True)
SCRATCH = DataMount("scratch", "/data/scratch", read_only=False)


def make_claim(plane, ns: str, name: str, mode: str) -> None:
    """An admin's claim in the user's namespace, bound to a PV of its own (the scheduler places a pod only
    with its claims bound)."""
    pv = f"dv-{uuid.uuid4().hex[:10]}"
    plane.request(
        "POST",
        "/api/v1/persistentvolumes",
        {
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": [mode],
                "storageClassName": "",
                "hostPath": {"path": f"/srv/{pv}"},
                "claimRef": {"namespace": ns, "name": name},
            },
        },
    )
    plane.request(
        "POST",
        f"/api/v1/namespaces/{ns}/persistentvolumeclaims",
        {
            "metadata": {"name": name},
            "spec": {
                "accessModes": [mode],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )


def drop(plane, ns: str) -> None:
    """The namespace and the PVs made for its claims."""
    try:
        plane.request("DELETE", f"/api/v1/namespaces/{ns}")
    except Exception:
        pass
    for pv in plane.get("/api/v1/persistentvolumes")["items"]:
        if (pv["spec"].get("claimRef") or {}).get("namespace") == ns:
            plane.request("DELETE", f"/api/v1/persistentvolumes/{pv['metadata']['name']}")


@pytest.fixture
async def dana(k8s_plane, hub):
    """dana's namespace, prepared with the hub's token from a profile with two data volumes (imagenet
    read-only, scratch writable); the admin made those claims and another (her home's, say)."""
    ns = f"{hub}-dana-{uuid.uuid4().hex[:6]}"
    policy = cpu_policy("dana", ns)
    policy = dataclasses.replace(policy, data_volumes=(IMAGENET, SCRATCH), runtime_classes=["gvisor", "kata"])
    async with _api_for_token(k8s_plane, _token(k8s_plane, hub, "hub")) as api:
        await prepare_user_namespace(api, policy)
    notebook_pod(k8s_plane, ns, "dana")
    make_claim(k8s_plane, ns, "imagenet", "ReadOnlyMany")
    make_claim(k8s_plane, ns, "scratch", "ReadWriteMany")
    make_claim(k8s_plane, ns, "claim-dana", "ReadWriteOnce")
    yield ns, _token(k8s_plane, ns, tenancy.NOTEBOOK_SA)
    drop(k8s_plane, ns)


def job_with(plane, ns: str, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    job = cpu_job(plane, ns, f"dv-{uuid.uuid4().hex[:6]}")
    job["metadata"]["labels"] = {}
    job["spec"]["template"]["metadata"]["labels"] = {}
    pod = job["spec"]["template"]["spec"]
    pod["volumes"] = volumes
    pod["containers"][0]["volumeMounts"] = mounts
    return job


def pvc(name: str, claim: str, read_only: bool | None) -> dict[str, Any]:
    src: dict[str, Any] = {"claimName": claim}
    if read_only is not None:
        src["readOnly"] = read_only
    return {"name": name, "persistentVolumeClaim": src}


def test_job_pods_mount_the_profiles_claims_and_nothing_else(k8s_plane, dana):
    ns, token = dana
    # what the backend makes (tfdist.kube.datavolumes): admitted
    job = dv.with_data_volumes(cpu_job(k8s_plane, ns, f"ok-{uuid.uuid4().hex[:6]}"), (IMAGENET, SCRATCH))
    for obj in (job["metadata"], job["spec"]["template"]["metadata"]):
        obj["labels"] = {}
    code, body = call(k8s_plane, token, "POST", jobs_path(ns), job)
    assert code == 201, body.get("message")
    mount = [{"name": "v", "mountPath": "/data/x"}]
    # another claim of the namespace (the home's): before, any claim could be mounted
    refused(
        call(
            k8s_plane,
            token,
            "POST",
            jobs_path(ns),
            job_with(k8s_plane, ns, [pvc("v", "claim-dana", True)], mount),
        ),
        "volume claim claim-dana is not one of your profile's data volumes (imagenet, scratch)",
    )
    # the read-only dataset mounted writable: the whole team's data would be one user's to overwrite
    for ro in (None, False):
        refused(
            call(
                k8s_plane,
                token,
                "POST",
                jobs_path(ns),
                job_with(k8s_plane, ns, [pvc("v", "imagenet", ro)], mount),
            ),
            "data volume imagenet is read-only in your profile",
        )
    # a read-only mount of a volume whose claim is writable (readOnly on the mount only): still writable
    # through the claim, refused the same
    refused(
        call(
            k8s_plane,
            token,
            "POST",
            jobs_path(ns),
            job_with(k8s_plane, ns, [pvc("v", "imagenet", None)], [{**mount[0], "readOnly": True}]),
        ),
        "read-only in your profile",
    )
    # the writable one, writable: admitted
    ok = job_with(k8s_plane, ns, [pvc("v", "scratch", False)], mount)
    code, body = call(k8s_plane, token, "POST", jobs_path(ns), ok)
    assert code == 201, body.get("message")
    # the parameters' lists split on their lines (runtimeClasses read one line "gvisor\nkata" before)
    ok = job_with(k8s_plane, ns, [], [])
    ok["spec"]["template"]["spec"]["runtimeClassName"] = "kata"
    code, body = call(k8s_plane, token, "POST", jobs_path(ns), ok)
    assert code == 201, body.get("message")


def test_a_namespace_without_data_volumes_admits_no_claim_and_hostpath_stays_refused(k8s_plane, dana):
    ns, token = dana
    # hostPath: refused by the policy's list of volume kinds (Pod Security `restricted` would give the Job
    # controller no pod for it: the second layer)
    job = job_with(
        k8s_plane, ns, [{"name": "h", "hostPath": {"path": "/"}}], [{"name": "h", "mountPath": "/host"}]
    )
    job["spec"]["suspend"] = False
    refused(call(k8s_plane, token, "POST", jobs_path(ns), job), "volume h is not allowed")
    assert k8s_plane.get(f"{jobs_path(ns)}/{job['metadata']['name']}") is None
    # the same namespace converged from a profile without data volumes: no claim at all
    policy = cpu_policy("dana", ns)
    asyncio.run(_prepare(k8s_plane, policy))
    deadline = time.monotonic() + 30
    while True:  # the policy reads its parameters through an informer: a moment after the write
        answer = call(
            k8s_plane,
            token,
            "POST",
            jobs_path(ns),
            job_with(k8s_plane, ns, [pvc("v", "scratch", False)], [{"name": "v", "mountPath": "/d"}]),
        )
        if answer[0] != 201 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    refused(answer, "volume claim scratch is not one of your profile's data volumes (it has none)")


async def _prepare(plane, policy: tenancy.TenantPolicy) -> None:
    hub_ns = policy.namespace.split("-dana-")[0]
    async with _api_for_token(plane, _token(plane, hub_ns, "hub")) as api:
        await prepare_user_namespace(api, policy)


@pytest.mark.usefixtures("plane_kubeconfig")
async def test_a_spawn_without_its_claim_is_refused_naming_it_then_mounts_it(
    k8s_plane, k8s_api, hub, tmp_path
):
    from kubernetes_asyncio import client
    from kubespawner import KubeSpawner

    data = yaml.safe_load((REPO / "hub_config" / "profiles.yaml").read_text())
    cpu = next(p for p in data["profiles"] if p["slug"] == "cpu")
    cpu["data_volumes"] = [{"claim": "imagenet", "mount": "/data/imagenet", "read_only": True}]
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(yaml.safe_dump(data))
    prefix = f"d-{uuid.uuid4().hex[:6]}"
    sp = make_spawner(
        "erin",
        "unused",
        enable_user_namespaces=True,
        user_namespace_template=prefix + "-{username}",
    )
    sp.profiles_file = str(profiles)
    ns = f"{prefix}-erin"
    core = client.CoreV1Api(k8s_api)
    opts = {
        "profile": "cpu",
        "cpu": 1,
        "memory": 2,
        "image": "quay.io/jupyter/tensorflow-notebook:2026-06-01",
    }
    try:
        sp.user_options = opts
        await sp._run_apply_user_options(opts)
        with pytest.raises(web.HTTPError) as e:
            await asyncio.wait_for(sp.start(), 60)
        why = e.value.log_message or ""
        assert e.value.status_code == 409
        assert f"PersistentVolumeClaim 'imagenet' in namespace '{ns}', which does not exist" in why, why
        assert "/data/imagenet" in why and "your server was not started" in why
        assert (await core.list_namespaced_pod(ns)).items == []  # nothing of the server
        assert (await core.list_namespaced_persistent_volume_claim(ns)).items == []

        # a claim only one pod may write: refused too, saying its access modes
        make_claim(k8s_plane, ns, "imagenet", "ReadWriteOnce")
        with pytest.raises(web.HTTPError) as e:
            await asyncio.wait_for(sp.start(), 60)
        assert "(ReadWriteOnce)" in (e.value.log_message or ""), e.value.log_message
        assert (await core.list_namespaced_pod(ns)).items == []
        k8s_plane.request("DELETE", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/imagenet")
        for _ in range(100):  # (the claim's protection finalizer: gone once no pod uses it)
            if not (await core.list_namespaced_persistent_volume_claim(ns)).items:
                break
            await asyncio.sleep(0.2)

        # the admin makes it, shareable: the server starts with it mounted, and its jobs are told
        make_claim(k8s_plane, ns, "imagenet", "ReadOnlyMany")
        await asyncio.wait_for(sp.start(), 60)
        pod = await core.read_namespaced_pod(sp.pod_name, ns)
        vols = {v.name: v for v in pod.spec.volumes}
        assert vols["tfdist-data-0"].persistent_volume_claim.claim_name == "imagenet"
        assert vols["tfdist-data-0"].persistent_volume_claim.read_only is True
        (c,) = pod.spec.containers
        assert [(m.mount_path, m.read_only) for m in c.volume_mounts if m.name == "tfdist-data-0"] == [
            ("/data/imagenet", True)
        ]
        env = {e.name: e.value for e in c.env}
        assert settings.from_environ(
            {settings.ENV_DATA_VOLUMES: env[settings.ENV_DATA_VOLUMES]}
        ).data_volumes == (IMAGENET,)
        params = (await core.read_namespaced_config_map(tenancy.POLICY_PARAMS, ns)).data
        assert params["dataClaims"] == "imagenet" and params["readOnlyClaims"] == "imagenet"
    finally:
        await asyncio.wait_for(sp.stop(now=True), 30)
        await KubeSpawner._stop_all_reflectors()
        drop(k8s_plane, ns)
