"""`%%tfdist run --backend kubernetes` in a real kernel against the real API server: the cell shows the
scheduler's reason, gives up after --timeout, and leaves nothing in the namespace."""

from __future__ import annotations

import pytest

from tests.conftest import SETUP_CODE
from tests.kernels import Kernel, kernel_env

pytestmark = pytest.mark.k8s


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unschedulable_job_in_a_notebook(k8s_plane, k8s_namespace, tmp_path):
    env = kernel_env(
        str(tmp_path / "state"),
        KUBECONFIG=k8s_plane.kubeconfig,
        TFDIST_BACKEND="kubernetes",
        TFDIST_NAMESPACE=k8s_namespace,
        TFDIST_WORKER_IMAGE="example.org/tfdist-job:1",
        TFDIST_GPU_NODE_SELECTOR='{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}',
        # kwok pod IPs may be real pods' of this machine's one-node cluster: a port no agent serves
        TFDIST_AGENT_PORT=str(free_port()),
    )
    k = Kernel(env, cwd=str(tmp_path))
    try:
        assert k.execute(SETUP_CODE, timeout=180).error is None
        r = k.execute(
            "%%tfdist run --workers 2 --gpus-per-worker 9 --timeout 8 --name too-big\n"
            "history = model.fit(train_ds, epochs=1, steps_per_epoch=2)\n",
            timeout=120,
        )
        err = r.error_text
        assert r.error and r.error["ename"] == "JobFailed", err
        assert "not running within --timeout 8s; deleted" in err
        assert "Insufficient nvidia.com/gpu" in err
        widget_views = [
            o for o in r.outputs if "application/vnd.jupyter.widget-view+json" in o["content"].get("data", {})
        ]
        assert widget_views  # the monitor was shown while it waited
        pods = k8s_plane.get(f"/api/v1/namespaces/{k8s_namespace}/pods")["items"]
        assert pods == []
        r = k.execute("%tfdist list", timeout=60)
        assert "too-big" not in r.text
    finally:
        k.shutdown()
