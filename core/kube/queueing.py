"""Kueue for `%%tfdist run` jobs, the pure part: the admin's queues (profiles YAML, ``kueue:``) as Kueue's
objects, the pod-group labels that make one job one admission, the refusal of a job no queue can ever
hold (tfdist.kube.queueline, with a job's place in line). No API calls here: tfdist.kube.queueing_apply
does the I/O.

Why pod groups: a job is 2-3 batch Jobs (root, workers, PS). Kueue's batch/Job integration would admit each
Job on its own, so half a job could hold GPUs while the rest waits. Every pod of a job instead carries the
same ``pod-group-name`` and the group's total count; Kueue's pod integration gates each pod at creation
and admits the group only when the quota holds all of it, then lifts every gate at once (docs/queueing.md).

Objects made from the profiles:

* one ResourceFlavor per GPU model a queue names (its ``node_selector`` as the flavor's node labels) and
  ``default`` for CPU, memory and local disk on any node;
* one ClusterQueue per queue, in one cohort, listing every flavor of the cohort (its own quota, 0 for the
  others') so that it can borrow what another queue leaves idle;
* a LocalQueue of the same name in each user's namespace for every queue of the profiles the user may use.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .. import tf_config
from . import preemption
from .queueline import CPU_RESOURCES, DEFAULT_FLAVOR, GIB, Capacity, _parse_quantity, capacities

if TYPE_CHECKING:
    from ..jobspec import JobSpec
    from ..spawner.profiles import ProfilesConfig

API_VERSION = "kueue.x-k8s.io/v1beta2"
L_QUEUE = "kueue.x-k8s.io/queue-name"
L_POD_GROUP = "kueue.x-k8s.io/pod-group-name"
GATE = "kueue.x-k8s.io/admission"  # Kueue's scheduling gate on a pod it has not admitted yet
A_POD_GROUP_TOTAL = "kueue.x-k8s.io/pod-group-total-count"
# "false": the group is over once none of its pods runs (else Kueue waits for replacements of the pods a
# finished job's clean-up deleted, holding the quota); a failed worker the Job controller replaces while
# the others run is still a replacement in the admitted group
A_RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
# on a LocalQueue: its ClusterQueue's capacities (quota + what it may borrow) for the notebook's refusal
A_LIMITS = "tfdist.io/queue-limits"
MANAGED = {"app.kubernetes.io/managed-by": "jupyter-tfdist", "app.kubernetes.io/part-of": "tfdist-queues"}
# Admission Fair Sharing (ClusterQueue admissionScope): a queue's pending jobs are ordered by how much their
# LocalQueue (one user's namespace) used lately, decayed over Kueue's usageHalfLifeTime, then by arrival
FAIR = "UsageBasedAdmissionFairSharing"
NOT_FAIR = "NoAdmissionFairSharing"
# "no cap" as a nominal quota (Kueue needs every requested resource covered): far above any cluster
NO_CAP = {"cpu": "1M", "memory": "1Ei", "ephemeral-storage": "1Ei"}


# ----------------------------------------------------------------------------------- the admin's queues


def _meta(name: str, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(MANAGED)}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _flavor_models(cfg: ProfilesConfig) -> list[str]:
    """GPU model keys any queue has quota for, in gpu_models' order (one ResourceFlavor each)."""
    assert cfg.kueue is not None
    used = {m for q in cfg.kueue.queues.values() for m in q.gpus}
    return [m for m in cfg.gpu_models if m in used]


def resource_flavors(cfg: ProfilesConfig) -> list[dict[str, Any]]:
    if cfg.kueue is None:
        return []
    out = [
        {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": _meta(DEFAULT_FLAVOR), "spec": {}}
    ]
    for key in _flavor_models(cfg):
        model = cfg.gpu_models[key]
        spec: dict[str, Any] = {}
        if model.node_selector:
            spec["nodeLabels"] = dict(model.node_selector)
        out.append(
            {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": _meta(key), "spec": spec}
        )
    return out


def _quantity_cpu(cores: float) -> str:
    return f"{round(cores * 1000)}m"


def cluster_queues(cfg: ProfilesConfig) -> list[dict[str, Any]]:
    if cfg.kueue is None:
        return []
    models = _flavor_models(cfg)
    by_resource: dict[str, list[str]] = {}  # a resource group per GPU resource (nvidia.com/gpu, MIG slices)
    for key in models:
        by_resource.setdefault(cfg.gpu_models[key].resource, []).append(key)
    out = []
    for name, q in cfg.kueue.queues.items():
        caps = {
            "cpu": _quantity_cpu(q.cpu) if q.cpu else None,
            "memory": str(round(q.memory_gib * GIB)) if q.memory_gib else None,
            "ephemeral-storage": None,
        }
        # "no cap" lends nothing (lendingLimit 0): another queue's cap must not grow by borrowing it
        cpu_res = [
            {"name": r, "nominalQuota": v}
            if v
            else {"name": r, "nominalQuota": NO_CAP[r], "lendingLimit": "0"}
            for r, v in caps.items()
        ]
        groups: list[dict[str, Any]] = [
            {
                "coveredResources": list(CPU_RESOURCES),
                "flavors": [{"name": DEFAULT_FLAVOR, "resources": cpu_res}],
            }
        ]
        for resource, keys in by_resource.items():
            flavors = []
            for key in keys:
                quota: dict[str, Any] = {"name": resource, "nominalQuota": str(q.gpus.get(key, 0))}
                if q.borrowing_limit_gpus is not None:
                    quota["borrowingLimit"] = str(q.borrowing_limit_gpus)
                flavors.append({"name": key, "resources": [quota]})
            groups.append({"coveredResources": [resource], "flavors": flavors})
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": "ClusterQueue",
                "metadata": _meta(name),
                "spec": {
                    "cohortName": cfg.kueue.cohort,
                    "namespaceSelector": {},
                    # a job at the head that does not fit yet does not hold back smaller ones behind it
                    "queueingStrategy": "BestEffortFIFO",
                    "resourceGroups": groups,
                    # a queue takes back what it lent; notebooks last (tfdist.kube.preemption)
                    "preemption": preemption.policy(),
                    # said either way, so that turning it off converges too (a missing key is no change)
                    "admissionScope": {"admissionMode": FAIR if q.fair_sharing else NOT_FAIR},
                },
            }
        )
    return out


def cohort(cfg: ProfilesConfig) -> list[dict[str, Any]]:
    if cfg.kueue is None:
        return []
    return [{"apiVersion": API_VERSION, "kind": "Cohort", "metadata": _meta(cfg.kueue.cohort), "spec": {}}]


def cluster_objects(cfg: ProfilesConfig) -> list[dict[str, Any]]:
    """Every cluster-scoped Kueue object of the profiles, in creation order (the notebooks' priority class,
    flavors and the cohort before the queues that name them)."""
    if cfg.kueue is None:
        return []
    return [*preemption.priority_classes(), *resource_flavors(cfg), *cohort(cfg), *cluster_queues(cfg)]


def user_queues(cfg: ProfilesConfig, groups: Iterable[str]) -> list[str]:
    """The queues of the profiles a user of ``groups`` may use (sorted, each once)."""
    if cfg.kueue is None:
        return []
    return sorted({p.kueue_queue for p in cfg.allowed_profiles(groups) if p.kueue_queue})


def local_queues(cfg: ProfilesConfig, namespace: str, groups: Iterable[str]) -> list[dict[str, Any]]:
    """The LocalQueues of one user's namespace: one per queue of the profiles they may use, named like
    the ClusterQueue it feeds (what the profile's ``kueue_queue`` and TFDIST_KUEUE_QUEUE name). Each
    carries its queue's limits (A_LIMITS): a user may not read ClusterQueues, yet the notebook refuses a
    job that can never fit before creating anything."""
    cqs, flavors = cluster_queues(cfg), resource_flavors(cfg)
    out = []
    for name in user_queues(cfg, groups):
        meta = _meta(name, namespace)
        meta["annotations"] = {A_LIMITS: limits_annotation(cqs, flavors, name)}
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": "LocalQueue",
                "metadata": meta,
                "spec": {"clusterQueue": name},
            }
        )
    return out


def limits_annotation(
    cqs: Iterable[Mapping[str, Any]], flavors: Iterable[Mapping[str, Any]], queue: str
) -> str:
    """A queue's capacities and its flavors' node labels as the LocalQueue's annotation (JSON)."""
    caps = [[c.flavor, c.resource, c.nominal, c.borrowable] for c in capacities(cqs, queue)]
    labels = {f["metadata"]["name"]: dict((f.get("spec") or {}).get("nodeLabels") or {}) for f in flavors}
    return json.dumps({"capacities": caps, "flavors": labels}, sort_keys=True, separators=(",", ":"))


def limits_from_annotation(lq: Mapping[str, Any]) -> tuple[list[Capacity], list[dict[str, Any]]] | None:
    """The capacities and ResourceFlavor-shaped flavors a LocalQueue's annotation holds, or None (no
    annotation, or one this version cannot read)."""
    meta = lq.get("metadata") or {}
    text = (meta.get("annotations") or {}).get(A_LIMITS)
    if not text:
        return None
    try:
        d = json.loads(text)
        queue = (lq.get("spec") or {}).get("clusterQueue") or meta.get("name", "")
        caps = [Capacity(queue, str(f), str(r), float(n), float(b)) for f, r, n, b in d["capacities"]]
        flavors = [{"metadata": {"name": k}, "spec": {"nodeLabels": v}} for k, v in d["flavors"].items()]
    except (ValueError, TypeError, KeyError):
        return None
    return caps, flavors


# ---------------------------------------------------------------------------------- one job, one admission


def pod_count(spec: JobSpec) -> int:
    """Pods of one job: the coordinator, the workers and the PS (all-reduce: its replicas)."""
    return len(tf_config.task_names(spec.workers, spec.ps, spec.strategy))


def with_pod_group(meta: dict[str, Any], spec: JobSpec, queue: str | None) -> dict[str, Any]:
    """A job pod template's metadata with Kueue's pod-group label and total count, when the job is queued:
    every pod of the job in one group, admitted all together or not at all. Without a queue: unchanged."""
    if not queue:
        return meta
    labels = {**meta.get("labels", {}), L_QUEUE: queue, L_POD_GROUP: group_name(spec)}
    annotations = {
        **meta.get("annotations", {}),
        A_POD_GROUP_TOTAL: str(pod_count(spec)),
        A_RETRIABLE: "false",
    }
    return {**meta, "labels": labels, "annotations": annotations}


def group_name(spec: JobSpec) -> str:
    """The job's pod group (and Kueue's Workload) name: the job's name, unique in the user's namespace."""
    return spec.name


def covers(desired: Any, live: Any) -> bool:
    """Whether a live object's field already says what ``desired`` says: every key of ``desired`` there
    with the same value, lists item by item, quantities by value ("32000m" is "32"). Fields the API server
    or Kueue's webhook defaulted (flavorFungibility, stopPolicy...) do not count as a difference."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(covers(v, live.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(covers, desired, live))
    if desired == live:
        return True
    if isinstance(desired, str) and isinstance(live, (str, int, float)):
        try:
            return math.isclose(_parse_quantity(desired), _parse_quantity(live))
        except ValueError:
            return False
    return False


def gpu_capacity(cfg: ProfilesConfig, queue: str, model: str) -> Capacity | None:
    """The most GPUs of ``model`` queue ``queue`` can ever hold (quota + what it may borrow), from the
    profiles (what the hub converges), for a notebook server's refusal before anything is created. None
    when the queue has no quota of that model at all (Kueue would leave such a server waiting for ever)."""
    if cfg.kueue is None or model not in cfg.gpu_models:
        return None
    resource = cfg.gpu_models[model].resource
    return next(
        (c for c in capacities(cluster_queues(cfg), queue) if c.flavor == model and c.resource == resource),
        None,
    )
