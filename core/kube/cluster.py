"""The API calls of the Kubernetes backend on a job's objects: create, read, update (never patch) and delete
them, list their pods, and read the namespace's quota. No job logic: `tfdist.backends.kubernetes` decides,
this module talks to the API server (kubernetes_asyncio), and answers as plain JSON dicts (what watch
events carry too), so the pure derivations in tfdist.kube.status read one shape."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ..errors import BackendUnavailable
from ..jobspec import JobSpec
from .api_errors import quantity, quota_sentence

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def current_namespace(configured: str | None) -> str:
    """The configured namespace, else the pod's own (in-cluster), else "default"."""
    if configured:
        return configured
    with contextlib.suppress(OSError):
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip()
    return "default"


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def job_resources(spec: JobSpec, gpu_resource: str) -> dict[str, float]:
    """What a job adds to its namespace's quota, keyed as ResourceQuota keys its `hard` limits."""
    need: dict[str, float] = {"pods": spec.task_count}
    if spec.gpus_per_worker:
        need[f"requests.{gpu_resource}"] = spec.workers * spec.gpus_per_worker
    if spec.cpu:
        need["requests.cpu"] = need["limits.cpu"] = spec.cpu * spec.task_count
    if spec.memory_bytes:
        need["requests.memory"] = need["limits.memory"] = spec.memory_bytes * spec.task_count
    return need


def quota_shortfall(need: dict[str, float], quotas: list[dict[str, Any]]) -> str | None:
    """The sentence that refuses a job the quotas cannot admit now, or None. Pure: quotas as dicts."""
    for q in quotas:
        hard = (q.get("status") or {}).get("hard") or (q.get("spec") or {}).get("hard") or {}
        used = (q.get("status") or {}).get("used") or {}
        for res, amount in need.items():
            if res not in hard:
                continue
            limit, now = quantity(hard[res]), quantity(used.get(res, "0"))
            if now + amount > limit:
                what = res.removeprefix("requests.").removeprefix("limits.")
                fmt = (lambda v: f"{v / 2**30:g} GiB") if what == "memory" else (lambda v: f"{v:g}")
                return (
                    f"the job would exceed your quota of {what}: it needs {fmt(amount)}, "
                    f"{fmt(now)} of {fmt(limit)} are in use (your notebook servers count too); "
                    "ask for less or stop another job"
                )
    return None


class KubeApi:
    """One API client per backend (kernel), made on first use: in-cluster config inside a pod without a
    kubeconfig, the kubeconfig otherwise."""

    def __init__(self, kubeconfig: str | None = None):
        self.kubeconfig = kubeconfig
        self._api: Any = None

    async def api(self) -> Any:
        if self._api is None:
            from kubernetes_asyncio import client, config

            cfg = client.Configuration()
            if os.path.exists(SA_NAMESPACE_FILE) and not self.kubeconfig:
                config.load_incluster_config(client_configuration=cfg)
            else:
                await config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
            self._api = client.ApiClient(cfg)
        return self._api

    async def core(self) -> Any:
        from kubernetes_asyncio import client

        return client.CoreV1Api(await self.api())

    async def batch(self) -> Any:
        from kubernetes_asyncio import client

        return client.BatchV1Api(await self.api())

    async def to_dict(self, obj: Any) -> dict[str, Any]:
        return (await self.api()).sanitize_for_serialization(obj)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    # ------------------------------------------------------------------ objects
    async def create(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Create one of a job's objects (the kinds a job has); the created object as a dict. `dry_run`:
        through validation, admission and quota, and nothing stored."""
        from kubernetes_asyncio import client

        api = await self.api()
        ns, kind = obj["metadata"]["namespace"], obj["kind"]
        core = client.CoreV1Api(api)
        create = {
            "Job": client.BatchV1Api(api).create_namespaced_job,
            "NetworkPolicy": client.NetworkingV1Api(api).create_namespaced_network_policy,
            "Service": core.create_namespaced_service,
            "Secret": core.create_namespaced_secret,
        }[kind]
        out = await self.to_dict(await create(ns, obj, **({"dry_run": "All"} if dry_run else {})))
        out.setdefault("kind", kind)
        return out

    async def delete(self, kind: str, name: str, ns: str) -> bool:
        """Delete one object by name (Jobs with their pods, in the background); False if it was gone."""
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        api = await self.api()
        core = client.CoreV1Api(api)
        body = {"propagationPolicy": "Background", "gracePeriodSeconds": 0}
        delete = {
            "Job": lambda: client.BatchV1Api(api).delete_namespaced_job(name, ns, body=body),
            "NetworkPolicy": lambda: client.NetworkingV1Api(api).delete_namespaced_network_policy(name, ns),
            "Service": lambda: core.delete_namespaced_service(name, ns),
            "Secret": lambda: core.delete_namespaced_secret(name, ns),
        }[kind]
        try:
            await delete()
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def read_job(self, name: str, ns: str) -> dict[str, Any] | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await self.to_dict(await (await self.batch()).read_namespaced_job(name, ns))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def replace_job(
        self, job: dict[str, Any], keep: tuple[str, ...], attempts: int = 5
    ) -> dict[str, Any]:
        """PUT a Job (update, never patch); on a conflict (a controller wrote its status in between) apply
        the same values of the spec fields in `keep` to the live object."""
        from kubernetes_asyncio.client.exceptions import ApiException

        batch = await self.batch()
        name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
        want = {k: job["spec"].get(k) for k in keep}
        for _ in range(attempts):
            try:
                return await self.to_dict(await batch.replace_namespaced_job(name, ns, job))
            except ApiException as exc:
                if exc.status != 409:
                    raise
            job = await self.to_dict(await batch.read_namespaced_job(name, ns))
            job["spec"].update({k: v for k, v in want.items() if v is not None})
        raise BackendUnavailable(f"could not update Job {name!r}: it kept changing")

    async def list_pods(self, ns: str, selector: str) -> dict[str, Any]:
        """A pod list as plain JSON dicts; API errors raise."""
        return await self.to_dict(await (await self.core()).list_namespaced_pod(ns, label_selector=selector))

    async def list_root_jobs(self, ns: str, selector: str) -> list[str]:
        jobs = (await (await self.batch()).list_namespaced_job(ns, label_selector=selector)).items
        return [j.metadata.name for j in jobs]

    async def list_job_objects(self, ns: str, selector: str) -> list[dict[str, Any]]:
        answer = await (await self.batch()).list_namespaced_job(ns, label_selector=selector)
        return (await self.to_dict(answer)).get("items") or []

    async def pod_log(self, ns: str, pod: str, tail: int | None = None) -> str:
        kw = {"tail_lines": tail} if tail else {}
        return await (await self.core()).read_namespaced_pod_log(pod, ns, **kw)

    # ------------------------------------------------------------------ quota and refusals
    async def quotas(self, ns: str) -> list[dict[str, Any]] | None:
        """The namespace's ResourceQuotas, or None without the right to read them (a shared namespace:
        the cluster still enforces them)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            body = await (await self.core()).list_namespaced_resource_quota(ns)
        except ApiException:
            return None
        return (await self.to_dict(body)).get("items") or []

    async def creation_problems(self, ns: str, job_names: tuple[str, ...]) -> str:
        """Why the Job controller made no pods (a quota raced past the kernel's check, an admission policy):
        the FailedCreate events of these Jobs, as one line."""
        try:
            evs = await (await self.core()).list_namespaced_event(ns, field_selector="reason=FailedCreate")
        except Exception:
            return ""
        msgs = []
        for e in evs.items:
            obj = e.involved_object
            if obj and obj.kind == "Job" and obj.name in job_names:
                msg = e.message or ""
                msgs.append(quota_sentence(msg) if "exceeded quota" in msg else msg)
        return "; ".join(dict.fromkeys(msgs))
