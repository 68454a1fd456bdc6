"""Every Kubernetes object of one `%%tfdist` job, as plain dicts. Pure: no API calls.

Kubernetes runs the job, not the kernel (docs/kubernetes.md): the coordinator is a batch/v1 Job
named after the job, the **root**, owned by the notebook pod; the PS and the workers are Indexed Jobs
(`<job>-ps`, `<job>-worker`: stable hostnames `<job>-worker-<i>` under the headless Service, worker
restarts by the Job controller through `backoffLimitPerIndex`); the Service, the NetworkPolicy (the TF
port only from the job's own pods, the agent port also from the notebook pod) and the token Secret are
owned by the root. The root finishing ends the job (`ttlSecondsAfterFinished` then deletes it, and the
garbage collector everything it owns); deleting the notebook pod deletes the root.

The lifeline: while a kernel holds the job it keeps the root's `activeDeadlineSeconds` a grace period ahead
of now (tfdist.backends.kubernetes); a kernel gone for longer lets the deadline pass, the Job controller
ends the job, and the TTL and the garbage collector free everything. A detached job has no deadline.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from .. import taskenv, tf_config
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
    KernelSettings,
)
from .datavolumes import data_volume_parts, with_data_volumes  # noqa: F401 (the job's data volumes)
from .queueing import with_pod_group

TF_PORT = 2222
# the coordinator agent's port; TFDIST_AGENT_PORT in the notebook's environment moves it (the pod is told)
AGENT_PORT = KernelSettings().agent_port
MANAGED_BY = "jupyter-tfdist"
L_JOB = "tfdist.io/job"
L_USER = "tfdist.io/user"
L_TASK = "tfdist.io/task"
L_ROLE = "tfdist.io/role"
L_NOTEBOOK = "tfdist.io/notebook-of"
A_SPEC = "tfdist.io/spec"
L_ROOT = "tfdist.io/root"  # on the root Job only: what list_jobs lists
L_INDEX = "batch.kubernetes.io/job-completion-index"  # set by the Job controller on Indexed pods
# on PS pods of a --checkpoint-every job: a failed PS pod is replaced (tfdist.kube.status: not the job's end)
A_PS_RESTARTS = "tfdist.io/ps-restarts"
GPU_RESOURCE = "nvidia.com/gpu"
FINISHED_TTL_S = 15  # a finished root (and with it the whole job) is deleted this long after it ends
TERMINATION_GRACE_S = 5
# on containers without GPUs: a CUDA image sets NVIDIA_VISIBLE_DEVICES=all, and where the NVIDIA runtime is
# the node's default its toolkit would hand such a container every GPU of the node, counted by no quota (the
# admission policy refuses any other NVIDIA_* variable)
NO_GPU_ENV = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def label_value(text: str) -> str:
    """A string made safe as a label value (63 chars of [A-Za-z0-9-_.], alphanumeric ends)."""
    v = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-_.")
    return v or "none"


def user_label(user: str) -> str:
    """A user as a label value that is readable and one-to-one ("a+b" and "a-b" stay apart)."""
    return f"{label_value(user)[:50]}-{hashlib.sha256(user.encode()).hexdigest()[:8]}".lstrip("-")


def notebook_pod_labels(user: str) -> dict[str, str]:
    """Labels the spawner puts on a user's notebook pod, so that user's job NetworkPolicies can admit it
    (and nobody else's notebook) to the coordinator's agent."""
    return {L_NOTEBOOK: user_label(user)}


def selector(spec: JobSpec) -> dict[str, str]:
    return {L_JOB: spec.name, L_USER: user_label(spec.user)}


def labels(spec: JobSpec, task: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/name": "tfdist-job",
        L_JOB: spec.name,
        L_USER: user_label(spec.user),
    }
    if task:
        out[L_TASK] = task
        out[L_ROLE] = tf_config.split_task(task)[0]
    return out


def owner_reference(pod_name: str, pod_uid: str) -> dict[str, Any]:
    """The notebook pod owns the job: the garbage collector removes the job with the server."""
    # no blockOwnerDeletion: background GC does not need it, and where OwnerReferencesPermissionEnforcement
    # is on it would require `update` on pods/finalizers
    return {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid}


def root_reference(spec: JobSpec, root_uid: str) -> dict[str, Any]:
    """Everything else of the job is owned by its root Job (the coordinator)."""
    return {"apiVersion": "batch/v1", "kind": "Job", "name": spec.name, "uid": root_uid}


def _meta(spec: JobSpec, name: str, owner: dict | None, task: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": spec.namespace, "labels": labels(spec, task)}
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def pod_name(spec: JobSpec, task: str) -> str:
    """A task's hostname (Indexed Job pods are named `<job>-<role>-<index>` by their hostname)."""
    return f"{spec.name}-{task}"


def task_job_name(spec: JobSpec, role: str) -> str:
    return spec.name if role == "chief" else f"{spec.name}-{role}"


def task_host(spec: JobSpec, task: str) -> str:
    """A task's DNS name: its pod's own name under the job's headless Service, except a PS that can come
    back (--checkpoint-every): its own ClusterIP Service (`ps_service`), whose address stays the same when
    the PS Job replaces the pod, so the workers' open channels reach the new pod (kube-proxy) instead of
    the old pod's IP that gRPC would keep until it resolves the name again."""
    if ps_comes_back(spec) and tf_config.split_task(task)[0] == "ps":
        return f"{pod_name(spec, task)}.{spec.namespace}.svc"
    return f"{pod_name(spec, task)}.{spec.name}.{spec.namespace}.svc"


def cluster_spec(spec: JobSpec) -> dict[str, list[str]]:
    addrs: dict[str, list[str]] = {r: [] for r in tf_config.ROLES}
    for task in tf_config.task_names(spec.workers, spec.ps, spec.strategy):
        addrs[tf_config.split_task(task)[0]].append(f"{task_host(spec, task)}:{TF_PORT}")
    return tf_config.cluster(addrs, spec.strategy)


def service(spec: JobSpec, owner: dict | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, spec.name, owner),
        "spec": {
            "clusterIP": "None",
            "selector": selector(spec),
            "publishNotReadyAddresses": True,  # TF must resolve peers before they report ready
            "ports": [{"name": "tf", "port": TF_PORT}, {"name": "agent", "port": AGENT_PORT}],
        },
    }


def ps_service(spec: JobSpec, task: str, owner: dict | None) -> dict[str, Any]:
    """The stable address of one PS of a --checkpoint-every job (see `task_host`)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, pod_name(spec, task), owner),
        "spec": {
            # Indexed Job pods share one template: the Job controller's index label tells them apart
            "selector": selector(spec) | {L_ROLE: "ps", L_INDEX: str(tf_config.split_task(task)[1])},
            "publishNotReadyAddresses": True,  # routed as soon as the TF server's container runs
            "ports": [{"name": "tf", "port": TF_PORT}],
        },
    }


def secret(spec: JobSpec, owner: dict | None, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(spec, f"{spec.name}-token", owner),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def network_policy(
    spec: JobSpec, owner: dict | None, notebook_labels: dict[str, str] | None
) -> dict[str, Any]:
    same_job = {"podSelector": {"matchLabels": selector(spec)}}
    agent_from = [same_job]
    if notebook_labels:
        agent_from.append({"podSelector": {"matchLabels": notebook_labels}})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(spec, spec.name, owner),
        "spec": {
            "podSelector": {"matchLabels": selector(spec)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [same_job], "ports": [{"protocol": "TCP", "port": TF_PORT}]},
                {"from": agent_from, "ports": [{"protocol": "TCP", "port": AGENT_PORT}]},
            ],
        },
    }


def _resources(spec: JobSpec, gpus: int, gpu_resource: str = GPU_RESOURCE) -> dict[str, Any]:
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
        {"name": ENV_AGENT_URL, "value": f"http://{task_host(spec, 'chief-0')}:{AGENT_PORT}"},
        {
            "name": ENV_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": f"{spec.name}-token", "key": "token"}},
        },
    ]
    if not gpus:
        env.append(NO_GPU_ENV)
    if role == "chief":
        env.append({"name": ENV_AGENT_PORT, "value": str(AGENT_PORT)})
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
        + ([{"name": "agent", "containerPort": AGENT_PORT}] if role == "chief" else []),
        "resources": _resources(spec, gpus, gpu_resource),
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


def ps_comes_back(spec: JobSpec) -> bool:
    """--checkpoint-every on a PS job: a lost PS pod is replaced and the coordinator resumes."""
    return RestartPolicy.for_spec(spec).ps_comes_back


def _job_meta(spec: JobSpec, role: str, owner: dict | None, queue: str | None) -> dict[str, Any]:
    meta = _meta(spec, task_job_name(spec, role), owner)
    meta["labels"][L_ROLE] = role
    if queue:
        meta["labels"]["kueue.x-k8s.io/queue-name"] = queue
    return meta


def root_job(
    spec: JobSpec,
    owner: dict | None,
    *,
    queue: str | None = None,
    result_wait_s: float | None = None,
    lifeline_s: int | None = None,
    suspend: bool = True,
) -> dict[str, Any]:
    """The coordinator's Job, the root of everything else. Created suspended (no pod yet) so that a refusal
    of any other object leaves nothing to clean up but objects; `lifeline_s` is the first deadline."""
    meta = _job_meta(spec, "chief", owner, queue)
    meta["labels"][L_ROOT] = "true"
    meta["annotations"] = {A_SPEC: spec.to_json()}
    job_spec: dict[str, Any] = {
        "completions": 1,
        "parallelism": 1,
        "backoffLimit": 0,  # the coordinator holds the fit's state: it is not retried
        "ttlSecondsAfterFinished": FINISHED_TTL_S,
        "suspend": suspend,
        "template": pod_template(spec, "chief", queue=queue, result_wait_s=result_wait_s),
    }
    if lifeline_s is not None:
        job_spec["activeDeadlineSeconds"] = int(lifeline_s)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


def task_job(
    spec: JobSpec,
    role: str,
    root: dict | None,
    *,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
    gpu_resource: str = GPU_RESOURCE,
    queue: str | None = None,
) -> dict[str, Any]:
    """PS or workers: one Indexed Job. A worker index that fails is replaced as often as the job's restart
    policy allows (tfdist.job.restart; TF's coordinator re-sends its work); a failed PS index fails the PS
    Job (its variables are gone), unless --checkpoint-every lets it come back (the policy's PS limit)."""
    n = spec.workers if role == "worker" else spec.ps
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": n,
        "parallelism": n,
        "ttlSecondsAfterFinished": FINISHED_TTL_S,
        "template": pod_template(
            spec,
            role,
            node_selector=node_selector,
            tolerations=tolerations,
            gpu_resource=gpu_resource,
            queue=queue,
        ),
    }
    if role == "worker":
        job_spec["backoffLimitPerIndex"] = RestartPolicy.for_spec(spec).limit("worker")
        job_spec["maxFailedIndexes"] = n
        # replace a worker as soon as its pod is going (the default with backoffLimitPerIndex waits for a
        # terminal phase, which a pod on a lost node may never report)
        job_spec["podReplacementPolicy"] = "TerminatingOrFailed"
    elif ps_comes_back(spec):
        # --checkpoint-every: a lost PS pod comes back at its hostname, and the coordinator pod resumes
        # from its checkpoint (tfdist.runtime.pspod); once a PS has used its restarts the Job fails
        job_spec["backoffLimitPerIndex"] = RestartPolicy.for_spec(spec).limit("ps")
        job_spec["maxFailedIndexes"] = 0
        job_spec["podReplacementPolicy"] = "TerminatingOrFailed"
    else:
        job_spec["backoffLimit"] = 0
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _job_meta(spec, role, root, queue),
        "spec": job_spec,
    }


def job_objects(
    spec: JobSpec,
    *,
    token: str,
    root: dict | None = None,
    notebook_labels: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
    gpu_resource: str = GPU_RESOURCE,
    queue: str | None = None,
) -> list[dict[str, Any]]:
    """What the root owns, in creation order: the workers' Job first (the one an admission policy is most
    likely to refuse), then what the tasks need, then the PS."""
    objs = [
        task_job(
            spec,
            "worker",
            root,
            node_selector=node_selector,
            tolerations=tolerations,
            gpu_resource=gpu_resource,
            queue=queue,
        ),
        secret(spec, root, token),
        service(spec, root),
        network_policy(spec, root, notebook_labels),
    ]
    if spec.ps:
        if ps_comes_back(spec):
            objs += [ps_service(spec, f"ps-{i}", root) for i in range(spec.ps)]
        objs.append(task_job(spec, "ps", root, queue=queue))
    return objs
