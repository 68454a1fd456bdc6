"""pytest fixtures for the local Kubernetes control plane (tests/kube_plane.py).

Use from tests/conftest.py:

    from tests.k8s_fixtures import k8s_api, k8s_namespace, k8s_plane  # noqa: F401

``k8s_plane`` (session): one real control plane for the whole run, with four kwok GPU nodes
(2 x 8 NVIDIA-H100-80GB-HBM3, 2 x 4 NVIDIA-A100-SXM4-80GB) and one MIG node (two A100 80GB in MIG mode:
7 x nvidia.com/mig-1g.10gb, 2 x nvidia.com/mig-3g.40gb, no whole nvidia.com/gpu). Skips when the
binaries are missing and $CI is unset (run scripts/build-k8s); under CI missing binaries are an error.
``k8s_namespace`` (function): a fresh namespace whose default ServiceAccount exists.
``k8s_api`` (function, async): a kubernetes_asyncio ApiClient for the admin kubeconfig.
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests import kube_plane
from tests.groupend import at_group_end

# The nodes every session gets. Tests that need other shapes call k8s_plane.add_gpu_nodes().
DEFAULT_GPU_NODES = (
    (2, 8, "NVIDIA-H100-80GB-HBM3"),
    (2, 4, "NVIDIA-A100-SXM4-80GB"),
)
# (count, whole GPUs, model, MIG instances): the GPU operator's mixed strategy
DEFAULT_MIG_NODES = ((1, 0, "NVIDIA-A100-SXM4-80GB", {"1g.10gb": 7, "3g.40gb": 2}),)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def k8s_plane():
    bin_dir = kube_plane.find_bin_dir()
    missing = kube_plane.missing_binaries(bin_dir)
    if missing:
        msg = f"local Kubernetes binaries missing in {bin_dir}: {', '.join(missing)} (run scripts/build-k8s)"
        if _in_ci():
            pytest.fail(msg + " [CI is set, so this is an error]", pytrace=False)
        pytest.skip(msg)
    plane = kube_plane.ControlPlane(bin_dir)
    try:
        plane.start()
        for count, gpus, model in DEFAULT_GPU_NODES:
            plane.add_gpu_nodes(count, gpus, model)
        for count, gpus, model, mig in DEFAULT_MIG_NODES:
            plane.add_gpu_nodes(count, gpus, model, mig=mig, name_prefix="kwok-mig-a100")
        at_group_end(plane.stop)
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def k8s_namespace(k8s_plane):
    name = f"t-{uuid.uuid4().hex[:10]}"
    k8s_plane.create_namespace(name)
    yield name
    try:  # the namespace controller (KCM) finishes the deletion asynchronously
        k8s_plane.request("DELETE", f"/api/v1/namespaces/{name}")
    except Exception:
        pass


@pytest.fixture
async def k8s_api(k8s_plane):
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=k8s_plane.kubeconfig, client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        yield api
