"""What a choice becomes on Kubernetes: KubeSpawner's own get_pod_manifest on TfdistKubeSpawner.

No cluster: the spawner is built with named doubles for the hub's user and hub objects and a kubeconfig
that points nowhere (KubeSpawner loads a config in __init__ but calls no API to build a manifest).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "doubles"))
from hub_objects import FakeGroup, FakeHub, FakeHubUser

from tfdist import settings
from tfdist.settings import from_environ

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "hub_config" / "profiles.yaml"
KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none, namespace: jhub}}]
current-context: none
"""


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import kubernetes_asyncio.config.kube_config as kc

    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kc, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    yield


def make_spawner(groups: list[str], **traits: Any) -> Any:
    from tfdist.spawner.kube import TfdistKubeSpawner

    user = FakeHubUser(name="alice", groups=[FakeGroup(g) for g in groups])
    sp = TfdistKubeSpawner(
        user=user,
        hub=FakeHub(),
        profiles_file=str(PROFILES),
        namespace="jhub",
        service_account="tfdist-notebook",
        gpu_availability_enabled=False,
        node_selector={"pool": "notebooks"},
        tolerations=[{"key": "pool", "operator": "Equal", "value": "notebooks", "effect": "NoSchedule"}],
        extra_resource_limits={"example.com/fpga": "1"},
        **traits,
    )
    sp.api_token = "secret-token"
    user.spawners[""] = sp
    return sp


async def _manifest(sp: Any, options: dict[str, Any]) -> dict[str, Any]:
    from kubernetes_asyncio.client import ApiClient

    sp.user_options = options
    await sp._run_apply_user_options(options)  # what JupyterHub's User.spawn calls
    await sp.load_user_options()  # what KubeSpawner._start calls
    pod = await sp.get_pod_manifest()
    return ApiClient().sanitize_for_serialization(pod)


async def test_gpu_choice_pod_manifest(kubeconfig: None) -> None:
    sp = make_spawner(["ml-team"], worker_image="registry.example.org/ml/tfdist-worker:0.1")
    options = {
        "profile": "gpu",
        "cpu": 4,
        "memory": 32,
        "gpus": 2,
        "gpu_model": "h100",
        "image": "registry.example.org/ml/tf-custom:2.21",
    }
    pod = await _manifest(sp, options)
    spec = pod["spec"]
    c = spec["containers"][0]
    # the label that this user's job NetworkPolicies admit to their coordinator's agent
    from tfdist.kube.names import user_label

    assert pod["metadata"]["labels"]["tfdist.io/notebook-of"] == user_label(sp.user.name)
    assert c["image"] == "registry.example.org/ml/tf-custom:2.21"
    assert c["resources"]["limits"] == {
        "cpu": 4.0,
        "memory": 32 * 2**30,
        "nvidia.com/gpu": "2",
        "example.com/fpga": "1",
    }
    assert c["resources"]["requests"] == {"cpu": 4.0, "memory": 32 * 2**30, "nvidia.com/gpu": "2"}
    assert spec["nodeSelector"] == {"pool": "notebooks", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert {"key": "pool", "operator": "Equal", "value": "notebooks", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert spec["serviceAccountName"] == "tfdist-notebook"
    env = {e["name"]: e for e in c["env"]}
    assert env[settings.ENV_BACKEND]["value"] == "kubernetes"
    # each user in their own namespace by default, never the hub's (jhub): the jobs go there too
    assert env[settings.ENV_NAMESPACE]["value"] == "user-alice" == sp.namespace
    assert env[settings.ENV_WORKER_IMAGE]["value"] == "registry.example.org/ml/tfdist-worker:0.1"
    assert env[settings.ENV_GPUS]["value"] == "2"
    assert env[settings.ENV_GPU_MODEL]["value"] == "h100"
    # %%tfdist's GPU workers ask for the model's resource: whole GPUs here
    assert env[settings.ENV_GPU_RESOURCE]["value"] == "nvidia.com/gpu"
    assert "TFDIST_SERVICE_ACCOUNT" not in env  # nothing in the kernel reads it (the pod spec names it)
    assert env[settings.ENV_KUEUE_QUEUE]["value"] == "ml-team"
    assert env[settings.ENV_LIFELINE_GRACE_S]["value"] == "60"  # the kernel's jobs end 60 s after it
    assert env[settings.ENV_USER]["value"] == "alice"
    assert env[settings.ENV_POD_NAME]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env[settings.ENV_POD_UID]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert "NVIDIA_VISIBLE_DEVICES" not in env


async def test_the_models_share_per_gpu_reaches_the_admission_policy(kubeconfig: None) -> None:
    """hub_config/profiles.yaml's h100: 24 CPUs and 240 GiB per GPU; the user namespace's policy parameters
    carry them (tfdist-user-placement bounds %%tfdist's GPU pods by them); a model without them, none."""
    from tfdist.kube import tenancy

    sp = make_spawner(["ml-team"])
    image = "quay.io/jupyter/tensorflow-notebook:cuda-2026-06-01"
    await _manifest(
        sp, {"profile": "gpu", "cpu": 4, "memory": 32, "gpus": 1, "gpu_model": "h100", "image": image}
    )
    params = tenancy.policy_params(sp.tenant_policy())["data"]
    assert (params["cpuPerGpu"], params["memoryPerGpu"]) == ("24", str(240 * 2**30))
    assert (params["defaultCpu"], params["defaultMemory"]) == ("1", "2Gi")  # the LimitRange's
    mig = {"profile": "gpu", "cpu": 4, "memory": 32, "gpus": 1, "gpu_model": "a100-mig-1g", "image": image}
    await _manifest(sp, mig)
    params = tenancy.policy_params(sp.tenant_policy())["data"]
    assert (params["cpuPerGpu"], params["memoryPerGpu"]) == ("", "")


async def test_the_admins_lifeline_grace_reaches_the_kernel_bad_ones_refused(kubeconfig: None) -> None:
    from traitlets import TraitError

    sp = make_spawner([], lifeline_grace_seconds=20)
    assert sp.get_env()[settings.ENV_LIFELINE_GRACE_S] == "20"
    assert from_environ({settings.ENV_LIFELINE_GRACE_S: "20"}).lifeline_grace_s == 20  # what the kernel reads
    for bad in (5, 86400):
        with pytest.raises(TraitError):
            make_spawner([], lifeline_grace_seconds=bad)


async def test_mig_and_limit_factor_and_no_sticky_gpu(kubeconfig: None) -> None:
    sp = make_spawner(["ml-team"])
    mig = {
        "profile": "gpu",
        "cpu": 2,
        "memory": 8,
        "gpus": 1,
        "gpu_model": "a100-mig-1g",
        "image": "quay.io/jupyter/tensorflow-notebook:cuda-2026-06-01",
    }
    pod = await _manifest(sp, mig)
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == "1"
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert pod["spec"]["nodeSelector"]["nvidia.com/mig.config"] == "all-1g.10gb"
    # the jobs' GPU workers ask for the same MIG profile (the admission policy refuses nvidia.com/gpu)
    env = {e["name"]: e for e in c["env"]}
    assert env[settings.ENV_GPU_RESOURCE]["value"] == "nvidia.com/mig-1g.10gb"
    assert json.loads(env[settings.ENV_GPU_NODE_SELECTOR]["value"])["nvidia.com/mig.config"] == "all-1g.10gb"
    # the same spawner object, next spawn CPU-only: nothing of the GPU choice is left
    cpu = {"profile": "cpu", "cpu": 1, "memory": 2, "image": "quay.io/jupyter/tensorflow-notebook:2026-06-01"}
    sp.clear_state()
    pod = await _manifest(sp, cpu)
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"cpu": 2.0, "memory": 2 * 2**30, "example.com/fpga": "1"}
    assert c["resources"]["requests"] == {"cpu": 1.0, "memory": 2 * 2**30}
    assert pod["spec"]["nodeSelector"] == {"pool": "notebooks"}
    assert all(t.get("key") != "nvidia.com/gpu" for t in pod["spec"]["tolerations"])
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"
    assert settings.ENV_GPU_RESOURCE not in env and settings.ENV_GPU_NODE_SELECTOR not in env
    assert env[settings.ENV_GPUS]["value"] == "0"


async def test_bad_rest_options_are_400_not_keyerror(kubeconfig: None) -> None:
    from tornado.web import HTTPError

    sp = make_spawner(["students"])  # not in ml-team
    for options, text in [
        (
            {"profile": "gpu", "cpu": 2, "memory": 8, "gpus": 1, "gpu_model": "h100", "image": "x"},
            "not available",
        ),
        ({"profile": "cpu", "cpu": 1, "memory": 2, "image": "quay.io/other:1"}, "not on the list"),
        ({"profile": "cpu", "cpu": "4Gi", "memory": 2, "image": "x"}, "CPU must be a number"),
    ]:
        sp.user_options = options
        with pytest.raises(HTTPError) as e:
            await sp._run_apply_user_options(options)
        assert e.value.status_code == 400 and text in e.value.jupyterhub_message  # type: ignore[attr-defined]


async def test_form_is_ours_not_kubespawners(kubeconfig: None) -> None:
    sp = make_spawner(["ml-team"])
    html = await sp.get_options_form()
    assert 'id="tfdist-form"' in html
    assert "GPU availability is not known" in html  # availability watch disabled in this test
    assert 'value="gpu-large"' not in html  # ml-admins only


async def test_the_notebooks_user_and_groups_reach_its_jobs_and_the_policy(kubeconfig: None) -> None:
    """Every job pod runs as its notebook (the profile's data volumes are shared): the spawner resolves
    KubeSpawner's uid/gid/fs_gid/supplemental_gids (callables as KubeSpawner does), the notebook pod runs as
    them, the kernel reads them (TFDIST_POD_IDENTITY) and the namespace's policy parameters pin them."""
    from tfdist.kube import tenancy
    from tfdist.podidentity import PodIdentity

    async def fs_gid(spawner: Any) -> int:  # an async callable, as z2jh admins may write
        return 100

    worker = "registry.example.org/ml/tfdist-worker:0.1"
    sp = make_spawner([], fs_gid=fs_gid, supplemental_gids=lambda s: [2000], worker_image=worker)
    assert (sp.uid, sp.gid) == (1000, 1000)  # the images' user unless the admin says otherwise
    got = await sp.resolve_pod_identity()
    assert got == PodIdentity(1000, 1000, fs_group=100, supplemental_groups=(2000,))
    cpu = {"profile": "cpu", "cpu": 1, "memory": 2, "image": "quay.io/jupyter/tensorflow-notebook:2026-06-01"}
    spec = (await _manifest(sp, cpu))["spec"]
    psc, csc = spec["securityContext"], spec["containers"][0]["securityContext"]  # as KubeSpawner places them
    assert (csc["runAsUser"], csc["runAsGroup"]) == (1000, 1000)
    assert (psc["fsGroup"], psc["supplementalGroups"]) == (100, [2000])
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    kernel = from_environ({settings.ENV_POD_IDENTITY: env[settings.ENV_POD_IDENTITY]["value"]})
    assert kernel.pod_identity == got
    params = tenancy.policy_params(sp.tenant_policy())["data"]
    # the images job pods may run: the profile's list exactly and its free-form pattern (RE2, matched whole)
    assert params["images"] == f"quay.io/jupyter/tensorflow-notebook:2026-06-01\n{worker}"
    assert params["imagePattern"] == ""  # the CPU profile has none (test_spawner_validation: one that has)
    assert (params["runAsUser"], params["runAsGroup"], params["fsGroup"], params["supplementalGroups"]) == (
        "1000",
        "1000",
        "100",
        "2000",
    )


async def test_a_spawn_whose_notebook_user_is_the_images_own_is_refused(kubeconfig: None) -> None:
    """uid None (the image's user): the admission policy could not say as whom job pods may run."""
    from tornado import web

    sp = make_spawner([], uid=None)
    with pytest.raises(web.HTTPError) as e:
        await sp.resolve_pod_identity()
    assert e.value.status_code == 500 and "KubeSpawner.uid and .gid must be set" in e.value.log_message


async def test_the_notebooks_security_contexts_win_as_in_its_pod_and_groups_are_bounded(
    kubeconfig: None,
) -> None:
    """KubeSpawner lets container_security_context/pod_security_context override uid/gid/fs_gid: the job
    pods follow the notebook pod as it is built. More supplementary groups than the admission policy
    admits on a job pod refuse the spawn with the reason, not every job after it."""
    from tornado import web

    from tfdist.podidentity import PodIdentity

    csc = {"runAsUser": 1500, "runAsNonRoot": True, "allowPrivilegeEscalation": False}
    sp = make_spawner([], container_security_context=csc, pod_security_context={"fsGroup": 300})
    assert await sp.resolve_pod_identity() == PodIdentity(1500, 1000, fs_group=300)
    cpu = {"profile": "cpu", "cpu": 1, "memory": 2, "image": "quay.io/jupyter/tensorflow-notebook:2026-06-01"}
    spec = (await _manifest(sp, cpu))["spec"]
    assert spec["containers"][0]["securityContext"]["runAsUser"] == 1500
    assert spec["securityContext"]["fsGroup"] == 300
    sp = make_spawner([], supplemental_gids=[2000, 2001, 2002, 2003, 2004])
    with pytest.raises(web.HTTPError) as e:
        await sp.resolve_pod_identity()
    assert "at most 4 supplementary groups" in e.value.log_message


async def test_a_shared_namespace_spawns_with_the_images_user_and_passes_a_known_one_on(
    kubeconfig: None,
) -> None:
    """Without user namespaces no policy pins job pods: uid None (the image's user) is no reason to refuse
    the spawn, and the kernel gets no identity; a callable uid is resolved before the pod's environment."""
    cpu = {"profile": "cpu", "cpu": 1, "memory": 2, "image": "quay.io/jupyter/tensorflow-notebook:2026-06-01"}
    sp = make_spawner([], uid=None, enable_user_namespaces=False)
    env = {e["name"]: e for e in (await _manifest(sp, cpu))["spec"]["containers"][0]["env"]}
    assert settings.ENV_POD_IDENTITY not in env
    sp = make_spawner([], uid=lambda s: 1234, enable_user_namespaces=False)
    env = {e["name"]: e for e in (await _manifest(sp, cpu))["spec"]["containers"][0]["env"]}
    assert json.loads(env[settings.ENV_POD_IDENTITY]["value"]) == {"runAsUser": 1234, "runAsGroup": 1000}
