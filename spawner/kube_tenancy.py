"""The Kubernetes spawner's tenancy: what a user's profile allows, as their namespace's quota, admission
parameters and egress (tfdist.kube.tenancy, tfdist.kube.egress).

A mixin of `TfdistKubeSpawner` (tfdist.spawner.kube) apart from its form and queue glue: it reads the
spawner's traits and turns them into one typed `TenantPolicy`, which the spawner converges before each start.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from tornado import web

from tfdist.kube import egress, tenancy
from tfdist.podidentity import PodIdentity

__all__ = ["KubeTenancyMixin"]


class KubeTenancyMixin:
    """`tenant_policy` and the addresses it needs; mixed into TfdistKubeSpawner (traits live there)."""

    # set by the spawner classes this mixes into
    user: Any
    namespace: str
    log: Any
    api: Any
    hub: Any
    egress_api_server: list[str]
    egress_allow: list[dict[str, Any]]
    egress_internet: bool
    egress_deny: list[str]
    allowed_runtime_classes: list[str]
    user_namespace_labels: dict[str, str]
    user_namespace_annotations: dict[str, str]
    gpu_admin_report_url: str
    tfdist_groups: Any
    worker_image: str
    uid: Any
    gid: Any
    fs_gid: Any
    supplemental_gids: Any
    container_security_context: dict[str, Any]
    pod_security_context: dict[str, Any]
    #: `resolve_pod_identity`'s answer for this start (KubeSpawner's traits may be async callables)
    _tfdist_identity: PodIdentity | None = None

    async def resolve_pod_identity(self, required: bool = True) -> PodIdentity | None:
        """Who the notebook runs as (KubeSpawner's uid, gid, fs_gid, supplemental_gids, callables resolved
        as KubeSpawner does), kept for this start: its job pods must run as the same (tfdist.podidentity).
        With `required` (user namespaces), a spawn whose uid or gid is unset (the image's own) is refused:
        the admission policy could not say who job pods may run as; without, that is None (a shared
        namespace, where no policy pins them)."""

        async def value(v: Any) -> Any:
            v = v(self) if callable(v) else v
            return await v if inspect.isawaitable(v) else v

        traits = [await value(t) for t in (self.uid, self.gid, self.fs_gid, self.supplemental_gids)]
        unset = None in self._as_in_pod(*traits)[:2]
        self._tfdist_identity = None if unset and not required else self._identity(*traits)
        return self._tfdist_identity

    def _as_in_pod(self, uid: Any, gid: Any, fs_gid: Any, groups: Any) -> tuple[Any, Any, Any, Any]:
        """(uid, gid, fs_gid, groups) as KubeSpawner builds the notebook pod: its security contexts win over
        the dedicated traits (uid and gid go on the container, whose own context wins over the pod's)."""
        csc, psc = self.container_security_context or {}, self.pod_security_context or {}
        uid = csc.get("runAsUser", uid if uid is not None else psc.get("runAsUser"))
        gid = csc.get("runAsGroup", gid if gid is not None else psc.get("runAsGroup"))
        return uid, gid, psc.get("fsGroup", fs_gid), psc.get("supplementalGroups", groups)

    def _identity(self, *traits: Any) -> PodIdentity:
        """The notebook pod's user and groups (`_as_in_pod`), or the spawn refused with the reason."""
        uid, gid, fs_gid, groups = self._as_in_pod(*traits)
        if uid is None or gid is None:
            why = (
                "the hub's KubeSpawner.uid and .gid must be set (they are None): in user namespaces every "
                "%%tfdist job pod runs as its notebook's user and group, and the admission policy pins them"
            )
            self.log.error("tfdist: %s", why)
            raise web.HTTPError(500, why)
        try:
            return PodIdentity(uid, gid, fs_gid, tuple(groups or ()))
        except ValueError as e:
            raise web.HTTPError(500, f"the hub's KubeSpawner uid/gid/fs_gid/supplemental_gids: {e}") from None

    def pod_identity(self) -> PodIdentity:
        """`known_pod_identity`, where it must be known: unset uid/gid refuse the spawn with the reason."""
        known = self.known_pod_identity()
        if known is not None:
            return known
        traits = (self.uid, self.gid, self.fs_gid, self.supplemental_gids)
        if any(callable(t) for t in traits):
            raise RuntimeError("resolve_pod_identity() first: uid/gid/fs_gid/supplemental_gids are callables")
        return self._identity(*traits)

    def known_pod_identity(self) -> PodIdentity | None:
        """This start's `resolve_pod_identity`, or the traits as they are (plain values) before one ran;
        None where it is not known (callables not yet resolved, or unset: a shared namespace's image user)."""
        if self._tfdist_identity is not None:
            return self._tfdist_identity
        traits = (self.uid, self.gid, self.fs_gid, self.supplemental_gids)
        if any(callable(t) for t in traits) or None in self._as_in_pod(*traits)[:2]:
            return None
        return self._identity(*traits)

    def tenant_policy(self) -> tenancy.TenantPolicy:
        """What the user's profile allows, as the user namespace's quota and admission parameters."""
        cfg = self.tfdist_profiles()
        choice = self.tfdist_choice
        profile = cfg.profile(choice.profile) if choice is not None else None
        if profile is None:  # no valid choice (cannot happen after apply_user_options): allow nothing
            return tenancy.TenantPolicy(
                user=self.user.name,
                namespace=self.namespace,
                gpu_quota={m.resource: 0 for m in cfg.gpu_models.values()},
                pods_quota=1,
                images=(),
                **self._egress_fields(),
            )
        quota = {m.resource: 0 for m in cfg.gpu_models.values()}
        if profile.max_gpus_per_user is not None:
            for key in profile.gpu_models:
                quota[cfg.gpu_models[key].resource] = profile.max_gpus_per_user
        else:  # no per-user cap on the profile's own models
            for key in profile.gpu_models:
                quota.pop(cfg.gpu_models[key].resource, None)
        model_key = (choice.gpu_model if choice else None) or profile.default_model
        model = cfg.gpu_models.get(model_key) if model_key else None
        tolerations = list(self._base()["tolerations"])
        if model is not None:
            tolerations += [t.as_k8s() for t in model.tolerations if t.as_k8s() not in tolerations]
        jobs = profile.jobs
        nb_cpu = profile.cpu.max * profile.cpu.limit_factor
        nb_mem = profile.memory_gib.max * profile.memory_gib.limit_factor
        return tenancy.TenantPolicy(
            user=self.user.name,
            namespace=self.namespace,
            gpu_quota=quota,
            gpu_resource=model.resource if model is not None else "",
            max_gpus_per_pod=profile.gpus.max if model is not None else 0,
            cpu_per_gpu=model.cpu_per_gpu if model is not None else None,
            memory_per_gpu_bytes=(
                None
                if model is None or model.memory_gib_per_gpu is None
                else int(model.memory_gib_per_gpu * 2**30)
            ),
            node_selector=dict(model.node_selector) if model is not None else {},
            tolerations=tolerations,
            required_tolerations=[t.as_k8s() for t in model.tolerations] if model is not None else [],
            queue=profile.kueue_queue or "",
            cpu_quota=None if jobs.cpu is None else jobs.cpu + nb_cpu,
            memory_quota_bytes=None if jobs.memory_gib is None else int((jobs.memory_gib + nb_mem) * 2**30),
            pods_quota=jobs.pods,
            jobs_quota=None if jobs.jobs is None else 3 * jobs.jobs,
            services_quota=None if jobs.jobs is None else 4 * jobs.jobs,
            secrets_quota=None if jobs.jobs is None else jobs.jobs + 16,
            policies_quota=None if jobs.jobs is None else jobs.jobs + 16,
            pvcs_quota=jobs.volume_claims,
            storage_quota_bytes=None if jobs.storage_gib is None else int(jobs.storage_gib * 2**30),
            ephemeral_quota_bytes=None if jobs.local_disk_gib is None else int(jobs.local_disk_gib * 2**30),
            hub_namespace=self._hub_namespace(),
            runtime_classes=list(self.allowed_runtime_classes),
            namespace_labels=self._expand_all(self.user_namespace_labels),
            namespace_annotations=self._expand_all(self.user_namespace_annotations),
            data_volumes=profile.data_mounts,
            identity=self.pod_identity(),
            **self._images(cfg),
            **self._egress_fields(),
        )

    def _images(self, cfg: Any) -> dict[str, Any]:
        """What job pods may run: every image of every profile the user may start (their named servers share
        one namespace and its parameters: the last start must not refuse another server's jobs), and the
        worker image; the profiles' free-form patterns as one (RE2, each group anchored by the policy)."""
        profiles = cfg.allowed_profiles(self.tfdist_groups())
        images = [i.image for p in profiles for i in p.images] + (
            [self.worker_image] if self.worker_image else []
        )
        patterns = dict.fromkeys(p.custom_image.regex for p in profiles if p.custom_image is not None)
        return {
            "images": tuple(dict.fromkeys(images)),
            "image_pattern": "|".join(f"(?:{r})" for r in patterns),
        }

    def _egress_fields(self) -> dict[str, Any]:
        """Where the user namespace's pods may connect beyond it (tfdist.kube.egress): the API server, the
        hub's API (by address where the hub is not in a pod), the GPU admin's report URL if it is an
        address, the admin's extra rules."""
        api = [egress.Endpoint.parse(t) for t in self.egress_api_server]
        if not api:
            own = egress.Endpoint.from_url(self._kube_api_url())
            if own is not None and own.cidr.split("/")[0] != os.environ.get("KUBERNETES_SERVICE_HOST"):
                api = [own]
            else:  # a ClusterIP: the policy sees only the endpoints behind it
                self.log.warning(
                    "tfdist: egress_api_server is not set: %%tfdist in user namespaces cannot reach the "
                    "Kubernetes API server (set it to the endpoints of the `kubernetes` Service)"
                )
        hub_url = getattr(self.hub, "api_url", "") or ""
        hub = [e for e in (egress.Endpoint.from_url(u) for u in (hub_url, self.gpu_admin_report_url)) if e]
        return {
            "egress_api_server": tuple(api),
            "egress_hub": tuple(dict.fromkeys(hub)),
            "hub_port": egress.url_port(hub_url),
            "egress_allow": tuple(dict(r) for r in self.egress_allow),
            "egress_internet": self.egress_internet,
            "egress_deny": tuple(dict.fromkeys((*self.egress_deny, *self._public_node_addresses()))),
        }

    def _node_view(self) -> Any:
        """The hub's watch of the cluster's nodes (the Kubernetes spawner's), None where it keeps none."""
        return None

    def _public_node_addresses(self) -> tuple[str, ...]:
        """The watched nodes' addresses outside the private ranges (a node with a public address: its
        kubelet and host services are not the internet); none where the hub does not watch nodes."""
        view = self._node_view()
        got = view.node_addresses() if view is not None else None
        return egress.public_addresses(got or ())

    def _kube_api_url(self) -> str:
        """The API server URL the hub's own client uses ("" if unknown)."""
        try:
            return str(self.api.api_client.configuration.host or "")
        except AttributeError:
            return ""

    def _hub_namespace(self) -> str:
        """The hub's own namespace (allowed into the user's): the service account's, else POD_NAMESPACE."""
        path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
        if os.path.exists(path):
            with open(path) as f:
                return f.read().strip()
        return os.environ.get("POD_NAMESPACE", "")
