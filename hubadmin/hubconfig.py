"""Turn the GPU admin service on in a JupyterHub config (embedded hub and Kubernetes hub alike).

Why a function: the service needs a role with exactly the scopes it uses, its URL, and the profiles file,
and the spawners must tell every server where to report; written out in two hub configs it would drift.
``enable_gpu_admin(c, profiles=..., public_url=...)``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tfdist.settings import ENV_GPU_ADMIN_BIND, ENV_GPU_ADMIN_LOCAL_GPUS, ENV_GPU_ADMIN_PERIOD, ENV_PROFILES

__all__ = ["SERVICE_NAME", "SERVICE_SCOPES", "enable_gpu_admin", "report_url"]

SERVICE_NAME = "tfdist-gpu-admin"
#: list and read servers (profile, readiness), stop them (culling), read whether a page visitor is an admin.
#: Never ``access:servers``: servers report to the service, which makes no request to any of them, so its
#: token could not reach a user's server even if it leaked.
SERVICE_SCOPES = ["list:users", "read:users", "read:servers", "servers"]


def report_url(public_url: str) -> str:
    """Where servers send their activity reports: the service's route on the hub's proxy."""
    return f"{public_url.rstrip('/')}/services/{SERVICE_NAME}/api/report"


def enable_gpu_admin(
    c: Any,
    *,
    profiles: str,
    public_url: str,
    port: int,
    ip: str = "127.0.0.1",
    bind_ip: str | None = None,
    period_s: float | None = None,
    local_gpus: bool = False,
    servers_report_to: str | None = None,
) -> None:
    """Add the managed service, its role, and the report URL the tfdist spawners give every server.

    `public_url`: how servers reach the service (the proxy); `servers_report_to` replaces the whole report
    URL. `ip`: how the proxy reaches the service (Kubernetes: the hub's Service name, e.g. "hub");
    `bind_ip`: the address it listens on when that name is not one of the pod's own (Kubernetes: "0.0.0.0").
    """
    env = {ENV_PROFILES: profiles}
    if bind_ip:
        env[ENV_GPU_ADMIN_BIND] = bind_ip
    if local_gpus:  # embedded hub: count this machine's free GPUs the way the allocator does
        env[ENV_GPU_ADMIN_LOCAL_GPUS] = "1"
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    if period_s is not None:
        env[ENV_GPU_ADMIN_PERIOD] = str(period_s)
    services = list(c.JupyterHub.services or []) if "services" in c.JupyterHub else []
    services.append(
        {
            "name": SERVICE_NAME,
            "url": f"http://{ip}:{port}",
            "command": [sys.executable, "-m", "tfdist.hubadmin"],
            "environment": env,
            "display": True,
            "oauth_no_confirm": True,
        }
    )
    c.JupyterHub.services = services
    roles = list(c.JupyterHub.load_roles or []) if "load_roles" in c.JupyterHub else []
    roles.append({"name": SERVICE_NAME, "scopes": list(SERVICE_SCOPES), "services": [SERVICE_NAME]})
    c.JupyterHub.load_roles = roles
    # the spawners (tfdist.spawner.base.GpuFormMixin) put it in each server's TFDIST_GPU_ADMIN_URL
    c.GpuFormMixin.gpu_admin_report_url = servers_report_to or report_url(public_url)
