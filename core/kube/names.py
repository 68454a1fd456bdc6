"""What identifies a job's Kubernetes objects: label keys, names, selectors, owner references and each
task's address. Pure: no API calls.

Why apart from the objects: the watch (tfdist.kube.status, podfold), the backend's list and attach, the
tenancy and the spawner find a job's objects by these names alone, without building any object.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from .. import tf_config
from ..job.restart import RestartPolicy
from ..jobspec import JobSpec
from ..settings import KernelSettings

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


def object_meta(spec: JobSpec, name: str, owner: dict | None, task: str | None = None) -> dict[str, Any]:
    """The metadata every object of the job carries: its name, namespace, labels and owner."""
    meta: dict[str, Any] = {"name": name, "namespace": spec.namespace, "labels": labels(spec, task)}
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def pod_name(spec: JobSpec, task: str) -> str:
    """A task's hostname (Indexed Job pods are named `<job>-<role>-<index>` by their hostname)."""
    return f"{spec.name}-{task}"


def task_job_name(spec: JobSpec, role: str) -> str:
    return spec.name if role == "chief" else f"{spec.name}-{role}"


def ps_comes_back(spec: JobSpec) -> bool:
    """--checkpoint-every on a PS job: a lost PS pod is replaced and the coordinator resumes."""
    return RestartPolicy.for_spec(spec).ps_comes_back


def task_host(spec: JobSpec, task: str) -> str:
    """A task's DNS name: its pod's own name under the job's headless Service, except a PS that can come
    back (--checkpoint-every): its own ClusterIP Service (`access.ps_service`), whose address stays the
    same when the PS Job replaces the pod, so the workers' open channels reach the new pod (kube-proxy)
    instead of the old pod's IP that gRPC would keep until it resolves the name again."""
    if ps_comes_back(spec) and tf_config.split_task(task)[0] == "ps":
        return f"{pod_name(spec, task)}.{spec.namespace}.svc"
    return f"{pod_name(spec, task)}.{spec.name}.{spec.namespace}.svc"


def cluster_spec(spec: JobSpec) -> dict[str, list[str]]:
    """Every task's address, by role: what TFDIST_CLUSTER tells each pod."""
    addrs: dict[str, list[str]] = {r: [] for r in tf_config.ROLES}
    for task in tf_config.task_names(spec.workers, spec.ps, spec.strategy):
        addrs[tf_config.split_task(task)[0]].append(f"{task_host(spec, task)}:{TF_PORT}")
    return tf_config.cluster(addrs, spec.strategy)
