"""The pod of one role of a job: its container, environment, resources, security context and placement,
as a plain dict. Pure: no API calls.

Why apart from the Jobs: the pod is where the job's image meets the cluster (what tfdist.runtime.podmain
reads, the GPUs, the node it may land on, the Kueue pod group); the Jobs only say how many and how often.
"""

from __future__ import annotations

import json
from typing import Any

from .. import taskenv
from ..job.restart import RestartPolicy
from ..jobspec import JobSpec
from ..settings import (
    ENV_AGENT_PORT,
    ENV_AGENT_URL,
    ENV_CHECKPOINT_EVERY,
    ENV_CLUSTER,
    ENV_RESULT_WAIT_S,
    ENV_TASK,
    ENV_TOKEN,
)
from . import names  # AGENT_PORT read at each call: the tests move it
from .names import (
    A_PS_RESTARTS,
    L_ROLE,
    TF_PORT,
    cluster_spec,
    labels,
    pod_name,
    ps_comes_back,
    task_host,
)
from .queueing import with_pod_group

GPU_RESOURCE = "nvidia.com/gpu"
TERMINATION_GRACE_S = 5
# on containers without GPUs: a CUDA image sets NVIDIA_VISIBLE_DEVICES=all, and where the NVIDIA runtime is
# the node's default its toolkit would hand such a container every GPU of the node, counted by no quota (the
# admission policy refuses any other NVIDIA_* variable)
NO_GPU_ENV = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def resources(spec: JobSpec, gpus: int, gpu_resource: str = GPU_RESOURCE) -> dict[str, Any]:
    """Requests/limits of one container; GPUs as `gpu_resource`, the profile's model (a MIG profile such as
    nvidia.com/mig-1g.10gb is a resource of its own)."""
    req: dict[str, str] = {}
    lim: dict[str, str] = {}
    if spec.cpu:
        req["cpu"] = lim["cpu"] = f"{int(spec.cpu * 1000)}m"
    if spec.memory_bytes:
        req["memory"] = lim["memory"] = str(spec.memory_bytes)
    if gpus:
        lim[gpu_resource] = str(gpus)
    out: dict[str, Any] = {}
    if req:
        out["requests"] = req
    if lim:
        out["limits"] = lim
    return out


def pod_template(
    spec: JobSpec,
    role: str,
    *,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
    gpu_resource: str = GPU_RESOURCE,
    queue: str | None = None,
    result_wait_s: float | None = None,
) -> dict[str, Any]:
    """The pod of one role. Its task index comes from the Job controller (JOB_COMPLETION_INDEX), so
    tfdist.runtime.podmain builds TF_CONFIG from TFDIST_CLUSTER where it runs."""
    gpus = spec.gpus_per_worker if role == "worker" else 0
    # threads from --cpu (the pod's limit); without it the task sizes them where it runs (taskenv)
    tf = taskenv.tf_env(tf_config="", task=role, cpu=spec.cpu, cores=None)
    tf.pop("TF_CONFIG")
    tf.pop(ENV_TASK)
    env = [
        *({"name": k, "value": v} for k, v in tf.items()),
        {"name": ENV_CLUSTER, "value": json.dumps(cluster_spec(spec), sort_keys=True)},
        {"name": ENV_AGENT_URL, "value": f"http://{task_host(spec, 'chief-0')}:{names.AGENT_PORT}"},
        {
            "name": ENV_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": f"{spec.name}-token", "key": "token"}},
        },
    ]
    if not gpus:
        env.append(NO_GPU_ENV)
    if role == "chief":
        env.append({"name": ENV_AGENT_PORT, "value": str(names.AGENT_PORT)})
    if role == "chief" and result_wait_s is not None:
        env.append({"name": ENV_RESULT_WAIT_S, "value": f"{result_wait_s:g}"})
    if role == "chief" and ps_comes_back(spec):  # the coordinator pod checkpoints in its own job dir
        env.append({"name": ENV_CHECKPOINT_EVERY, "value": str(spec.checkpoint_every)})
    container: dict[str, Any] = {
        "name": "tensorflow",
        "image": spec.image,
        "command": ["python", "-m", "tfdist.runtime.podmain", role],
        "env": env,
        "ports": [{"name": "tf", "containerPort": TF_PORT}]
        + ([{"name": "agent", "containerPort": names.AGENT_PORT}] if role == "chief" else []),
        "resources": resources(spec, gpus, gpu_resource),
        "securityContext": {  # Pod Security "restricted"
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_spec: dict[str, Any] = {
        "subdomain": spec.name,  # with the headless Service: a stable DNS name per task
        # the Job controller replaces a failed pod (workers: backoffLimitPerIndex); kubelet restarts in
        # place would hide a crash from the Job's accounting
        "restartPolicy": "Never",
        # every entry point ends on SIGTERM at once; this bounds a stuck one, so that a stopped job's pods
        # are gone within seconds (the default grace is 30 s)
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "containers": [container],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }
    if role == "chief":  # Indexed pods get `<job>-<role>-<index>` from the controller
        pod_spec["hostname"] = pod_name(spec, "chief-0")
    if gpus and node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    if gpus and tolerations:
        pod_spec["tolerations"] = list(tolerations)
    meta_labels = labels(spec, "chief-0" if role == "chief" else None)
    meta_labels[L_ROLE] = role
    if queue:
        meta_labels["kueue.x-k8s.io/queue-name"] = queue
    meta: dict[str, Any] = {"labels": meta_labels}
    if role == "ps" and ps_comes_back(spec):
        meta["annotations"] = {A_PS_RESTARTS: str(RestartPolicy.for_spec(spec).limit("ps"))}
    return {"metadata": with_pod_group(meta, spec, queue), "spec": pod_spec}  # one job, one Kueue admission
