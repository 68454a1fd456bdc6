"""The Kubernetes backend: the kernel submits, watches and fetches; the cluster runs the job.

A job is a root batch/v1 Job (the coordinator) owning Indexed Jobs for the PS and the workers, a headless
Service, a NetworkPolicy and a token Secret (tfdist.kube.manifests). Worker restarts, completion and
clean-up are the Job controller's, the TTL controller's and the garbage collector's, whether or not a
kernel is watching. `submit` creates everything all-or-nothing (the root is created suspended, so a
refusal leaves no pod), then hands the payload to the coordinator's agent once, in the background, and —
unless the job is detached — keeps the lifeline: the root's `activeDeadlineSeconds`, kept LIFELINE_GRACE_S
ahead of now while this process lives. `watch` and `status` only read, through one derivation
(tfdist.kube.status). The pods followed are the ones whose controlling Job this backend created (by UID),
never pods that merely carry the job's labels; only the root Job's own pod gets the payload, and the
channel to it is signed both ways (tfdist.kube.signing).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from ..errors import BackendUnavailable, JobSpecError, NoSuchJob, TfdistError
from ..jobspec import JobSpec
from ..jobview import TERMINAL, JobView
from ..kube import manifests as mf
from ..kube import records
from ..kube import status as st
from ..kube.agent_client import AgentClient
from ..kube.api_errors import quantity, translate
from ..settings import Settings
from .base import Backend, Launch

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
WATCH_TIMEOUT_S = 300  # server-side watch timeout; the loop re-opens it from the last resourceVersion
LIFELINE_GRACE_S = 60  # a kernel gone this long: the cluster ends its attached jobs
LIFELINE_RENEW_S = 20.0
DETACHED_RESULT_WAIT_S = (
    24 * 3600.0
)  # default retention of a detached job's results (TFDIST_RESULT_RETENTION_S)
AGENT_GRACE_S = 30.0
# a job refused for quota that this user's ending jobs still hold waits this long for them to let go
QUOTA_RELEASE_WAIT_S = 90.0


def current_namespace(settings: Settings) -> str:
    if settings.namespace:
        return settings.namespace
    with contextlib.suppress(OSError):
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip()
    return "default"


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


@dataclasses.dataclass
class _Job:
    spec: JobSpec
    token: str
    created: float
    root_uid: str
    job_uids: set[str]  # the root, PS and worker Jobs: their pods are this job's pods
    detach: bool = False
    payload: bytes | None = None  # until the agent has it
    agent: AgentClient | None = None
    delivered: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    delivery_error: Exception | None = None
    tasks: list[asyncio.Task] = dataclasses.field(default_factory=list)
    done: bool = False


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(self, settings: Settings, kubeconfig: str | None = None):
        self.settings = settings
        self.namespace = current_namespace(settings)
        self.kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
        self._api: Any = None
        self._jobs: dict[str, _Job] = {}
        self._ended: set[str] = set()  # jobs this backend stopped or took the results of
        self.node_selector: dict[str, str] | None = settings.gpu_node_selector
        self.tolerations: list[dict] | None = settings.gpu_tolerations
        # the profile's GPU model (a MIG profile is a resource of its own); whole GPUs without one
        self.gpu_resource: str = settings.gpu_resource or mf.GPU_RESOURCE
        self.notebook_labels: dict[str, str] | None = (
            mf.notebook_pod_labels(settings.user) if settings.pod_name else None
        )
        self.lifeline_grace_s = LIFELINE_GRACE_S
        self.lifeline_renew_s = LIFELINE_RENEW_S

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

    async def _batch(self) -> Any:
        from kubernetes_asyncio import client

        return client.BatchV1Api(await self.api())

    async def _dict(self, obj: Any) -> dict[str, Any]:
        return (await self.api()).sanitize_for_serialization(obj)

    async def _create(self, obj: dict[str, Any]) -> dict[str, Any]:
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
        return await self._dict(await create(ns, obj))

    async def _delete(self, kind: str, name: str, ns: str) -> bool:
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

    async def _root(self, name: str) -> dict[str, Any] | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await self._dict(await (await self._batch()).read_namespaced_job(name, self.namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def _list_pods(self, sel: str) -> dict[str, Any]:
        """A pod list as plain JSON dicts (what the watch events carry too); API errors raise."""
        return await self._dict(
            await (await self._core()).list_namespaced_pod(self.namespace, label_selector=sel)
        )

    def _selector(self, name: str) -> str:
        return f"{mf.L_JOB}={name},{mf.L_USER}={mf.user_label(self.settings.user)}"

    def _ours(self, name: str, pod: dict[str, Any]) -> bool:
        """A pod of a Job this backend created (by UID). Without a local record (another kernel's job,
        shown read-only) any pod with the job's labels."""
        job = self._jobs.get(name)
        return job is None or controller_uid(pod) in job.job_uids

    # ------------------------------------------------------------------ submit
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
        detach = bool(spec.extra.get("detach"))
        try:
            if await self._root(spec.name) is not None:
                raise JobSpecError(
                    f"a job named {spec.name!r} already exists in namespace {spec.namespace!r}: "
                    f"pick another --name or `%tfdist stop {spec.name}`"
                )
        except TfdistError:
            raise
        except Exception as exc:
            raise translate(exc, "Job", spec.name, spec.namespace or "") from None
        await self._check_quota(spec)
        token = secrets.token_urlsafe(32)
        retention = float(os.environ.get("TFDIST_RESULT_RETENTION_S") or DETACHED_RESULT_WAIT_S)
        root = mf.root_job(
            spec,
            self._owner(),
            queue=self.settings.kueue_queue,
            result_wait_s=retention if detach else None,
            lifeline_s=None if detach else self.lifeline_grace_s,
        )
        created: list[dict[str, Any]] = []
        # All or nothing, also when the cell is interrupted half-way (CancelledError): the clean-up is
        # shielded from the cancellation that triggered it. The root is suspended until the end: no pod
        # of a job that is refused half-way ever exists.
        try:
            root = await self._create_translated(root, spec)
            created.append(root)
            owner = mf.root_reference(spec, root["metadata"]["uid"])
            for obj in mf.job_objects(
                spec,
                token=token,
                root=owner,
                notebook_labels=self.notebook_labels,
                node_selector=self.node_selector,
                tolerations=self.tolerations,
                gpu_resource=self.gpu_resource,
                queue=self.settings.kueue_queue,
            ):
                created.append(await self._create_translated(obj, spec))
            root["spec"]["suspend"] = False
            try:
                root = await self._replace_root(root)
            except TfdistError:
                raise
            except Exception as exc:
                raise translate(exc, "Job", spec.name, spec.namespace or "") from None
        except BaseException:
            await asyncio.shield(self._rollback(created))
            raise
        job = _Job(
            spec=spec,
            token=token,
            created=time.time(),
            root_uid=root["metadata"]["uid"],
            job_uids={o["metadata"]["uid"] for o in created if o["kind"] == "Job"},
            detach=detach,
            payload=payload,
        )
        self._jobs[spec.name] = job
        if detach:
            self._remember(job)
        job.tasks.append(asyncio.ensure_future(self._deliver(spec.name)))
        if not detach:
            job.tasks.append(asyncio.ensure_future(self._lifeline(spec.name, root)))

    async def _create_translated(self, obj: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
        try:
            out = await self._create(obj)
        except Exception as exc:
            raise translate(exc, obj["kind"], obj["metadata"]["name"], spec.namespace or "") from None
        out.setdefault("kind", obj["kind"])
        return out

    async def _rollback(self, created: list[dict[str, Any]]) -> None:
        for obj in reversed(created):
            with contextlib.suppress(Exception):
                await self._delete(obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"])

    async def _replace_root(self, root: dict[str, Any], attempts: int = 5) -> dict[str, Any]:
        """PUT the root (update, never patch); on a conflict (the controller wrote its status in between)
        apply the same spec change to the live object."""
        from kubernetes_asyncio.client.exceptions import ApiException

        batch = await self._batch()
        name, ns = root["metadata"]["name"], root["metadata"]["namespace"]
        want = {k: root["spec"].get(k) for k in ("suspend", "activeDeadlineSeconds")}
        for _ in range(attempts):
            try:
                return await self._dict(await batch.replace_namespaced_job(name, ns, root))
            except ApiException as exc:
                if exc.status != 409:
                    raise
            root = await self._dict(await batch.read_namespaced_job(name, ns))
            root["spec"].update({k: v for k, v in want.items() if v is not None})
        raise BackendUnavailable(f"could not update Job {name!r}: it kept changing")

    async def _check_quota(self, spec: JobSpec) -> None:
        """Refuse, before anything is created, a job that the namespace's ResourceQuota cannot admit now
        (the quota still binds without this check: the Job controller cannot create the pods).

        A shortfall that this user's own ending jobs hold (pods being deleted: the cell before this one
        returned its weights a moment ago) is waited out, up to QUOTA_RELEASE_WAIT_S: running two cells in
        a row must not fail because the first one's pods are still shutting down."""
        deadline = time.monotonic() + QUOTA_RELEASE_WAIT_S
        while True:
            short = await self._quota_shortfall(spec)
            if short is None:
                return
            if time.monotonic() > deadline or not await self._releasing():
                raise JobSpecError(short)
            await asyncio.sleep(1.0)

    async def _releasing(self) -> bool:
        """Whether pods of this user's jobs are on their way out (deleted, or of a job this backend ended)."""
        try:
            pods = (await self._list_pods(f"{mf.L_USER}={mf.user_label(self.settings.user)}"))["items"]
        except Exception:
            return False
        for p in pods:
            meta = p.get("metadata") or {}
            if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue  # a finished pod holds no quota
            if meta.get("deletionTimestamp") or (meta.get("labels") or {}).get(mf.L_JOB) in self._ended:
                return True
        return False

    async def _quota_shortfall(self, spec: JobSpec) -> str | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        need: dict[str, float] = {"pods": spec.task_count}
        if spec.gpus_per_worker:
            need[f"requests.{self.gpu_resource}"] = spec.workers * spec.gpus_per_worker
        if spec.cpu:
            need["requests.cpu"] = need["limits.cpu"] = spec.cpu * spec.task_count
        if spec.memory_bytes:
            need["requests.memory"] = need["limits.memory"] = spec.memory_bytes * spec.task_count
        try:
            quotas = (await (await self._core()).list_namespaced_resource_quota(spec.namespace)).items
        except ApiException:
            return None  # no right to read quotas (shared namespace): the cluster still enforces them
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
                    return (
                        f"the job would exceed your quota of {what}: it needs {fmt(amount)}, "
                        f"{fmt(now)} of {fmt(limit)} are in use (your notebook servers count too); "
                        "ask for less or stop another job"
                    )
        return None

    def _owner(self) -> dict[str, Any] | None:
        if self.settings.pod_name and self.settings.pod_uid:
            return mf.owner_reference(self.settings.pod_name, self.settings.pod_uid)
        return None

    # ------------------------------------------------------------------ background work of a job
    async def _deliver(self, name: str) -> None:
        """Hand the payload to the root Job's own pod, once: wait for its address, then upload (the agent
        client retries transient failures; a retried upload of the same bytes is accepted)."""
        job = self._jobs[name]
        try:
            ip = await self._chief_ip(job)
            client = AgentClient(f"http://{ip}:{mf.AGENT_PORT}", job.token)
            job.agent = client
            deadline = job.created + job.spec.timeout_s + AGENT_GRACE_S
            while not await client.reachable():
                if time.time() > deadline:
                    raise BackendUnavailable(
                        f"the notebook cannot reach the coordinator's agent at {ip}:{mf.AGENT_PORT} within "
                        f"--timeout {job.spec.timeout_s:g}s + {AGENT_GRACE_S:g}s (NetworkPolicy or CNI?)"
                    )
                await asyncio.sleep(2)
            await client.upload(job.payload or b"")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            job.delivery_error = exc
        finally:
            job.payload = None  # delivered or failed: the kernel keeps no copy (it may be hundreds of MB)
            job.delivered.set()

    async def _chief_ip(self, job: _Job) -> str:
        """The address of the root Job's pod, followed by watch until it has one."""
        from kubernetes_asyncio import watch

        core = await self._core()
        sel = f"{self._selector(job.spec.name)},{mf.L_ROLE}=chief"
        rv = None
        while True:
            try:
                if rv is None:
                    body = await self._list_pods(sel)
                    rv = body["metadata"]["resourceVersion"]
                    for pod in body["items"]:
                        if controller_uid(pod) == job.root_uid and (pod.get("status") or {}).get("podIP"):
                            return pod["status"]["podIP"]
                w = watch.Watch()
                async for item in w.stream(
                    core.list_namespaced_pod,
                    self.namespace,
                    label_selector=sel,
                    resource_version=rv,
                    timeout_seconds=WATCH_TIMEOUT_S,
                    allow_watch_bookmarks=True,
                    _preload_content=False,
                ):
                    pod = item["raw_object"]
                    rv = pod["metadata"].get("resourceVersion", rv)
                    if controller_uid(pod) == job.root_uid and (pod.get("status") or {}).get("podIP"):
                        return pod["status"]["podIP"]
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if getattr(exc, "status", None) == 410:
                    rv = None
                await asyncio.sleep(1)

    async def _lifeline(self, name: str, root: dict[str, Any]) -> None:
        """Keep the root's deadline LIFELINE_GRACE_S ahead while this process lives (one update per
        LIFELINE_RENEW_S); when it stops, the Job controller ends the job within the grace period."""
        job = self._jobs[name]
        while not job.done:
            await asyncio.sleep(self.lifeline_renew_s)
            if job.done:
                return
            try:
                if not (root.get("status") or {}).get("startTime"):
                    root = await self._root(name) or root
                start = (root.get("status") or {}).get("startTime")
                if not start:
                    continue
                from datetime import datetime

                started = datetime.fromisoformat(str(start).replace("Z", "+00:00")).timestamp()
                root["spec"]["activeDeadlineSeconds"] = (
                    math.ceil(time.time() - started) + self.lifeline_grace_s
                )
                root = await self._replace_root(root)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if getattr(exc, "status", None) == 404:
                    return  # the job is gone
                await asyncio.sleep(1)  # API server away: try again; the grace covers a few misses

    def _finish(self, name: str) -> None:
        job = self._jobs.get(name)
        if job is None:
            return
        job.done = True
        for t in job.tasks:
            if t is not asyncio.current_task():
                t.cancel()

    # ------------------------------------------------------------------ watch
    async def watch(self, name: str) -> AsyncIterator[dict[str, Any]]:
        """Pod events (scheduling, task states) merged with the coordinator agent's (progress, metrics,
        logs) once the payload is delivered. Reads only: the cluster runs the job."""
        view = await self.status(name)
        yield {"type": "snapshot", "view": view.to_dict()}
        if view.finished:
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(source: AsyncIterator[dict[str, Any]], what: str) -> None:
            try:
                async for ev in source:
                    await q.put(ev)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never leave the cell waiting on a dead watcher
                await q.put(
                    {
                        "type": "state",
                        "state": "failed",
                        "t": time.time(),
                        "message": f"{what}: {exc}",
                        "error": {"type": type(exc).__name__, "message": str(exc), "traceback": ""},
                    }
                )

        workers = [asyncio.ensure_future(pump(self._pod_events(name, view), "lost track of the job's pods"))]
        if name in self._jobs:
            workers.append(asyncio.ensure_future(pump(self._agent_events(name), "the coordinator")))
        try:
            while True:
                ev = await q.get()
                final = ev["type"] == "state" and ev["state"] in TERMINAL
                if final and ev["state"] != "succeeded":
                    self._finish(name)
                yield ev
                if final:
                    return
        finally:
            for w in workers:
                w.cancel()

    async def _agent_events(self, name: str) -> AsyncIterator[dict[str, Any]]:
        job = self._jobs[name]
        await job.delivered.wait()
        if job.delivery_error is not None:  # the kernel's own verdict: end the job now, not at the deadline
            err = job.delivery_error
            await self.stop(name)
            raise err
        assert job.agent is not None
        async for ev in job.agent.events():
            yield ev

    async def _pod_events(self, name: str, view: JobView) -> AsyncIterator[dict[str, Any]]:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        job = self._jobs.get(name)
        core = await self._core()
        sel = self._selector(name)
        expected = job.spec.task_count if job else view.total_tasks
        tasks: st.TaskStates = {}
        deadline = (job.created if job else view.created) + (job.spec.timeout_s if job else 600)
        started_all = False
        current: dict[str, str] = {}  # task -> name of its newest pod
        restarts: dict[str, int] = {}
        rv: str | None = None

        def replaced(task: str, pod_name: str) -> list[dict[str, Any]]:
            """The Job controller replaced a task's pod: say so once per replacement."""
            old = current.get(task)
            current[task] = pod_name
            if old is None or old == pod_name:
                return []
            n = restarts[task] = restarts.get(task, 0) + 1
            return [
                {"type": "task", "task": task, "state": "restarting", "restarts": n},
                {"type": "log", "lines": [[task, f"tfdist: {task} pod replaced by the cluster ({n})"]]},
            ]

        while True:
            if rv is None:  # (re)list: the current state, and where the watch resumes from
                try:
                    body = await self._list_pods(sel)
                except asyncio.CancelledError:
                    raise
                except (
                    Exception
                ):  # API server away (restarting): retry until --timeout / forever once running
                    if not started_all and time.time() > deadline:
                        raise
                    await asyncio.sleep(1)
                    continue
                pods = st.newest_per_task([p for p in body["items"] if self._ours(name, p)])
                for p in pods:
                    for ev in replaced(st.pod_task(p) or "", p["metadata"]["name"]):
                        yield ev
                rv = body["metadata"]["resourceVersion"]
                for ev in st.task_events(pods, tasks):
                    yield ev
                done = st.outcome(tasks)
                if done is None and not pods and await self._root(name) is None:
                    done = {
                        "type": "state",
                        "state": "stopped",
                        "message": "no objects left",
                        "t": time.time(),
                    }
                if done:  # it ended while nobody watched
                    yield done
                    return
                if not started_all and st.servers_running(tasks, expected):
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
                        task = st.pod_task(obj)
                        if item["type"] == "BOOKMARK" or not task or not self._ours(name, obj):
                            continue  # bookmarks, and pods someone else labelled as this job's
                        pod_name = obj["metadata"]["name"]
                        if item["type"] == "ADDED":
                            for ev in replaced(task, pod_name):
                                yield ev
                        if current.get(task, pod_name) == pod_name:
                            if item["type"] == "DELETED":
                                tasks.pop(task, None)
                            for ev in st.task_events([obj] if item["type"] != "DELETED" else [], tasks):
                                yield ev
                        if item["type"] == "DELETED" and not tasks and await self._root(name) is None:
                            # every pod and the root gone while running: deleted by someone else, or with
                            # the notebook pod that owned it (the agent's stream would only time out)
                            yield {
                                "type": "state",
                                "state": "stopped",
                                "message": "the job was deleted in the cluster (with its notebook server, "
                                "or by someone else); nothing of it is left",
                                "t": time.time(),
                            }
                            return
                        done = st.outcome(tasks)
                        if done:
                            yield done
                            return
                        if not started_all and st.servers_running(tasks, expected):
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
                if len(tasks) < expected:
                    reasons = "; ".join(filter(None, [reasons, await self._creation_problems(name)]))
                limit = job.spec.timeout_s if job else 600
                if job is not None:  # --timeout is the user's word: delete now, not after the TTL
                    await self.stop(name)
                yield {
                    "type": "state",
                    "state": "failed",
                    "t": time.time(),
                    "message": f"not running within --timeout {limit:g}s; deleted. {reasons}".strip(),
                    "error": {"type": "Unschedulable", "message": reasons, "traceback": ""},
                }
                return

    async def _creation_problems(self, name: str) -> str:
        """Why the Job controller made no pods (a quota raced past the kernel's check, an admission
        policy): its FailedCreate events, as one line."""
        try:
            evs = await (await self._core()).list_namespaced_event(
                self.namespace, field_selector="reason=FailedCreate"
            )
        except Exception:
            return ""
        msgs = []
        for e in evs.items:
            obj = e.involved_object
            if obj and obj.kind == "Job" and obj.name in (name, f"{name}-worker", f"{name}-ps"):
                msg = e.message or ""
                if "exceeded quota" in msg:
                    from ..kube.api_errors import quota_sentence

                    msg = quota_sentence(msg)
                msgs.append(msg)
        return "; ".join(dict.fromkeys(msgs))

    # ------------------------------------------------------------------ the rest of the interface
    async def stop(self, name: str, reason: str = "stopped") -> bool:
        """Delete the root: the garbage collector takes everything it owns, pods first."""
        self._ended.add(name)
        self._finish(name)
        job = self._jobs.pop(name, None)
        if job is not None:
            others = [t for t in job.tasks if t is not asyncio.current_task()]
            await asyncio.gather(*others, return_exceptions=True)  # cancelled: let them unwind first
            if job.agent is not None:
                await job.agent.close()
        self._forget(name)
        return await self._delete("Job", name, self.namespace)

    async def status(self, name: str) -> JobView:
        root = await self._root(name)
        pods = [p for p in (await self._list_pods(self._selector(name)))["items"] if self._ours(name, p)]
        job = self._jobs.get(name)
        if root is None and not pods and job is None:
            raise NoSuchJob(name)
        spec = job.spec if job else None
        ann = ((root or {}).get("metadata", {}).get("annotations") or {}).get(mf.A_SPEC)
        if ann and spec is None:
            spec = JobSpec.from_json(ann)
        created = job.created if job else time.time()
        if job is None and root is not None:
            from datetime import datetime

            ts = root["metadata"].get("creationTimestamp")
            with contextlib.suppress(ValueError, TypeError):
                created = datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp()
        return st.view(name, spec, pods, root, created)

    async def list_jobs(self) -> list[dict[str, Any]]:
        sel = f"{mf.L_ROOT}=true,{mf.L_USER}={mf.user_label(self.settings.user)}"
        roots = (await (await self._batch()).list_namespaced_job(self.namespace, label_selector=sel)).items
        out = []
        for name in sorted({j.metadata.name for j in roots} | set(self._jobs)):
            with contextlib.suppress(NoSuchJob):
                summary = (await self.status(name)).summary()
                out.append(summary | self.detach_summary(name, summary.get("ended")))
        return out

    def detach_summary(self, name: str, ended: float | None = None) -> dict[str, Any]:
        """From this server's record of the detached job (the kernel that started it wrote it): results
        waiting in the coordinator pod until the retention passes after the end, or already taken."""
        rec = records.load(self._record_path(name))
        if rec is None:
            return {"detached": False}
        if "taken" in rec:
            return {"detached": True, "results": "taken"}
        if ended is None:
            return {"detached": True, "results": "pending"}
        retention = float(rec.get("retention_s") or DETACHED_RESULT_WAIT_S)
        return {"detached": True, "results": "waiting", "kept_until": ended + retention}

    async def logs(self, name: str, task: str | None = None, tail: int | None = None) -> dict[str, str]:
        from kubernetes_asyncio.client.exceptions import ApiException

        core = await self._core()
        pods = [p for p in (await self._list_pods(self._selector(name)))["items"] if self._ours(name, p)]
        if not pods:
            raise NoSuchJob(name)
        out = {}
        for p in st.newest_per_task(pods):
            t = st.pod_task(p) or p["metadata"]["name"]
            if task and t != task:
                continue
            try:
                kw = {"tail_lines": tail} if tail else {}
                out[t] = await core.read_namespaced_pod_log(p["metadata"]["name"], self.namespace, **kw)
            except ApiException as exc:
                out[t] = f"(no log: {exc.reason})"
        return out

    async def fetch_result(self, name: str) -> bytes | None:
        """Download the results from the coordinator's agent (signed: anything else is refused before it
        could be unpickled) and release it; the finished root then cleans up after itself (TTL)."""
        job = self._jobs.get(name)
        if job is None or job.agent is None:
            return None
        try:
            data = await job.agent.result()
            with contextlib.suppress(Exception):
                await job.agent.done()
            # The weights are in the notebook: nothing of the job is needed any more. Deleting the root
            # now (rather than at its TTL) frees the pods and the quota they hold for the next cell.
            self._ended.add(name)
            with contextlib.suppress(Exception):
                await self._delete("Job", name, self.namespace)
            return data
        finally:
            self._finish(name)
            await job.agent.close()
            self._jobs.pop(name, None)
            self._forget(name, taken=True)

    # ------------------------------------------------------------------ detach / attach
    def _record_path(self, name: str) -> str:
        return records.path(self.settings.state_dir, self.namespace, name)

    def _remember(self, job: _Job) -> None:
        """A detached job's token and identity, for `%tfdist attach` in a later kernel of this server."""
        rec = {
            "spec": json.loads(job.spec.to_json()),
            "token": job.token,
            "root_uid": job.root_uid,
            "job_uids": sorted(job.job_uids),
            "created": job.created,
            "retention_s": float(os.environ.get("TFDIST_RESULT_RETENTION_S") or DETACHED_RESULT_WAIT_S),
        }
        records.save(self._record_path(job.spec.name), rec)

    def _forget(self, name: str, taken: bool = False) -> None:
        records.drop(self._record_path(name), taken)

    async def attach(self, name: str) -> None:
        """Follow a detached job started by an earlier kernel: its events, then its results."""
        if name in self._jobs:
            return
        rec = records.load(self._record_path(name))
        if rec is None:
            raise NoSuchJob(name)
        if "taken" in rec:
            raise JobSpecError(
                f"the results of job {name!r} were already taken by an earlier attach (results come back "
                "once; they are not kept after that)"
            )
        root = await self._root(name)
        if root is None or root["metadata"]["uid"] != rec["root_uid"]:
            self._forget(name)
            raise JobSpecError(
                f"job {name!r} has ended and its results are gone (they are kept until fetched once, or "
                "for the retention time)"
            )
        job = _Job(
            spec=JobSpec(**rec["spec"]),
            token=rec["token"],
            created=rec["created"],
            root_uid=rec["root_uid"],
            job_uids=set(rec["job_uids"]),
            detach=True,
        )
        self._jobs[name] = job
        job.tasks.append(asyncio.ensure_future(self._connect(name)))

    async def _connect(self, name: str) -> None:
        """The agent of an attached job (its payload was delivered by the kernel that started it)."""
        job = self._jobs[name]
        try:
            job.agent = AgentClient(f"http://{await self._chief_ip(job)}:{mf.AGENT_PORT}", job.token)
        except Exception as exc:
            job.delivery_error = exc
        finally:
            job.delivered.set()

    async def close(self) -> None:
        """The kernel is going: attached jobs go with it now (the lifeline would end them within the grace);
        detached ones stay."""
        for name, job in list(self._jobs.items()):
            if not job.detach:
                with contextlib.suppress(Exception):
                    await self.stop(name)
            else:
                self._finish(name)
                if job.agent is not None:
                    await job.agent.close()
        self._jobs.clear()
        if self._api is not None:
            await self._api.close()
            self._api = None
