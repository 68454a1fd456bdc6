"""Create-or-update of plain-dict objects through a kubernetes_asyncio ApiClient: idempotent, so the same
call runs on every spawn (and from `scripts/cluster user NAME`) and converges a user's namespace on the
admin's current profile.

Objects are replaced whole (PUT with the live resourceVersion), never patched, so a field a user or an
older version set does not survive; a Namespace keeps its other labels (kubespawner and Pod Security may
add their own) and only gains ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .queueing_apply import Converged, converge_user
from .tenancy import NamespaceTaken, TenantPolicy, owned_by, queue_objects, tenant_objects

if TYPE_CHECKING:
    from ..spawner.profiles import ProfilesConfig

_PATHS = {
    "Namespace": "/api/v1/namespaces",
    "ResourceQuota": "/api/v1/namespaces/{ns}/resourcequotas",
    "LimitRange": "/api/v1/namespaces/{ns}/limitranges",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
}


async def _call(api: Any, method: str, path: str, body: Any = None) -> dict[str, Any]:
    data = await api.call_api(
        path,
        method,
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        body=body,
        response_types_map={200: "object", 201: "object"},
        auth_settings=["BearerToken"],
        _return_http_data_only=True,
    )
    return data if isinstance(data, dict) else {}


async def apply(api: Any, obj: dict[str, Any], policy: TenantPolicy | None = None) -> dict[str, Any]:
    """Create `obj`, or replace the live one of that name with it; a live Namespace only if it is the one
    made for `policy`'s user (else NamespaceTaken, and nothing changes)."""
    from kubernetes_asyncio.client.exceptions import ApiException

    kind, meta = obj["kind"], obj["metadata"]
    collection = _PATHS[kind].format(ns=meta.get("namespace", ""))
    try:
        return await _call(api, "POST", collection, obj)
    except ApiException as exc:
        if exc.status != 409:
            raise
    item = f"{collection}/{meta['name']}"
    live = await _call(api, "GET", item)
    new = {**obj, "metadata": {**meta, "resourceVersion": live["metadata"]["resourceVersion"]}}
    if kind == "Namespace" and (policy is None or not owned_by(live, policy)):
        raise NamespaceTaken(
            f"namespace {meta['name']!r} already exists and was not created by jupyter-tfdist for "
            f"{policy.user if policy else 'this user'!r}: the hub will not take it over (an admin can "
            "delete it, or change the spawner's user_namespace_template)"
        )
    if kind == "Namespace":  # keep labels others set; the spec (finalizers) is the server's
        labels = {**(live["metadata"].get("labels") or {}), **meta.get("labels", {})}
        new = {**live, "metadata": {**live["metadata"], "labels": labels}}
    if kind == "ServiceAccount":  # token secrets and imagePullSecrets the cluster added stay
        new = {**live, "metadata": {**live["metadata"], "labels": meta.get("labels", {})}}
    return await _call(api, "PUT", item, new)


async def prepare_user_namespace(api: Any, policy: TenantPolicy) -> list[dict[str, Any]]:
    """The user's namespace with its quota, limits, account, Role and policies, as the profile says now.

    The spawner calls it before every start; `scripts/cluster user NAME` calls it too."""
    return [await apply(api, obj, policy) for obj in tenant_objects(policy)]


async def prepare_user_queues(
    api: Any, cfg: ProfilesConfig, policy: TenantPolicy, groups: list[str]
) -> Converged:
    """The user's LocalQueues (with their queues' limits) as their profiles say, and the Role that lets
    them read those and their Workloads (tenancy.queue_objects). Run after prepare_user_namespace, only
    when the profiles have a ``kueue:`` section."""
    out = await converge_user(api, cfg, policy.namespace, groups)
    for obj in queue_objects(policy):
        await apply(api, obj, policy)
    return out


async def notebook_token(api: Any, namespace: str, ttl_s: int = 3600) -> str:
    """A short-lived token of the user's notebook service account (TokenRequest)."""
    from .tenancy import NOTEBOOK_SA

    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": ttl_s},
    }
    res = await _call(
        api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{NOTEBOOK_SA}/token", body
    )
    return res["status"]["token"]


def user_kubeconfig(server: str, ca_data_b64: str, token: str, namespace: str, user: str) -> dict[str, Any]:
    """A kubeconfig that acts as `user`'s notebook would (for `scripts/cluster user NAME`): try the
    boundaries of a user namespace by hand with kubectl."""
    name = f"tfdist-{user}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority-data": ca_data_b64}}
        ],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}],
        "current-context": name,
    }


async def setup_user(
    api: Any, user: str, namespace: str, *, server: str, ca_data_b64: str, policy: TenantPolicy | None = None
) -> dict[str, Any]:
    """For `scripts/cluster user NAME`: NAME's namespace prepared exactly as the spawner does (a CPU-only
    policy unless one is given), and a kubeconfig acting as NAME's notebook service account."""
    policy = policy or TenantPolicy(user=user, namespace=namespace, gpu_quota={"nvidia.com/gpu": 0})
    await prepare_user_namespace(api, policy)
    token = await notebook_token(api, namespace)
    return user_kubeconfig(server, ca_data_b64, token, namespace, user)
