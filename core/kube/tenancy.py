"""A user's own namespace on Kubernetes, as plain dicts. Pure: no API calls (tfdist.kube.apply sends them).

Why: a namespace shared by several users is not a security boundary (a service account that may create
pods there can mount any Secret of it, and can label its pods as anyone's job). So each hub user gets a
namespace that holds their notebook pods and their `%%tfdist` jobs, and in it:

* a ResourceQuota: GPUs per model resource (the profile's ``max_gpus_per_user`` covers the notebook and
  the jobs together; 0 for every GPU resource the profile does not offer), CPU, memory and pod counts
  from the profile's ``jobs`` block;
* a LimitRange, so job pods without ``--cpu``/``--memory`` still count against the quota;
* the notebook's ServiceAccount with a Role of exactly the verbs the Kubernetes backend uses (no patch, no
  get/list of Secrets: it may delete only the job Secrets it names);
* a default-deny ingress NetworkPolicy (each job's own policy then admits its peers);
* ``tfdist-policy``, the parameters of the cluster's ValidatingAdmissionPolicy
  (hub_config/admission-policy.yaml): which GPU resource, node selector, tolerations and Kueue queue pods
  created by the user's service accounts must carry. The user cannot edit it (no configmaps verb).

The namespace is labelled ``tfdist.io/tenant=true`` (the admission policy's binding selects on it) and
Pod Security ``baseline`` (no privileged, hostPath or host-network pods).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import manifests as mf

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
    # created once per job, owned by the root; deleted by name only when a submit is rolled back. Secrets
    # are write-only: never read, never listed
    {"apiGroups": [""], "resources": ["services", "secrets"], "verbs": ["create", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create", "delete"]},
    # the quota check before a job is created, and why the Job controller could not create its pods
    {"apiGroups": [""], "resources": ["resourcequotas", "events"], "verbs": ["list"]},
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


def toleration_key(t: dict[str, Any]) -> str:
    """One toleration as the string the admission policy compares: key|operator|value|effect."""
    return "|".join(
        str(t.get(k) or d) for k, d in (("key", ""), ("operator", "Equal"), ("value", ""), ("effect", ""))
    )


def _meta(name: str, p: TenantPolicy, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": p.namespace, "labels": dict(PART_OF), **extra}


def namespace(p: TenantPolicy) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": p.namespace,
            "labels": {
                **PART_OF,
                L_TENANT: "true",
                mf.L_USER: mf.user_label(p.user),
                "pod-security.kubernetes.io/enforce": "baseline",
            },
        },
    }


def resource_quota(p: TenantPolicy) -> dict[str, Any]:
    hard: dict[str, str] = {f"requests.{r}": str(n) for r, n in sorted(p.gpu_quota.items())}
    if p.cpu_quota is not None:
        hard["requests.cpu"] = hard["limits.cpu"] = f"{round(p.cpu_quota * 1000)}m"
    if p.memory_quota_bytes is not None:
        hard["requests.memory"] = hard["limits.memory"] = str(p.memory_quota_bytes)
    if p.pods_quota is not None:
        hard["pods"] = str(p.pods_quota)
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": _meta(QUOTA, p), "spec": {"hard": hard}}


def limit_range(p: TenantPolicy) -> dict[str, Any]:
    amounts = {"cpu": p.default_cpu, "memory": p.default_memory}
    return {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": _meta(LIMITS, p),
        "spec": {"limits": [{"type": "Container", "default": amounts, "defaultRequest": dict(amounts)}]},
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
            "nodeSelector": "\n".join(f"{k}={v}" for k, v in sorted(p.node_selector.items())),
            "tolerations": "\n".join(toleration_key(t) for t in p.tolerations),
            "requiredTolerations": "\n".join(toleration_key(t) for t in p.required_tolerations),
            "queue": p.queue,
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
        service_account(p),
        role(p),
        role_binding(p),
    ]
