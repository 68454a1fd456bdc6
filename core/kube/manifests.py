"""The Jobs of one `%%tfdist` job, and every object its root owns in creation order, as plain dicts.
Pure: no API calls.

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

Its parts: the names, labels and addresses (tfdist.kube.names), the pod of a role (tfdist.kube.podtemplate),
the Services, NetworkPolicy and Secret (tfdist.kube.access).
"""

from __future__ import annotations

from typing import Any

from ..job.restart import RestartPolicy
from ..jobspec import JobSpec
from .access import network_policy, ps_service, secret, service
from .names import A_SPEC, L_ROLE, L_ROOT, object_meta, ps_comes_back, task_job_name
from .podtemplate import GPU_RESOURCE, pod_template

FINISHED_TTL_S = 15  # a finished root (and with it the whole job) is deleted this long after it ends


def _job_meta(spec: JobSpec, role: str, owner: dict | None, queue: str | None) -> dict[str, Any]:
    meta = object_meta(spec, task_job_name(spec, role), owner)
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
