"""The Kubernetes backend: a job is a set of labelled objects (see tfdist.kube.manifests) in the user's
namespace, owned by the notebook pod.

Status comes from a watch on the job's pods (resumed from its resourceVersion when the connection or the
API server drops, so no event is lost or repeated), never from polling. A job that cannot be scheduled
shows the scheduler's reason and, after --timeout, is deleted whole. Creation is all-or-nothing: if any
object is refused, everything already created is deleted before the error is shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from ..errors import BackendUnavailable, JobSpecError, NoSuchJob, TfdistError
from ..jobspec import JobSpec
from ..jobview import JobView
from ..kube import manifests as mf
from ..kube.agent_client import AgentClient
from ..settings import Settings
from .base import Backend, Launch

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
WATCH_TIMEOUT_S = 300  # server-side watch timeout; the loop re-opens it from the last resourceVersion
# A worker pod that ends Failed (eviction, node loss, a kwok fault stage) is replaced this often; a crashing
# container is restarted in place by the kubelet (restartPolicy OnFailure) and never gets here.
MAX_WORKER_REPLACEMENTS = 3
AGENT_GRACE_S = 30.0


def current_namespace(settings: Settings) -> str:
    if settings.namespace:
        return settings.namespace
    with contextlib.suppress(OSError):
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip()
    return "default"


def pod_task_state(pod: dict[str, Any]) -> tuple[str, str]:
    """(state, message) of one task pod, with the scheduler's words while it waits for a node."""
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return "terminating", ""
    if phase == "Pending":
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return "unschedulable", c.get("message") or c.get("reason") or "not scheduled"
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
                return "image-error", f"{waiting['reason']}: {waiting.get('message', '')}".strip()
        return "pending", "scheduled" if (pod.get("spec") or {}).get("nodeName") else "waiting for a node"
    if phase == "Running":
        restarts = sum(cs.get("restartCount", 0) for cs in status.get("containerStatuses") or [])
        return "running", f"restarts: {restarts}" if restarts else ""
    if phase == "Succeeded":
        return "exited-ok", ""
    if phase == "Failed":
        return "failed", status.get("reason") or status.get("message") or "failed"
    return phase.lower(), ""


def newest_per_task(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A task may briefly have its failed pod (terminating) and its replacement: keep the newest."""
    newest: dict[str, dict[str, Any]] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
        newest[pod["metadata"].get("labels", {}).get(mf.L_TASK, "")] = pod
    return list(newest.values())


_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
}


def quantity(text: str) -> float:
    """A Kubernetes quantity ("500m", "4Gi", "8") as a number."""
    text = str(text).strip()
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _SUFFIX[suffix]
    return float(text)


def quota_sentence(message: str) -> str:
    """The API server's "exceeded quota: q, requested: r=8, used: r=4, limited: r=8" as one sentence."""
    parts = dict(
        (k.strip(), v.strip())
        for k, _, v in (p.partition(":") for p in message.split("exceeded quota:", 1)[-1].split(", ")[1:])
    )

    def first(key: str) -> tuple[str, str]:
        res, _, amount = parts.get(key, "").split(",")[0].partition("=")
        return res, amount

    res, asked = first("requested")
    _, used = first("used")
    _, limit = first("limited")
    what = res.removeprefix("requests.").removeprefix("limits.") or "resources"
    return (
        f"the job would exceed your quota of {what}: it asks for {asked or '?'} more, {used or '?'} of "
        f"{limit or '?'} are in use (your notebook servers count too); ask for less or stop another job"
    )


def _translate(exc: Exception, kind: str, name: str, namespace: str) -> TfdistError:
    from kubernetes_asyncio.client.exceptions import ApiException

    if not isinstance(exc, ApiException):
        return BackendUnavailable(f"cannot reach the Kubernetes API: {exc}")
    try:
        message = json.loads(exc.body or "{}").get("message") or exc.reason
    except ValueError:
        message = exc.reason
    if exc.status == 403 and "exceeded quota" in message:
        return JobSpecError(quota_sentence(message))
    if exc.status in (403, 422) and "denied request:" in message:  # the admin's admission policy
        return JobSpecError(
            f"the cluster refused the job ({kind} {name!r}): {message.split('denied request:', 1)[1].strip()}"
        )
    if exc.status == 403 and "violates PodSecurity" in message:
        return JobSpecError(f"the cluster refused {kind} {name!r}: {message}")
    if exc.status == 403:
        return BackendUnavailable(
            f"not allowed to create {kind} {name!r} in namespace {namespace!r}: {message}. The notebook's "
            "service account needs the tfdist Role (hub_config/rbac.yaml) in that namespace"
        )
    if exc.status == 404:
        return JobSpecError(f"namespace {namespace!r} does not exist ({message})")
    if exc.status == 409:
        return JobSpecError(
            f"a job named {name!r} already exists in namespace {namespace!r}: pick another --name"
        )
    if exc.status == 422:
        return JobSpecError(f"the API server refused {kind} {name!r}: {message}")
    return BackendUnavailable(f"the API server refused {kind} {name!r} ({exc.status}): {message}")


@dataclasses.dataclass
class _Job:
    spec: JobSpec
    payload: bytes
    token: str
    created: float
    # the pods this backend created, by UID (from the create responses): events of any other pod carrying
    # the job's labels are ignored, and only the chief UID's address ever gets the payload
    pod_uids: dict[str, str] = dataclasses.field(default_factory=dict)  # uid -> task

    @property
    def chief_uids(self) -> set[str]:
        return {u for u, t in self.pod_uids.items() if t == "chief-0"}


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(self, settings: Settings, kubeconfig: str | None = None):
        self.settings = settings
        self.namespace = current_namespace(settings)
        self.kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
        self._api: Any = None
        self._jobs: dict[str, _Job] = {}
        self._agents: dict[str, AgentClient] = {}
        self.node_selector: dict[str, str] | None = settings.gpu_node_selector
        self.tolerations: list[dict] | None = settings.gpu_tolerations
        self.notebook_labels: dict[str, str] | None = (
            mf.notebook_pod_labels(settings.user) if settings.pod_name else None
        )

    # ------------------------------------------------------------------ API plumbing
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

    async def _core(self) -> Any:
        from kubernetes_asyncio import client

        return client.CoreV1Api(await self.api())

    async def _create(self, obj: dict[str, Any]) -> str:
        """Create one object; its UID."""
        from kubernetes_asyncio import client

        api = await self.api()
        ns = obj["metadata"]["namespace"]
        kind = obj["kind"]
        if kind == "NetworkPolicy":
            res = await client.NetworkingV1Api(api).create_namespaced_network_policy(ns, obj)
            return res.metadata.uid
        core = client.CoreV1Api(api)
        create = {
            "Pod": core.create_namespaced_pod,
            "Service": core.create_namespaced_service,
            "Secret": core.create_namespaced_secret,
        }[kind]
        return (await create(ns, obj)).metadata.uid

    async def delete_all(self, name: str, namespace: str | None = None) -> None:
        """Delete every object of a job by its label: pods first (they hold the GPUs)."""
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        ns = namespace or self.namespace
        api = await self.api()
        core = client.CoreV1Api(api)
        sel = f"{mf.L_JOB}={name},{mf.L_USER}={mf.user_label(self.settings.user)}"
        calls = [
            core.delete_collection_namespaced_pod(ns, label_selector=sel, grace_period_seconds=0),
            # by name: the notebook may not list Secrets, and a delete-collection would return their data
            core.delete_namespaced_secret(f"{name}-token", ns),
            client.NetworkingV1Api(api).delete_collection_namespaced_network_policy(ns, label_selector=sel),
        ]
        for call in calls:
            with contextlib.suppress(ApiException):
                await call
        with contextlib.suppress(ApiException):  # services have no delete-collection
            svcs = await core.list_namespaced_service(ns, label_selector=sel)
            for s in svcs.items:
                await core.delete_namespaced_service(s.metadata.name, ns)

    async def _pods(self, name: str | None = None) -> list[dict[str, Any]]:
        core = await self._core()
        mine = f"{mf.L_USER}={mf.user_label(self.settings.user)}"
        sel = f"{mf.L_JOB}={name},{mine}" if name else f"app.kubernetes.io/managed-by={mf.MANAGED_BY},{mine}"
        return (await self._list_pods(core, sel))["items"]

    async def _list_pods(self, core: Any, sel: str) -> dict[str, Any]:
        """A pod list as plain JSON dicts (what the watch events carry too); API errors raise."""
        res = await core.list_namespaced_pod(self.namespace, label_selector=sel)
        return (await self.api()).sanitize_for_serialization(res)

    # ------------------------------------------------------------------ Backend
    async def submit(self, spec: JobSpec, payload: bytes, launch: Launch) -> None:
        spec = dataclasses.replace(
            spec,
            user=self.settings.user,  # the backend's identity labels the objects, not the caller's word
            namespace=spec.namespace or self.namespace,
            image=spec.image or self.settings.worker_image,
        )
        if not spec.image:
            raise JobSpecError(
                "no image for the job's pods: the server sets TFDIST_WORKER_IMAGE (ask your admin)"
            )
        self.namespace = spec.namespace or self.namespace
        try:
            if await self._pods(spec.name):
                raise JobSpecError(
                    f"a job named {spec.name!r} already exists in namespace {spec.namespace!r}: "
                    f"pick another --name or `%tfdist stop {spec.name}`"
                )
        except TfdistError:
            raise
        except Exception as exc:
            raise _translate(exc, "pods", spec.name, spec.namespace or "") from None
        await self._check_quota(spec)
        owner = self._owner()
        token = secrets.token_urlsafe(32)
        objs = mf.job_objects(
            spec,
            token=token,
            owner=owner,
            notebook_labels=self.notebook_labels,
            node_selector=self.node_selector,
            tolerations=self.tolerations,
            service_account=None,
            queue=self.settings.kueue_queue,
        )
        # What the pods need first, one by one; then the pods, concurrently (a 64-worker job is 67 pods).
        # All or nothing, also when the cell is interrupted half-way (CancelledError): the clean-up is
        # shielded from the cancellation that triggered it.
        pods = [o for o in objs if o["kind"] == "Pod"]
        try:
            for obj in [o for o in objs if o["kind"] != "Pod"]:
                try:
                    await self._create(obj)
                except Exception as exc:
                    raise _translate(
                        exc, obj["kind"], obj["metadata"]["name"], spec.namespace or ""
                    ) from None
            results = await asyncio.gather(*(self._create(p) for p in pods), return_exceptions=True)
            for obj, res in zip(pods, results, strict=True):
                if isinstance(res, BaseException):
                    raise _translate(
                        res, obj["kind"], obj["metadata"]["name"], spec.namespace or ""
                    ) from None
        except BaseException:
            await asyncio.shield(self.delete_all(spec.name, spec.namespace))
            raise
        uids = {str(uid): p["metadata"]["labels"][mf.L_TASK] for p, uid in zip(pods, results, strict=True)}
        self._jobs[spec.name] = _Job(
            spec=spec, payload=payload, token=token, created=time.time(), pod_uids=uids
        )

    async def _check_quota(self, spec: JobSpec) -> None:
        """Refuse, before anything is created, a job that the namespace's ResourceQuota cannot admit now
        (the quota still binds if this check is skipped or raced: pod creation is refused all-or-nothing)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        need: dict[str, float] = {"pods": spec.task_count}
        if spec.gpus_per_worker:
            need[f"requests.{mf.GPU_RESOURCE}"] = spec.workers * spec.gpus_per_worker
        if spec.cpu:
            need["requests.cpu"] = need["limits.cpu"] = spec.cpu * spec.task_count
        if spec.memory_bytes:
            need["requests.memory"] = need["limits.memory"] = spec.memory_bytes * spec.task_count
        try:
            quotas = (await (await self._core()).list_namespaced_resource_quota(spec.namespace)).items
        except ApiException:
            return  # no right to read quotas (shared namespace): the API server still enforces them
        for q in quotas:
            hard = (q.status.hard if q.status else None) or (q.spec.hard if q.spec else None) or {}
            used = (q.status.used if q.status else None) or {}
            for res, amount in need.items():
                if res not in hard:
                    continue
                limit, now = quantity(hard[res]), quantity(used.get(res, "0"))
                if now + amount > limit:
                    what = res.removeprefix("requests.").removeprefix("limits.")
                    fmt = (lambda v: f"{v / 2**30:g} GiB") if what == "memory" else (lambda v: f"{v:g}")
                    raise JobSpecError(
                        f"the job would exceed your quota of {what}: it needs {fmt(amount)}, "
                        f"{fmt(now)} of {fmt(limit)} are in use (your notebook servers count too); "
                        "ask for less or stop another job"
                    )

    async def watch(self, name: str) -> AsyncIterator[dict[str, Any]]:
        """Pod events (scheduling, task states) merged with the coordinator agent's (progress, metrics,
        logs) once the coordinator pod has an address."""
        view = await self.status(name)
        yield {"type": "snapshot", "view": view.to_dict()}
        if view.finished:
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pods() -> None:
            try:
                async for ev in self._pod_events(name, view):
                    await q.put(ev)
            except Exception as exc:  # never leave the cell waiting on a dead watcher
                await q.put(
                    {
                        "type": "state",
                        "state": "failed",
                        "t": time.time(),
                        "message": f"lost track of the job's pods: {exc!r}",
                        "error": {"type": type(exc).__name__, "message": str(exc), "traceback": ""},
                    }
                )

        async def agent(ip: str) -> None:
            try:
                async for ev in self._agent_events(name, ip):
                    await q.put(ev)
            except Exception as exc:
                await q.put(
                    {
                        "type": "state",
                        "state": "failed",
                        "t": time.time(),
                        "message": str(exc),
                        "error": {"type": type(exc).__name__, "message": str(exc), "traceback": ""},
                    }
                )

        workers = [asyncio.ensure_future(pods())]
        try:
            while True:
                ev = await q.get()
                if ev["type"] == "_chief_ip":
                    if name in self._jobs and len(workers) == 1:
                        workers.append(asyncio.ensure_future(agent(ev["ip"])))
                    continue
                final = ev["type"] == "state" and ev["state"] in ("succeeded", "failed", "stopped")
                # Delete before telling: a consumer may stop iterating at the final event. A success
                # keeps the coordinator until fetch_result() has downloaded the results.
                if final and (ev["state"] != "succeeded" or name not in self._agents):
                    await self.delete_all(name)
                yield ev
                if final:
                    return
        finally:
            for w in workers:
                w.cancel()

    async def _agent_events(self, name: str, ip: str) -> AsyncIterator[dict[str, Any]]:
        job = self._jobs[name]
        client = AgentClient(f"http://{ip}:{mf.AGENT_PORT}", job.token)
        self._agents[name] = client
        announced = False
        # --timeout, plus a grace so an unschedulable job is reported as such (its own deadline comes first)
        deadline = job.created + job.spec.timeout_s + AGENT_GRACE_S
        while not await client.reachable():
            if time.time() > deadline:
                raise BackendUnavailable(
                    f"the notebook cannot reach the coordinator's agent at {ip}:{mf.AGENT_PORT} within "
                    f"--timeout {job.spec.timeout_s:g}s + {AGENT_GRACE_S:g}s (NetworkPolicy or CNI?)"
                )
            if not announced:
                yield {"type": "log", "lines": [["tfdist", f"waiting for the coordinator's agent at {ip}"]]}
                announced = True
            await asyncio.sleep(2)
        await client.upload(job.payload)
        async for ev in client.events():
            yield ev

    async def _pod_events(self, name: str, view: JobView) -> AsyncIterator[dict[str, Any]]:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        job = self._jobs.get(name)
        core = await self._core()
        sel = f"{mf.L_JOB}={name},{mf.L_USER}={mf.user_label(self.settings.user)}"
        tasks: dict[str, tuple[str, str]] = {}
        deadline = (job.created if job else view.created) + (job.spec.timeout_s if job else 600)
        started_all = False
        replaced: dict[str, int] = {}
        current: dict[str, str] = {}  # task -> name of its newest pod

        def ours(pod: dict[str, Any]) -> bool:
            """A pod this backend created (by UID); without a local record (another kernel's job, shown
            read-only) any pod with the job's labels."""
            uid = pod.get("metadata", {}).get("uid")
            return bool(uid) and (job is None or uid in job.pod_uids)

        def chief_ip(pod: dict[str, Any]) -> str | None:
            """The coordinator's address, only from the chief pod this backend created."""
            if job is None or pod.get("metadata", {}).get("uid") not in job.chief_uids:
                return None
            return (pod.get("status") or {}).get("podIP") or None

        rv: str | None = None
        while True:
            if rv is None:  # (re)list: the current state, and where the watch resumes from
                try:
                    body = await self._list_pods(core, sel)
                except asyncio.CancelledError:
                    raise
                except (
                    Exception
                ):  # API server away (restarting): retry until --timeout / forever once running
                    if not started_all and time.time() > deadline:
                        raise
                    await asyncio.sleep(1)
                    continue
                body["items"] = newest_per_task([p for p in body["items"] if ours(p)])
                current.update(
                    {p["metadata"]["labels"].get(mf.L_TASK, ""): p["metadata"]["name"] for p in body["items"]}
                )
                rv = body["metadata"]["resourceVersion"]
                for ev in self._task_events(body["items"], tasks):
                    yield ev
                for pod in body["items"]:
                    if ip := chief_ip(pod):
                        yield {"type": "_chief_ip", "ip": ip}
                done = self._outcome(tasks)
                if done:  # it ended while nobody watched
                    yield done
                    return
                if not started_all and self._servers_running(tasks):
                    started_all = True
                    yield {"type": "state", "state": "running", "message": "all tasks running"}
            w = watch.Watch()
            try:
                async with asyncio.timeout(
                    max(1.0, min(WATCH_TIMEOUT_S, deadline - time.time() + 1))
                    if not started_all
                    else WATCH_TIMEOUT_S
                ):
                    async for item in w.stream(
                        core.list_namespaced_pod,
                        self.namespace,
                        label_selector=sel,
                        resource_version=rv,
                        timeout_seconds=WATCH_TIMEOUT_S,
                        allow_watch_bookmarks=True,
                        _preload_content=False,
                    ):
                        obj = item["raw_object"]
                        rv = obj["metadata"].get("resourceVersion", rv)
                        if not ours(obj):  # bookmarks, and pods someone else labelled as this job's
                            continue
                        task_label = obj["metadata"].get("labels", {}).get(mf.L_TASK, "")
                        pod_name = obj["metadata"]["name"]
                        if item["type"] == "ADDED":
                            current[task_label] = pod_name  # a replacement supersedes the failed pod
                        if (
                            item["type"] in ("ADDED", "MODIFIED", "DELETED")
                            and current.get(task_label, pod_name) == pod_name
                        ):
                            pods = [obj] if item["type"] != "DELETED" else []
                            if item["type"] == "DELETED":
                                tasks.pop(task_label, None)
                            for ev in self._task_events(pods, tasks):
                                yield ev
                                if (
                                    ev["type"] == "task"
                                    and ev["state"] == "failed"
                                    and ev["task"].startswith("worker")
                                ):
                                    for rev in await self._replace_worker(name, ev["task"], replaced):
                                        yield rev
                        if ip := chief_ip(obj):
                            yield {"type": "_chief_ip", "ip": ip}
                        done = self._outcome(tasks)
                        if done:
                            yield done
                            return
                        if not started_all and self._servers_running(tasks):
                            started_all = True
                            yield {"type": "state", "state": "running", "message": "all tasks running"}
                        if not started_all and time.time() > deadline:
                            break
            except TimeoutError:
                pass
            except ApiException as exc:
                if exc.status == 410:  # too old: relist
                    rv = None
                    continue
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                raise
            except Exception:  # connection dropped, API server restarting: resume from rv when it is back
                await asyncio.sleep(1)
            finally:
                w.stop()
            if not started_all and time.time() > deadline:
                reasons = "; ".join(
                    f"{t}: {m}" for t, (s, m) in sorted(tasks.items()) if s != "running" and m
                )
                limit = job.spec.timeout_s if job else 600
                yield {
                    "type": "state",
                    "state": "failed",
                    "t": time.time(),
                    "message": f"not running within --timeout {limit:g}s; deleted. {reasons}".strip(),
                    "error": {"type": "Unschedulable", "message": reasons, "traceback": ""},
                }
                return

    async def _replace_worker(self, name: str, task: str, replaced: dict[str, int]) -> list[dict[str, Any]]:
        """A failed worker pod is replaced (the TF coordinator re-sends its work); a PS or chief is not."""
        job = self._jobs.get(name)
        if job is None or replaced.get(task, 0) >= MAX_WORKER_REPLACEMENTS:
            return []
        n = replaced[task] = replaced.get(task, 0) + 1
        core = await self._core()
        old = f"{mf.pod_name(job.spec, task)}" + (f"-r{n - 1}" if n > 1 else "")
        pod = mf.task_pod(
            job.spec,
            task,
            self._owner(),
            node_selector=self.node_selector,
            tolerations=self.tolerations,
            queue=self.settings.kueue_queue,
            attempt=n,
        )
        from kubernetes_asyncio.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            await core.delete_namespaced_pod(old, self.namespace, grace_period_seconds=0)
        job.pod_uids[await self._create(pod)] = task
        return [
            {"type": "task", "task": task, "state": "restarting", "restarts": n},
            {
                "type": "log",
                "lines": [[task, f"tfdist: {task} pod failed; replaced ({n}/{MAX_WORKER_REPLACEMENTS})"]],
            },
        ]

    def _owner(self) -> dict[str, Any] | None:
        if self.settings.pod_name and self.settings.pod_uid:
            return mf.owner_reference(self.settings.pod_name, self.settings.pod_uid)
        return None

    @staticmethod
    def _servers_running(tasks: dict[str, tuple[str, str]]) -> bool:
        return bool(tasks) and all(s[0] in ("running", "exited-ok") for s in tasks.values())

    @staticmethod
    def _outcome(tasks: dict[str, tuple[str, str]]) -> dict[str, Any] | None:
        chief = tasks.get("chief-0")
        if chief and chief[0] == "exited-ok":
            return {"type": "state", "state": "succeeded", "message": "finished", "t": time.time()}
        failed = {t: m for t, (s, m) in tasks.items() if s == "failed" and not t.startswith("worker")}
        if failed or (chief and chief[0] == "failed"):
            why = "; ".join(f"{t}: {m}" for t, m in sorted(failed.items()))
            return {
                "type": "state",
                "state": "failed",
                "message": why or "the coordinator failed",
                "t": time.time(),
                "error": {"type": "PodFailed", "message": why, "traceback": ""},
            }
        return None

    @staticmethod
    def _task_events(pods: list[dict[str, Any]], tasks: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for pod in pods:
            task = pod["metadata"].get("labels", {}).get(mf.L_TASK)
            if not task:
                continue
            st = pod_task_state(pod)
            if tasks.get(task) == st:
                continue
            tasks[task] = st
            out.append(
                {
                    "type": "task",
                    "task": task,
                    "state": st[0],
                    "node": (pod.get("spec") or {}).get("nodeName"),
                }
            )
            if st[1] and st[0] in ("unschedulable", "image-error", "failed"):
                out.append({"type": "state", "state": "starting", "message": f"{task}: {st[1]}"})
                out.append({"type": "log", "lines": [[task, st[1]]]})
        return out

    async def stop(self, name: str, reason: str = "stopped") -> bool:
        pods = await self._pods(name)
        await self.delete_all(name)
        self._jobs.pop(name, None)
        self._agents.pop(name, None)
        return bool(pods)

    async def status(self, name: str) -> JobView:
        pods = await self._pods(name)
        job = self._jobs.get(name)
        if job is not None:
            pods = [p for p in pods if p["metadata"].get("uid") in job.pod_uids]
        if not pods and job is None:
            raise NoSuchJob(name)
        spec = job.spec if job else None
        for p in pods:
            ann = (p["metadata"].get("annotations") or {}).get(mf.A_SPEC)
            if ann:
                spec = JobSpec.from_json(ann)
        view = JobView(
            name=name,
            backend="kubernetes",
            user=spec.user if spec else "",
            total_tasks=spec.task_count if spec else len(pods),
            spec=json.loads(spec.to_json()) if spec else {},
        )
        if job:
            view.created = job.created
        tasks: dict[str, tuple[str, str]] = {}
        for ev in self._task_events(newest_per_task(pods), tasks):
            view.apply(ev)
        if not pods:
            view.state, view.message = "stopped", "no objects left"
        elif self._servers_running(tasks):
            view.state, view.message = "running", "all tasks running"
        else:
            view.state = "starting"
        return view

    async def list_jobs(self) -> list[dict[str, Any]]:
        names = sorted({p["metadata"]["labels"][mf.L_JOB] for p in await self._pods()})
        return [(await self.status(n)).summary() for n in names]

    async def logs(self, name: str, task: str | None = None, tail: int | None = None) -> dict[str, str]:
        from kubernetes_asyncio.client.exceptions import ApiException

        core = await self._core()
        out = {}
        pods = await self._pods(name)
        if not pods:
            raise NoSuchJob(name)
        for p in pods:
            t = p["metadata"]["labels"].get(mf.L_TASK, p["metadata"]["name"])
            if task and t != task:
                continue
            try:
                kw = {"tail_lines": tail} if tail is not None else {}
                out[t] = await core.read_namespaced_pod_log(p["metadata"]["name"], self.namespace, **kw)
            except ApiException as exc:
                out[t] = f"(no log: {exc.reason})"
        return out

    async def fetch_result(self, name: str) -> bytes | None:
        """Download the results from the coordinator's agent, release it, and delete the job's objects."""
        client = self._agents.pop(name, None)
        try:
            if client is None:
                return None
            data = await client.result()
            with contextlib.suppress(Exception):
                await client.done()
            return data
        finally:
            if client is not None:
                await client.close()
            await self.delete_all(name)
            self._jobs.pop(name, None)

    async def close(self) -> None:
        for name in list(self._jobs):
            with contextlib.suppress(Exception):
                await self.delete_all(name)
        self._jobs.clear()
        if self._api is not None:
            await self._api.close()
            self._api = None
