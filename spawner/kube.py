"""The Kubernetes spawner: the tfdist GPU form on KubeSpawner.

What a valid choice becomes on the pod: tfdist.spawner.kube_pod. Each user gets their own namespace by
default (``enable_user_namespaces``): before every start the spawner creates or updates it from the user's
profile (tfdist.spawner.kube_tenancy, tfdist.kube.tenancy: quota, limits, the notebook's service account and
Role, default-deny ingress, default egress (tfdist.kube.egress), the admission policy's parameters). A
namespace shared by several users is possible only by setting ``enable_user_namespaces = False`` explicitly,
and is not a security boundary (docs/security.md, "Isolation between users").

kubespawner's own ``profile_list`` is not used; `load_user_options` is a no-op because validation and
application already happened in ``apply_user_options`` (which, unlike kubespawner's, answers bad REST input
with a 400 instead of a KeyError/500).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from kubespawner import KubeSpawner
from tornado import web
from traitlets import Bool, Dict, Integer, List, TraitError, Unicode, default, validate

from tfdist import settings
from tfdist.kube import egress, tenancy
from tfdist.kube.apply import prepare_user_namespace, prepare_user_queues
from tfdist.kube.queueing import GATE, L_QUEUE
from tfdist.podidentity import DEFAULT as DEFAULT_IDENTITY

from .allocator import ModelAvailability
from .availability import ClusterGpuView
from .base import GpuFormMixin
from .kube_data import data_claims_refusal
from .kube_pod import KubePodMixin
from .kube_tenancy import KubeTenancyMixin
from .profiles import ProfilesConfig

__all__ = ["TfdistKubeSpawner", "shared_gpu_view"]

_view: ClusterGpuView | None = None
# the cluster-wide Kueue objects this hub process last converged, per API server (JSON), and the lock that
# keeps two first spawns from converging them at once
_queues_converged: dict[str, str] = {}
_queues_lock = asyncio.Lock()


# Workloads waiting per Kueue queue, as last read (monotonic time, counts): the form reads ClusterQueues at
# most once per QUEUE_LINE_TTL_S per hub, however many users open it
QUEUE_LINE_TTL_S = 5.0
_queue_line: dict[str, tuple[float, dict[str, int] | None]] = {}


def shared_gpu_view() -> ClusterGpuView:
    """The hub's one cluster view (started on first use, on the hub's event loop)."""
    global _view
    if _view is None:
        from kubespawner.clients import shared_client

        _view = ClusterGpuView(shared_client("CoreV1Api"))
        _view.start()
    return _view


class TfdistKubeSpawner(KubePodMixin, GpuFormMixin, KubeTenancyMixin, KubeSpawner):
    """KubeSpawner with the tfdist profiles form, strict validation and live GPU availability."""

    worker_image = Unicode(
        "",
        config=True,
        help="Image of %%tfdist parameter-server/worker pods (TFDIST_WORKER_IMAGE); default: the server's.",
    )
    gpu_availability_enabled = Bool(
        True,
        config=True,
        help="""Watch nodes and pods (cluster-wide list/watch RBAC for the hub) to show free GPUs per model,
        and refuse requests that cannot fit now. Off: the form says availability is unknown.""",
    )

    enable_user_namespaces = Bool(
        True,
        config=True,
        help="""Each user in their own namespace (``user_namespace_template``), prepared on every spawn with
        the quota, Role and policies of tfdist.kube.tenancy. Default True (KubeSpawner's default is False).
        False puts every user in ``namespace``, where users can reach each other's jobs and Secrets: only for
        a team that trusts each other (docs/security.md, "Isolation between users").""",
    )
    lifeline_grace_seconds = Integer(
        settings.LIFELINE_GRACE_S,
        min=settings.LIFELINE_GRACE_MIN_S,
        max=settings.LIFELINE_GRACE_MAX_S,
        config=True,
        help="""How long after a notebook kernel is gone (killed, its pod or node lost) the cluster ends the
        %%tfdist jobs attached to it (TFDIST_LIFELINE_GRACE_S). The kernel renews each job's deadline every
        third of it, so a shorter grace frees GPUs sooner at the cost of more updates to the API server.""",
    )
    service_account = Unicode(
        tenancy.NOTEBOOK_SA,
        allow_none=True,
        config=True,
        help="Service account of notebook pods; in user namespaces the spawner creates it with its Role.",
    )

    allowed_runtime_classes = List(
        Unicode(),
        config=True,
        help="""RuntimeClasses users' job pods may name (runtimeClassName), enforced by the admission policy.
        Default none: a runtime such as `nvidia` that hands out GPUs by environment variable would let a pod
        see GPUs it never requested.""",
    )

    egress_api_server = List(
        Unicode(),
        config=True,
        help="""The Kubernetes API server as pods of user namespaces reach it, ADDRESS:PORT each: the
        endpoints of the `kubernetes` Service (`kubectl get endpointslices -n default -l
        kubernetes.io/service-name=kubernetes`), which kube-proxy rewrites its ClusterIP to before a
        NetworkPolicy sees the packet. Default: the hub's own API server address when its kubeconfig names
        an IP address (a hub in a pod sees only the ClusterIP: set this there, or %%tfdist cannot reach the
        API server).""",
    )
    egress_allow = List(
        Dict(),
        config=True,
        help="""Extra egress rules for every user namespace's default egress policy, as NetworkPolicy writes
        them: {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 443}]}
        (a package mirror, a data store). Besides these, pods reach only their namespace, DNS, the API
        server, the hub and the public internet (tfdist.kube.egress).""",
    )
    egress_internet = Bool(
        True,
        config=True,
        help="""Pods of user namespaces may connect to public IPv4 addresses (pip install, datasets). False:
        only their namespace, DNS, the API server, the hub and egress_allow.""",
    )

    egress_deny = List(
        Unicode(),
        config=True,
        help="""IPv4 addresses or CIDRs that user pods may not reach as the internet: pod or Service ranges
        outside the private ones, a platform endpoint of your cloud, nodes' public addresses where the hub
        does not watch nodes (gpu_availability_enabled; where it does, each spawn leaves out every node's
        own addresses). Private ranges, link-local and Azure's 168.63.129.16 are refused already.""",
    )

    @validate("egress_deny")
    def _check_deny(self, proposal: Any) -> list[str]:
        try:
            return [egress.check_deny(text) for text in proposal.value]
        except ValueError as e:
            raise TraitError(f"egress_deny: {e}") from None

    @validate("egress_api_server")
    def _check_endpoints(self, proposal: Any) -> list[str]:
        for text in proposal.value:
            try:
                egress.Endpoint.parse(text)
            except ValueError as e:
                raise TraitError(f"egress_api_server: {e}") from None
        return proposal.value

    @validate("egress_allow")
    def _check_egress_rules(self, proposal: Any) -> list[dict[str, Any]]:
        for rule in proposal.value:
            try:
                egress.check_rule(rule)
            except ValueError as e:
                raise TraitError(f"egress_allow: {e}") from None
        return proposal.value

    @default("container_security_context")
    def _restricted_container(self) -> dict[str, Any]:
        """What Pod Security `restricted` (the user namespaces' level) requires of every container."""
        return {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }

    tfdist_place = "The cluster"

    async def gpu_availability(self) -> dict[str, ModelAvailability] | None:
        if not self.gpu_availability_enabled:
            return None
        return shared_gpu_view().availability(self.tfdist_profiles().gpu_models)

    def queues_gpu_servers(self, cfg: ProfilesConfig) -> bool:
        """GPU servers of a profile with a queue wait in it (apply_choice labels their pod)."""
        return cfg.kueue is not None and self.enable_user_namespaces

    def _node_view(self) -> ClusterGpuView | None:
        """The hub's node watch, where it keeps one (the form's free GPUs; rbac-hub-gpu-view.yaml)."""
        return shared_gpu_view() if self.gpu_availability_enabled else None

    @default("uid")
    def _images_uid(self) -> int:
        """The images' user (tfdist.podidentity.DEFAULT; z2jh sets the same): pinned, because every job
        pod must run as the notebook does and the admission policy must know as whom."""
        return DEFAULT_IDENTITY.run_as_user

    @default("gid")
    def _images_gid(self) -> int:
        return DEFAULT_IDENTITY.run_as_group

    async def largest_node_gpus(self, cfg: ProfilesConfig) -> dict[str, int] | None:
        if not self.gpu_availability_enabled:
            return None
        return shared_gpu_view().largest_node(cfg.gpu_models)

    async def queue_waiting(self, cfg: ProfilesConfig) -> dict[str, int] | None:
        """Kueue's pending Workloads per ClusterQueue, one list per QUEUE_LINE_TTL_S per hub; None when the
        hub cannot read them (no Kueue, no RBAC, an error): the form then says the queue without a count."""
        from tfdist.kube import queueing_apply

        key = self._kube_api_url()
        now = time.monotonic()
        hit = _queue_line.get(key)
        if hit is not None and now - hit[0] < QUEUE_LINE_TTL_S:
            return hit[1]
        try:
            counts: dict[str, int] | None = await queueing_apply.pending_by_queue(self.api.api_client)
        except Exception as e:  # the count is news for the form, never a reason to fail it
            self.log.info("tfdist: cannot read Kueue's queues for the form: %s", e)
            counts = None
        _queue_line[key] = (now, counts)
        return counts

    async def load_user_options(self) -> None:
        """`apply_user_options` validated and applied the choice, and who the notebook runs as is resolved
        (before the namespace's parameters and the pod's environment need it; a user namespace cannot do
        without it); in a shared namespace the data claims are checked here (in user namespaces
        `_ensure_namespace` does, once the namespace is there)."""
        await self.tfdist_ensure_applied()
        await self.resolve_pod_identity(required=self.enable_user_namespaces)
        if not self.enable_user_namespaces:
            await self._check_data_claims()

    async def _check_data_claims(self) -> None:
        """Refuse the spawn, before its pod and home claim exist, when a data volume's claim is missing or
        cannot be shared (tfdist.spawner.kube_data)."""
        choice = self.tfdist_choice
        profile = self.tfdist_profiles().profile(choice.profile) if choice is not None else None
        if profile is None or not profile.data_volumes:
            return
        why = await data_claims_refusal(self.api, self.namespace, profile.data_mounts)
        if why is not None:
            self.log.error("tfdist: %s: %s", self.user.name, why)
            raise web.HTTPError(409, why)

    async def _ensure_namespace(self) -> None:
        """The user's namespace, created or converged on their profile before each start (idempotent).

        Not KubeSpawner's own: it creates the namespace bare and adopts one that exists (409), while this
        refuses a namespace that jupyter-tfdist did not make for this user (tenancy.owned_by)."""
        try:
            await prepare_user_namespace(self.api.api_client, self.tenant_policy())
        except tenancy.NamespaceTaken as e:
            self.log.error("tfdist: %s", e)
            raise web.HTTPError(409, str(e)) from None
        await self._converge_queues()
        await self._check_data_claims()

    async def _converge_queues(self) -> None:
        """Kueue's objects as the profiles' ``kueue:`` section says (tfdist.kube.queueing_apply): the
        cluster's flavors, cohort and ClusterQueues once per hub process and whenever the profiles change
        them, the user's LocalQueues on every spawn. Idempotent; nothing without a ``kueue:`` section.
        Where the cluster has no Kueue, or the hub may not write its objects, the spawn goes on (the
        server starts unqueued) and the log says why the user's server and jobs will not be queued."""
        from kubernetes_asyncio.client.exceptions import ApiException

        from tfdist.kube import queueing, queueing_apply

        cfg = self.tfdist_profiles()
        if cfg.kueue is None:
            return
        api = self.api.api_client
        try:
            async with _queues_lock:
                wanted = json.dumps(queueing.cluster_objects(cfg), sort_keys=True)
                key = self._kube_api_url()
                if _queues_converged.get(key) != wanted:
                    done = await queueing_apply.converge(api, cfg)
                    _queues_converged[key] = wanted
                    self.log.info("tfdist: Kueue queues converged: %s", done)
            await prepare_user_queues(api, cfg, self.tenant_policy(), sorted(self.tfdist_groups()))
        except ApiException as e:
            if e.status not in (403, 404):
                raise
            # no LocalQueue: a server pod with the queue label would wait for one for ever
            self.extra_labels = {k: v for k, v in self.extra_labels.items() if k != L_QUEUE}
            self.log.error(
                "tfdist: the profiles have a kueue: section, but %s (HTTP %s): the server and the "
                "%%%%tfdist jobs of %s will not be queued. Install Kueue v0.17.0 and apply "
                "hub_config/rbac-hub-tenancy.yaml (docs/queueing.md)",
                "the cluster has no Kueue" if e.status == 404 else "the hub may not write Kueue's objects",
                e.status,
                self.user.name,
            )

    async def progress(self) -> Any:
        """kubespawner's spawn progress, and while a GPU server waits in Kueue's queue its place and Kueue's
        reason every few seconds ("Waiting for a GPU: queued: 2nd in team ...")."""
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for ev in super(TfdistKubeSpawner, self).progress():
                    await out.put(ev)
            finally:
                await out.put(None)

        tasks = [asyncio.ensure_future(pump())]
        if L_QUEUE in self.extra_labels:
            tasks.append(asyncio.ensure_future(self._queue_progress(out)))
        try:
            while (ev := await out.get()) is not None:
                yield ev
        finally:
            for t in tasks:
                t.cancel()

    async def _queue_progress(self, out: asyncio.Queue, every_s: float = 2.0) -> None:
        from tfdist.kube.queueing_apply import pod_wait

        said = ""
        while True:
            await asyncio.sleep(every_s)
            try:
                pod = await self.api.read_namespaced_pod(self.pod_name, self.namespace)
                gated = any(g.name == GATE for g in pod.spec.scheduling_gates or [])
                wait = (
                    await pod_wait(self.api.api_client, self.namespace, pod.metadata.uid) if gated else None
                )
            except Exception:  # not created yet, or a moment's error: the queue is news, never a failure
                continue
            if wait is None:
                if said:
                    return  # admitted
                continue
            msg = f"Waiting for a GPU: {wait.position.event().sentence()}"
            if wait.reason:
                msg += f" ({wait.reason})"
            if msg != said:
                said = msg
                await out.put({"message": msg})
