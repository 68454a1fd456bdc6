"""A user's own namespace on Kubernetes, as plain dicts. Pure: no API calls (tfdist.kube.apply sends them).

Why: a namespace shared by several users is not a security boundary (a service account that may create
pods there can mount any Secret of it, and can label its pods as anyone's job). So each hub user gets a
namespace that holds their notebook pods and their `%%tfdist` jobs, and in it:

* a ResourceQuota: GPUs per model resource (the profile's ``max_gpus_per_user`` covers the notebook and
  the jobs together; 0 for every GPU resource the profile does not offer), CPU, memory, local disk,
  volume claims and object counts (pods, Jobs, Services, Secrets, NetworkPolicies) from the profile's
  ``jobs`` block, whose defaults are caps too: nothing a user creates is unbounded;
* a LimitRange, so job pods without ``--cpu``/``--memory`` still count against the quota;
* the notebook's ServiceAccount with a Role of exactly the verbs the Kubernetes backend uses (no patch, no
  get/list of Secrets: it may delete only the job Secrets it names);
* a default-deny ingress NetworkPolicy (each job's own policy then admits its peers), and a default
  egress policy: the namespace, DNS, the API server, the hub and the internet, nothing else in private
  ranges (tfdist.kube.egress);
* ``tfdist-policy``, the parameters of the cluster's ValidatingAdmissionPolicy
  (hub_config/admission-policy.yaml): which GPU resource, node selector, tolerations and Kueue queue pods
  created by the user's service accounts must carry, and the only volume claims they may mount: the
  profile's data volumes (read-only ones only read-only), and the user and groups they run as (the
  notebook's: tfdist.podidentity). The user cannot edit it (no configmaps verb).

The namespace is labelled ``tfdist.io/tenant=true`` (the admission policy's binding selects on it), with
the user it was made for, and Pod Security ``restricted`` (non-root, no capabilities such as NET_RAW that
would let a pod spoof its neighbours on the node's bridge, RuntimeDefault seccomp). A namespace of that
name that jupyter-tfdist did not create for this very user is never taken over (`owned_by`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..datamounts import DataMount
from ..podidentity import DEFAULT as DEFAULT_IDENTITY
from ..podidentity import PodIdentity
from . import names as kn
from .egress import DEFAULT_HUB_PORT, Endpoint, default_egress

NOTEBOOK_SA = "tfdist-notebook"
QUOTA = "tfdist-quota"
LIMITS = "tfdist-limits"
POLICY_PARAMS = "tfdist-policy"
DENY_POLICY = "tfdist-default-deny"
L_TENANT = "tfdist.io/tenant"
PART_OF = {"app.kubernetes.io/part-of": "jupyter-tfdist"}
# tolerations the API server adds to every pod itself (DefaultTolerationSeconds): always allowed
IMPLICIT_TOLERATION_KEYS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")

# What the Kubernetes backend (tfdist.backends.kubernetes) calls, and nothing more. Tested with the
# account's own token (tests/test_k8s_tenancy.py): every verb here is used, every other one is refused.
NOTEBOOK_RULES: list[dict[str, Any]] = [
    # the job's Jobs: created (the root suspended, then resumed), the root's deadline renewed (the lifeline:
    # update, never patch), listed for %tfdist list, deleted (the garbage collector takes the rest)
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "create", "update", "delete"]},
    # read-only: the Job controller creates the pods; the notebook watches them and reads their logs
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    # created once per job, owned by the root; deleted by name only when a submit is rolled back (the
    # admission policy refuses deleting any the user's jobs do not own: the hub's default policies stay).
    # Secrets are write-only: never read, never listed
    {"apiGroups": [""], "resources": ["services", "secrets"], "verbs": ["create", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create", "delete"]},
    # the quota check before a job is created, and why the Job controller could not create its pods
    {"apiGroups": [""], "resources": ["resourcequotas", "events"], "verbs": ["list"]},
]
# The user's place in Kueue's line (tfdist.kube.queueing_apply): their LocalQueue (and the limits the hub
# wrote on it: a job that can never fit is refused before it is created) and their own Workloads. Read
# only: Workloads, LocalQueues and ClusterQueues are Kueue's and the hub's to write, or a user could
# admit their own job past the quota. Harmless where Kueue is not installed.
QUEUE_ROLE = "tfdist-queue-reader"
QUEUE_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "verbs": ["get"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["get", "list"]},
    # Kueue's visibility API: their LocalQueue's pending jobs, placed in the whole ClusterQueue (other
    # users' jobs counted); not clusterqueues/pendingworkloads, which names every team's jobs (v0.17.0's
    # LocalQueue answer names those of other namespaces' same-named LocalQueues: docs/security.md)
    {
        "apiGroups": ["visibility.kueue.x-k8s.io"],
        "resources": ["localqueues/pendingworkloads"],
        "verbs": ["get"],
    },
]


@dataclass(frozen=True)
class TenantPolicy:
    """What an admin's profile allows one user, in Kubernetes terms (built by the spawner)."""

    user: str
    namespace: str
    #: requests.<resource> quota per GPU resource; a resource the profile does not offer is 0
    gpu_quota: dict[str, int] = field(default_factory=dict)
    #: the one GPU resource pods may request (the chosen model's), "" for none
    gpu_resource: str = ""
    max_gpus_per_pod: int = 0
    #: a node's share per GPU of the model (GpuModel.cpu_per_gpu): a GPU pod's CPUs and memory, at most
    #: this many per GPU, so one pod cannot keep its node's other GPUs from everyone (None: no bound)
    cpu_per_gpu: float | None = None
    memory_per_gpu_bytes: int | None = None
    #: labels every GPU pod's nodeSelector must carry (the model's)
    node_selector: dict[str, str] = field(default_factory=dict)
    #: the only tolerations pods may carry (admin base + model), besides the API server's implicit ones
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    #: the tolerations every GPU pod must carry (the model's)
    required_tolerations: list[dict[str, Any]] = field(default_factory=list)
    #: Kueue LocalQueue every job pod must name ("" for none)
    queue: str = ""
    cpu_quota: float | None = None  # cores, limits.cpu and requests.cpu
    memory_quota_bytes: int | None = None
    pods_quota: int | None = None
    default_cpu: str = "1"
    default_memory: str = "2Gi"
    #: the hub's namespace: its proxy and hub pods (z2jh label hub.jupyter.org/network-access-singleuser)
    #: may reach notebook servers through the default deny; "" admits nobody
    hub_namespace: str = ""
    notebook_port: int = 8888
    #: RuntimeClasses pods may name (none: the cluster's default runtime only)
    runtime_classes: list[str] = field(default_factory=list)
    #: object counts and local storage: each is a cap of the quota (None: no cap on it)
    jobs_quota: int | None = 48  # batch Jobs: a %%tfdist job has 2 or 3
    services_quota: int | None = 64
    secrets_quota: int | None = 32
    #: jobs' own ingress policies (one each, kept a while after the job: its TTL, a detached job's results;
    #: slack as for Secrets); the hub's own (HUB_POLICIES) are added to the quota's cap
    policies_quota: int | None = 32
    pvcs_quota: int | None = 4
    storage_quota_bytes: int | None = 100 * 2**30  # requests.storage of the claims
    ephemeral_quota_bytes: int | None = 100 * 2**30  # requests and limits of local disk
    default_ephemeral_request: str = "256Mi"
    default_ephemeral_limit: str = "4Gi"
    #: egress (tfdist.kube.egress): the API server's endpoints (kube-proxy's DNAT targets of the
    #: `kubernetes` Service), the hub's API where it runs outside pods (by address), the hub's API port
    #: in `hub_namespace`, the admin's extra rules, and the public internet; nothing else off the namespace
    egress_api_server: tuple[Endpoint, ...] = ()
    egress_hub: tuple[Endpoint, ...] = ()
    hub_port: int = DEFAULT_HUB_PORT
    egress_allow: tuple[dict[str, Any], ...] = ()
    egress_internet: bool = True
    egress_deny: tuple[str, ...] = ()  # IPv4 CIDRs the internet rule leaves out (tfdist.kube.egress)
    #: the profile's data volumes: the only claims job pods may mount (tfdist.datamounts)
    data_volumes: tuple[DataMount, ...] = ()
    #: who the notebook runs as: every job pod must run as exactly this user and these groups (the data
    #: volumes are shared: tfdist.podidentity)
    identity: PodIdentity = DEFAULT_IDENTITY
    #: the only images job pods may run: the profile's list and the worker image, exactly, and what its
    #: free-form pattern (`custom_image.regex`, RE2 syntax) matches whole; None: any image
    images: tuple[str, ...] | None = None
    image_pattern: str = ""
    #: labels and annotations the admin asked for (KubeSpawner's user_namespace_labels/annotations)
    namespace_labels: dict[str, str] = field(default_factory=dict)
    namespace_annotations: dict[str, str] = field(default_factory=dict)


POD_SECURITY = "restricted"


class NamespaceTaken(Exception):
    """A namespace of the user's name exists and is not one jupyter-tfdist made for this user."""


def toleration_key(t: dict[str, Any]) -> str:
    """One toleration as the string the admission policy compares: key|operator|value|effect."""
    return "|".join(
        str(t.get(k) or d) for k, d in (("key", ""), ("operator", "Equal"), ("value", ""), ("effect", ""))
    )


def _meta(name: str, p: TenantPolicy, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": p.namespace, "labels": dict(PART_OF), **extra}


def namespace(p: TenantPolicy) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": p.namespace,
        "labels": {
            **p.namespace_labels,
            **PART_OF,
            L_TENANT: "true",
            kn.L_USER: kn.user_label(p.user),
            "pod-security.kubernetes.io/enforce": POD_SECURITY,
            "pod-security.kubernetes.io/enforce-version": "latest",
        },
    }
    if p.namespace_annotations:
        meta["annotations"] = dict(p.namespace_annotations)
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def owned_by(live: dict[str, Any], p: TenantPolicy) -> bool:
    """Whether an existing namespace is the one jupyter-tfdist made for `p.user`: only then does the hub
    converge it (a user name that maps onto kube-system or another team's namespace gets nothing there)."""
    labels = (live.get("metadata") or {}).get("labels") or {}
    return labels.get(L_TENANT) == "true" and labels.get(kn.L_USER) == kn.user_label(p.user)


HUB_POLICIES = 3  # the default deny, the notebook's ingress and the egress limits (tenant_objects)


KEPT_PODS_FACTOR = 4  # pods a namespace may keep, finished ones included, per pod it may run


def resource_quota(p: TenantPolicy) -> dict[str, Any]:
    hard: dict[str, str] = {f"requests.{r}": str(n) for r, n in sorted(p.gpu_quota.items())}
    if p.cpu_quota is not None:
        hard["requests.cpu"] = hard["limits.cpu"] = f"{round(p.cpu_quota * 1000)}m"
    if p.memory_quota_bytes is not None:
        hard["requests.memory"] = hard["limits.memory"] = str(p.memory_quota_bytes)
    if p.pods_quota is not None:
        hard["pods"] = str(p.pods_quota)
        # `pods` counts running pods only: the Job controller keeps every finished one (each retry of each
        # task) until its Job is deleted, and PodGC then deletes the cluster's oldest finished pods,
        # other users' included. Pods in every phase, so a user's finished ones stay theirs to bound
        hard["count/pods"] = str(KEPT_PODS_FACTOR * p.pods_quota)
    counts = {
        "count/jobs.batch": p.jobs_quota,
        "services": p.services_quota,
        "secrets": p.secrets_quota,
        "count/networkpolicies.networking.k8s.io": (
            None if p.policies_quota is None else p.policies_quota + HUB_POLICIES
        ),
        "persistentvolumeclaims": p.pvcs_quota,
        "requests.storage": p.storage_quota_bytes,
        "requests.ephemeral-storage": p.ephemeral_quota_bytes,
        "limits.ephemeral-storage": p.ephemeral_quota_bytes,
    }
    hard.update({k: str(v) for k, v in counts.items() if v is not None})
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": _meta(QUOTA, p), "spec": {"hard": hard}}


def limit_range(p: TenantPolicy) -> dict[str, Any]:
    limits = {"cpu": p.default_cpu, "memory": p.default_memory}
    requests = dict(limits)
    if p.ephemeral_quota_bytes is not None:  # a quota on it refuses pods that do not say theirs
        limits["ephemeral-storage"] = p.default_ephemeral_limit
        requests["ephemeral-storage"] = p.default_ephemeral_request
    return {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": _meta(LIMITS, p),
        "spec": {"limits": [{"type": "Container", "default": limits, "defaultRequest": requests}]},
    }


def service_account(p: TenantPolicy) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(NOTEBOOK_SA, p)}


def role(p: TenantPolicy) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(NOTEBOOK_SA, p),
        "rules": [dict(r) for r in NOTEBOOK_RULES],
    }


def queue_role(p: TenantPolicy) -> dict[str, Any]:
    """Read-only on Kueue in the user's namespace (QUEUE_RULES): a Role of its own, so that the notebook's
    Role stays exactly what the backend writes with (rbac-notebook.yaml)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(QUEUE_ROLE, p),
        "rules": [dict(r) for r in QUEUE_RULES],
    }


def queue_role_binding(p: TenantPolicy) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(QUEUE_ROLE, p),
        "subjects": [{"kind": "ServiceAccount", "name": NOTEBOOK_SA, "namespace": p.namespace}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": QUEUE_ROLE},
    }


def role_binding(p: TenantPolicy) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(NOTEBOOK_SA, p),
        "subjects": [{"kind": "ServiceAccount", "name": NOTEBOOK_SA, "namespace": p.namespace}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NOTEBOOK_SA},
    }


def default_deny(p: TenantPolicy) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(DENY_POLICY, p),
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    }


def notebook_ingress(p: TenantPolicy) -> dict[str, Any]:
    """The one way into the namespace besides a job's own policy: the hub and its proxy to notebooks."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta("tfdist-notebook-ingress", p),
        "spec": {
            "podSelector": {"matchLabels": {"component": "singleuser-server"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": p.hub_namespace}
                            },
                            "podSelector": {
                                "matchLabels": {"hub.jupyter.org/network-access-singleuser": "true"}
                            },
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": p.notebook_port}],
                }
            ],
        },
    }


def policy_params(p: TenantPolicy) -> dict[str, Any]:
    """Parameters of hub_config/admission-policy.yaml, one string per key (CEL splits them)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(POLICY_PARAMS, p),
        "data": {
            "gpuResource": p.gpu_resource,
            "gpuResources": ",".join(sorted(set(p.gpu_quota) | ({p.gpu_resource} - {""}))),
            "maxGpusPerPod": str(p.max_gpus_per_pod),
            # a container without a CPU or memory limit gets the LimitRange's default, counted as such
            "cpuPerGpu": "" if p.cpu_per_gpu is None else f"{p.cpu_per_gpu:.15g}",
            "memoryPerGpu": "" if p.memory_per_gpu_bytes is None else str(p.memory_per_gpu_bytes),
            "defaultCpu": p.default_cpu,
            "defaultMemory": p.default_memory,
            "nodeSelector": "\n".join(f"{k}={v}" for k, v in sorted(p.node_selector.items())),
            "tolerations": "\n".join(toleration_key(t) for t in p.tolerations),
            "requiredTolerations": "\n".join(toleration_key(t) for t in p.required_tolerations),
            "queue": p.queue,
            "runtimeClasses": "\n".join(p.runtime_classes),
            "dataClaims": "\n".join(sorted({m.claim for m in p.data_volumes})),
            "readOnlyClaims": "\n".join(sorted({m.claim for m in p.data_volumes if m.read_only})),
            # the notebook's user and groups: a job pod may run as no other (the shared data volumes)
            "runAsUser": str(p.identity.run_as_user),
            "runAsGroup": str(p.identity.run_as_group),
            "fsGroup": "" if p.identity.fs_group is None else str(p.identity.fs_group),
            "supplementalGroups": "\n".join(str(g) for g in p.identity.supplemental_groups),
            # the images the profile offers: what an image a user built could do (groups of its own in
            # /etc/group, tens of gigabytes on every node's disk) stays out, as do other users' private
            # images cached on a node (absent: any image)
            **({} if p.images is None else {"images": "\n".join(p.images), "imagePattern": p.image_pattern}),
            # a Job's tasks (its parallelism, = completions): no more than the namespace may run at once
            "maxTasks": "" if p.pods_quota is None else str(p.pods_quota),
        },
    }


def tenant_objects(p: TenantPolicy) -> list[dict[str, Any]]:
    """Everything in creation order: the namespace first, the service account before its binding."""
    return [
        namespace(p),
        resource_quota(p),
        limit_range(p),
        policy_params(p),
        default_deny(p),
        *([notebook_ingress(p)] if p.hub_namespace else []),
        default_egress(p),
        service_account(p),
        role(p),
        role_binding(p),
    ]


def queue_objects(p: TenantPolicy) -> list[dict[str, Any]]:
    """The user's read access to their place in Kueue's line, where the profiles queue jobs (applied with
    the LocalQueues by tfdist.kube.apply.prepare_user_queues, not with the namespace: no Kueue, no Role)."""
    return [queue_role(p), queue_role_binding(p)]
