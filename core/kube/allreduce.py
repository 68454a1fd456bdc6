"""Every Kubernetes object of an all-reduce (`--strategy allreduce`) job, as plain dicts. Pure.

Built like a PS job (`tfdist.kube.manifests`: the root Job runs chief-0, an Indexed Job the workers, with
the same Service, NetworkPolicy and Secret owned by the root) with three differences:

* no PS Job, and TFDIST_CLUSTER / TFDIST_STRATEGY describe a MultiWorkerMirroredStrategy cluster (chief-0
  and worker-0..N-2: `tf_config.task_names(N, 0, "allreduce")`);
* chief-0 is replica 0: it gets GPUs like every worker (and the GPU node selector), and still runs the
  agent that receives the payload and returns the results once (`podmain allreduce-chief`: the chief
  entry point with its replica sampled for the monitor);
* the workers run the cell too (`podmain allreduce-worker`: payload from the chief's agent, then the
  coordinator program), and a failed worker is not replaced (backoffLimit 0): MWMS cannot take one worker
  back mid-step, so the job ends, as on the local backend.
"""

from __future__ import annotations

import json
from typing import Any

from ..job.restart import RestartPolicy
from ..jobspec import JobSpec
from . import access as ka
from . import manifests as mf
from . import names as kn
from . import podtemplate as pt

STRATEGY = "allreduce"


def _as_replica(
    spec: JobSpec,
    template: dict[str, Any],
    node_selector: dict | None,
    tolerations: list | None,
    gpu_resource: str = pt.GPU_RESOURCE,
) -> None:
    """Turn a PS job's pod template into an all-reduce replica's: cluster, strategy, GPUs."""
    container = template["spec"]["containers"][0]
    cluster = json.dumps(kn.cluster_spec(spec), sort_keys=True)
    values = {"TFDIST_CLUSTER": cluster, "TFDIST_STRATEGY": STRATEGY}
    for e in container["env"]:
        if e["name"] in values:
            e["value"] = values.pop(e["name"])
    container["env"] += [{"name": k, "value": v} for k, v in values.items()]
    container["env"] = [e for e in container["env"] if e != pt.NO_GPU_ENV]
    if not spec.gpus_per_worker:
        container["env"].append(dict(pt.NO_GPU_ENV))
    container["resources"] = pt.resources(spec, spec.gpus_per_worker, gpu_resource)
    if spec.gpus_per_worker and node_selector:
        template["spec"]["nodeSelector"] = dict(node_selector)
    if spec.gpus_per_worker and tolerations:
        template["spec"]["tolerations"] = list(tolerations)


def root_job(
    spec: JobSpec,
    owner: dict | None,
    *,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
    gpu_resource: str = pt.GPU_RESOURCE,
    queue: str | None = None,
    result_wait_s: float | None = None,
    lifeline_s: int | None = None,
    suspend: bool = True,
) -> dict[str, Any]:
    """chief-0: replica 0 and the agent, as the root of everything else."""
    job = mf.root_job(
        spec, owner, queue=queue, result_wait_s=result_wait_s, lifeline_s=lifeline_s, suspend=suspend
    )
    template = job["spec"]["template"]
    _as_replica(spec, template, node_selector, tolerations, gpu_resource)
    # the chief entry point (agent + the cell as replica 0), with its replica sampled like the workers
    template["spec"]["containers"][0]["command"][-1] = "allreduce-chief"
    return job


def worker_job(
    spec: JobSpec,
    root: dict | None,
    *,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
    gpu_resource: str = pt.GPU_RESOURCE,
    queue: str | None = None,
) -> dict[str, Any] | None:
    """Replicas 1..N-1 as one Indexed Job (None for a one-worker job); a failed index fails the job."""
    n = spec.workers - 1
    if n < 1:
        return None
    job = mf.task_job(spec, "worker", root, queue=queue)
    job_spec = job["spec"]
    job_spec["completions"] = job_spec["parallelism"] = n
    for key in ("backoffLimitPerIndex", "maxFailedIndexes", "podFailurePolicy"):
        job_spec.pop(key, None)
    job_spec["backoffLimit"] = RestartPolicy.for_spec(spec).limit("worker")  # 0: never replaced
    template = job_spec["template"]
    _as_replica(spec, template, node_selector, tolerations, gpu_resource)
    template["spec"]["containers"][0]["command"] = [
        "python",
        "-m",
        "tfdist.runtime.podmain",
        "allreduce-worker",
    ]
    return job


def job_objects(
    spec: JobSpec,
    *,
    token: str,
    root: dict | None = None,
    notebook_labels: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
    gpu_resource: str = pt.GPU_RESOURCE,
    queue: str | None = None,
) -> list[dict[str, Any]]:
    """What the root owns, in `manifests.job_objects`' order, without a PS Job."""
    workers = worker_job(
        spec,
        root,
        node_selector=node_selector,
        tolerations=tolerations,
        gpu_resource=gpu_resource,
        queue=queue,
    )
    return [
        *([workers] if workers else []),
        ka.secret(spec, root, token),
        ka.service(spec, root),
        ka.network_policy(spec, root, notebook_labels),
    ]
