"""Every Kubernetes object of one `%%tfdist` job, as plain dicts. Pure: no API calls.

One headless Service gives each task a stable name (`<job>-<task>.<job>.<ns>.svc`); one pod per task
(PS and workers as `tf.distribute.Server`s, the coordinator as its own pod: never the kernel); a
NetworkPolicy admitting the TF port only from the job's own pods and the agent port only from the
notebook pod (TF's gRPC servers run any graph sent to them); a Secret with the job's token; and
ownerReferences to the notebook pod on all of them, so deleting the server deletes its jobs.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from .. import taskenv, tf_config
from ..jobspec import JobSpec

TF_PORT = 2222
AGENT_PORT = 8470
MANAGED_BY = "jupyter-tfdist"
L_JOB = "tfdist.io/job"
L_USER = "tfdist.io/user"
L_TASK = "tfdist.io/task"
L_ROLE = "tfdist.io/role"
L_NOTEBOOK = "tfdist.io/notebook-of"
A_SPEC = "tfdist.io/spec"
GPU_RESOURCE = "nvidia.com/gpu"


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


def _meta(spec: JobSpec, name: str, owner: dict | None, task: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": spec.namespace, "labels": labels(spec, task)}
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def pod_name(spec: JobSpec, task: str) -> str:
    return f"{spec.name}-{task}"


def task_host(spec: JobSpec, task: str) -> str:
    return f"{pod_name(spec, task)}.{spec.name}.{spec.namespace}.svc"


def cluster_spec(spec: JobSpec) -> dict[str, list[str]]:
    addrs: dict[str, list[str]] = {r: [] for r in tf_config.ROLES}
    for task in tf_config.task_names(spec.workers, spec.ps):
        addrs[tf_config.split_task(task)[0]].append(f"{task_host(spec, task)}:{TF_PORT}")
    return tf_config.cluster(addrs)


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


def _resources(spec: JobSpec, gpus: int) -> dict[str, Any]:
    req: dict[str, str] = {}
    lim: dict[str, str] = {}
    if spec.cpu:
        req["cpu"] = lim["cpu"] = f"{int(spec.cpu * 1000)}m"
    if spec.memory_bytes:
        req["memory"] = lim["memory"] = str(spec.memory_bytes)
    if gpus:
        lim[GPU_RESOURCE] = str(gpus)
    out: dict[str, Any] = {}
    if req:
        out["requests"] = req
    if lim:
        out["limits"] = lim
    return out


def task_pod(
    spec: JobSpec,
    task: str,
    owner: dict | None,
    *,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
    service_account: str | None = None,
    queue: str | None = None,
    attempt: int = 0,
) -> dict[str, Any]:
    """One task's pod. A replacement (`attempt` > 0) gets a new name but the same hostname, so the task's
    DNS name does not change and the old pod need not be gone first."""
    role, _ = tf_config.split_task(task)
    gpus = spec.gpus_per_worker if role == "worker" else 0
    # threads from --cpu (the pod's limit); without it the task sizes them where it runs (taskenv)
    tf = taskenv.tf_env(
        tf_config=tf_config.tf_config(cluster_spec(spec), task), task=task, cpu=spec.cpu, cores=None
    )
    env = [
        *({"name": k, "value": v} for k, v in tf.items()),
        {"name": "TFDIST_AGENT_URL", "value": f"http://{task_host(spec, 'chief-0')}:{AGENT_PORT}"},
        {
            "name": "TFDIST_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": f"{spec.name}-token", "key": "token"}},
        },
    ]
    module = "tfdist.runtime.podmain"
    container: dict[str, Any] = {
        "name": "tensorflow",
        "image": spec.image,
        "command": ["python", "-m", module, role],
        "env": env,
        "ports": [{"name": "tf", "containerPort": TF_PORT}]
        + ([{"name": "agent", "containerPort": AGENT_PORT}] if role == "chief" else []),
        "resources": _resources(spec, gpus),
        "securityContext": {  # Pod Security "restricted"
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_spec: dict[str, Any] = {
        "hostname": pod_name(spec, task),
        "subdomain": spec.name,  # with the headless Service: a stable DNS name per task
        # A worker that crashes is restarted in place and TF's coordinator re-sends its work; the PS and
        # the coordinator are not: their loss ends the job (it needs a restart from a checkpoint).
        "restartPolicy": "OnFailure" if role == "worker" else "Never",
        "containers": [container],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if gpus and node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    if gpus and tolerations:
        pod_spec["tolerations"] = list(tolerations)
    meta = _meta(spec, pod_name(spec, task) + (f"-r{attempt}" if attempt else ""), owner, task)
    meta["annotations"] = {A_SPEC: spec.to_json()} if role == "chief" else {}
    if queue:
        meta["labels"]["kueue.x-k8s.io/queue-name"] = queue
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def job_objects(
    spec: JobSpec,
    *,
    token: str,
    owner: dict | None = None,
    notebook_labels: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
    service_account: str | None = None,
    queue: str | None = None,
) -> list[dict[str, Any]]:
    """All objects, in creation order: what the tasks need (Secret, Service, policy) comes first."""
    objs = [secret(spec, owner, token), service(spec, owner), network_policy(spec, owner, notebook_labels)]
    for task in tf_config.task_names(spec.workers, spec.ps):
        objs.append(
            task_pod(
                spec,
                task,
                owner,
                node_selector=node_selector,
                tolerations=tolerations,
                service_account=service_account,
                queue=queue,
            )
        )
    return objs
