"""Defaults for `%%tfdist` that the spawner hands to each notebook server through its environment.

The spawner (tfdist.spawner) writes these variables; the magic only reads them. Keeping the names in one
place is the contract between the two sides.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

ENV_BACKEND = "TFDIST_BACKEND"  # "local" (default) or "kubernetes"
ENV_NAMESPACE = "TFDIST_NAMESPACE"  # Kubernetes namespace for job objects
ENV_WORKER_IMAGE = "TFDIST_WORKER_IMAGE"  # image of PS/worker/coordinator pods
ENV_GPUS = "TFDIST_GPUS"  # number of GPUs this server was given (informational on k8s)
ENV_GPU_MODEL = "TFDIST_GPU_MODEL"  # GPU model key of the profile (node selector comes from hub config)
ENV_POD_NAME = "TFDIST_POD_NAME"  # the notebook pod (owner of job objects), via the downward API
ENV_POD_UID = "TFDIST_POD_UID"
ENV_SERVICE_ACCOUNT = "TFDIST_SERVICE_ACCOUNT"
ENV_KUEUE_QUEUE = "TFDIST_KUEUE_QUEUE"  # optional Kueue LocalQueue name
ENV_GPU_NODE_SELECTOR = "TFDIST_GPU_NODE_SELECTOR"  # JSON: node selector of the GPU model (workers' pods)
ENV_GPU_TOLERATIONS = "TFDIST_GPU_TOLERATIONS"  # JSON list: tolerations of the GPU model
ENV_USER = "TFDIST_USER"  # the hub user name (labels); falls back to JUPYTERHUB_USER / $USER
ENV_STATE_DIR = "TFDIST_STATE_DIR"  # where local jobs keep sockets, logs and results


@dataclass(frozen=True)
class Settings:
    backend: str
    namespace: str | None
    worker_image: str | None
    gpus: int | None
    gpu_model: str | None
    pod_name: str | None
    pod_uid: str | None
    service_account: str | None
    kueue_queue: str | None
    gpu_node_selector: dict[str, str] | None
    gpu_tolerations: list[dict] | None
    user: str
    state_dir: str


def _int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


def _json_or_none(v: str | None, kind: type) -> Any:
    try:
        out = json.loads(v) if v else None
    except ValueError:
        return None
    return out if isinstance(out, kind) else None


def from_environ(env: dict[str, str] | None = None) -> Settings:
    e = dict(os.environ if env is None else env)
    user = e.get(ENV_USER) or e.get("JUPYTERHUB_USER") or e.get("USER") or "user"
    runtime = e.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Settings(
        backend=e.get(ENV_BACKEND, "local") or "local",
        namespace=e.get(ENV_NAMESPACE) or None,
        worker_image=e.get(ENV_WORKER_IMAGE) or None,
        gpus=_int_or_none(e.get(ENV_GPUS)),
        gpu_model=e.get(ENV_GPU_MODEL) or None,
        pod_name=e.get(ENV_POD_NAME) or None,
        pod_uid=e.get(ENV_POD_UID) or None,
        service_account=e.get(ENV_SERVICE_ACCOUNT) or None,
        kueue_queue=e.get(ENV_KUEUE_QUEUE) or None,
        gpu_node_selector=_json_or_none(e.get(ENV_GPU_NODE_SELECTOR), dict),
        gpu_tolerations=_json_or_none(e.get(ENV_GPU_TOLERATIONS), list),
        user=user,
        state_dir=e.get(ENV_STATE_DIR) or os.path.join(runtime, "tfdist", "jobs"),
    )
