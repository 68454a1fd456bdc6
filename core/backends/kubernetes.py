"""The Kubernetes backend: the kernel submits, watches and fetches; the cluster runs the job.

A job is a root batch/v1 Job (the coordinator) owning Indexed Jobs for the PS and the workers, a headless
Service, a NetworkPolicy and a token Secret (tfdist.kube.manifests). Worker restarts, completion and
clean-up are the Job controller's, the TTL controller's and the garbage collector's, whether or not a
kernel is watching. `submit` creates everything all-or-nothing (the root is created suspended, so a
refusal leaves no pod), then hands the payload to the coordinator's agent once, in the background, and —
unless the job is detached — keeps the lifeline (tfdist.kube.lifeline). `watch` and `status` only read,
through one derivation (tfdist.kube.status). The pods followed are the ones whose controlling Job this
backend created (by UID), never pods that merely carry the job's labels; only the root Job's own pod gets
the payload, and the channel to it is signed both ways (tfdist.kube.signing, tfdist.kube.transport).

This module holds the job logic; the API calls are tfdist.kube.cluster's, the pod watch
tfdist.kube.podwatch's.
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
from ..job import detach as dt
from ..job.detach import DetachSummary
from ..job.events import ErrorInfo, Event, MetricsEvent, Reader, SnapshotEvent, StateEvent
from ..job.vocab import JobState, Reason
from ..jobrecords import JobSummary
from ..jobspec import JobSpec
from ..jobview import JobView
from ..kube import allreduce, lifeline, records, transport
from ..kube import manifests as mf
from ..kube import status as st
from ..kube.agent_client import AgentClient
from ..kube.api_errors import translate
from ..kube.cluster import KubeApi, controller_uid, current_namespace, job_resources, quota_shortfall
from ..kube.podwatch import PodWatch
from ..kube.queueing import L_QUEUE, job_demand
from ..kube.queueing_apply import queue_events, queue_refusal, read_position
from ..settings import Settings
from .base import Backend, Launch

# a job refused for quota that this user's ending jobs still hold waits this long for them to let go
QUOTA_RELEASE_WAIT_S = 90.0


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
    sampled: float = 0.0  # when its latest metrics sample was last written for this server (records.live)


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(self, settings: Settings, kubeconfig: str | None = None):
        self.settings = settings
        self.namespace = current_namespace(settings.namespace)
        self.kube = KubeApi(kubeconfig or os.environ.get("KUBECONFIG"))
        self._jobs: dict[str, _Job] = {}
        self._ended: set[str] = set()  # jobs this backend stopped or took the results of
        self.node_selector: dict[str, str] | None = settings.gpu_node_selector
        self.tolerations: list[dict] | None = settings.gpu_tolerations
        # the profile's GPU model (a MIG profile is a resource of its own); whole GPUs without one
        self.gpu_resource: str = settings.gpu_resource or mf.GPU_RESOURCE
        self.notebook_labels: dict[str, str] | None = (
            mf.notebook_pod_labels(settings.user) if settings.pod_name else None
        )
        self.lifeline_grace_s: float = settings.lifeline_grace_s
        self.lifeline_renew_s: float = lifeline.renew_every(settings.lifeline_grace_s)

    async def _root(self, name: str) -> dict[str, Any] | None:
        return await self.kube.read_job(name, self.namespace)

    async def _list_pods(self, sel: str) -> dict[str, Any]:
        return await self.kube.list_pods(self.namespace, sel)

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
        detach = spec.detach
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
        token = secrets.token_urlsafe(32)
        retention = self.retention().seconds  # the rule it was started under (tfdist.job.detach)
        # all-reduce (tfdist.kube.allreduce): chief-0 is a replica too (GPUs, placement), no PS Job
        build: Any = allreduce if spec.strategy == allreduce.STRATEGY else mf
        placement = (
            {
                "node_selector": self.node_selector,
                "tolerations": self.tolerations,
                "gpu_resource": self.gpu_resource,
            }
            if build is allreduce
            else {}
        )
        root = build.root_job(
            spec,
            self._owner(),
            queue=self.settings.kueue_queue,
            result_wait_s=retention if detach else None,
            lifeline_s=None if detach else self.lifeline_grace_s,
            **placement,
        )
        # a job its queue can never hold is refused at once, before the namespace's quota may wait for
        # this user's ending jobs to let go
        await self._check_queue(spec, build, root)
        await self._check_quota(spec)
        created: list[dict[str, Any]] = []
        # All or nothing, also when the cell is interrupted half-way (CancelledError): the clean-up is
        # shielded from the cancellation that triggered it. The root is suspended until the end: no pod
        # of a job that is refused half-way ever exists.
        try:
            root = await self._create_translated(root, spec)
            created.append(root)
            owner = mf.root_reference(spec, root["metadata"]["uid"])
            for obj in build.job_objects(
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
            self._remember(job, retention)
        job.tasks.append(asyncio.ensure_future(self._deliver(spec.name)))
        if detach:
            await self._handed_over(job)
        else:
            job.tasks.append(asyncio.ensure_future(self._lifeline(spec.name, root)))

    async def _handed_over(self, job: _Job) -> None:
        """A detached job runs without this kernel only once its pods hold the cell: returning before
        that lost the job to a kernel that died in the next seconds (its coordinator waited for a payload
        nobody would send). Failed, past --timeout or interrupted here, the job is stopped, not left."""
        name, limit = job.spec.name, job.spec.timeout_s + transport.AGENT_GRACE_S
        try:
            await asyncio.wait_for(job.delivered.wait(), limit)
        except TimeoutError:
            await asyncio.shield(self.stop(name))
            raise BackendUnavailable(
                f"job {name!r}: its pods did not take the cell within --timeout {job.spec.timeout_s:g}s + "
                f"{transport.AGENT_GRACE_S:g}s, so it was stopped (nothing of it is left)"
            ) from None
        except BaseException:  # the cell was interrupted: a detached job nobody handed its cell to
            await asyncio.shield(self.stop(name, Reason.INTERRUPTED))
            raise
        if job.delivery_error is not None:
            err = job.delivery_error
            await asyncio.shield(self.stop(name))
            raise err

    async def _create_translated(self, obj: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
        try:
            return await self.kube.create(obj)
        except Exception as exc:
            raise translate(exc, obj["kind"], obj["metadata"]["name"], spec.namespace or "") from None

    async def _rollback(self, created: list[dict[str, Any]]) -> None:
        for obj in reversed(created):
            with contextlib.suppress(Exception):
                await self.kube.delete(obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"])

    async def _replace_root(self, root: dict[str, Any]) -> dict[str, Any]:
        return await self.kube.replace_job(root, keep=("suspend", "activeDeadlineSeconds"))

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

    async def _check_queue(self, spec: JobSpec, build: Any, root: dict[str, Any]) -> None:
        """Refuse, before anything is created, a job that its Kueue queue can never hold (more than its quota
        plus what its cohort could ever lend), with the numbers; a job that only has to wait is queued."""
        queue = self.settings.kueue_queue
        if not queue:
            return
        objects = build.job_objects(
            spec,
            token="",
            node_selector=self.node_selector,
            tolerations=self.tolerations,
            gpu_resource=self.gpu_resource,
            queue=queue,
        )
        demand = job_demand([root, *objects])
        why = await queue_refusal(await self.kube.api(), self.namespace, queue, demand, self.node_selector)
        if why is not None:
            raise JobSpecError(why)

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
        quotas = await self.kube.quotas(spec.namespace or self.namespace)
        return quota_shortfall(job_resources(spec, self.gpu_resource), quotas or [])

    def _owner(self) -> dict[str, Any] | None:
        if self.settings.pod_name and self.settings.pod_uid:
            return mf.owner_reference(self.settings.pod_name, self.settings.pod_uid)
        return None

    # ------------------------------------------------------------------ background work of a job
    async def _deliver(self, name: str) -> None:
        """Hand the payload to the root Job's own pod, once (tfdist.kube.transport)."""
        job = self._jobs[name]
        try:
            job.agent = transport.client_for(await self._chief_ip(job), job.token)
            await transport.deliver(job.agent, job.payload or b"", job.created, job.spec.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            job.delivery_error = exc
        finally:
            job.payload = None  # delivered or failed: the kernel keeps no copy (it may be hundreds of MB)
            job.delivered.set()

    async def _chief_ip(self, job: _Job) -> str:
        sel = f"{self._selector(job.spec.name)},{mf.L_ROLE}=chief"
        return await transport.chief_ip(self.kube, self.namespace, sel, job.root_uid)

    async def _lifeline(self, name: str, root: dict[str, Any]) -> None:
        job = self._jobs[name]
        await lifeline.keep(self.kube, root, lambda: job.done, self.lifeline_grace_s, self.lifeline_renew_s)

    def _finish(self, name: str) -> None:
        job = self._jobs.get(name)
        if job is None:
            return
        job.done = True
        for t in job.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        with contextlib.suppress(OSError):
            os.unlink(self._live_path(name))

    def _live_path(self, name: str) -> str:
        return records.live_path(self.settings.state_dir, self.namespace, name)

    def _sampled(self, job: _Job, ev: MetricsEvent) -> None:
        """Leave the job's latest sample where this server's other processes read it (records.live_path)."""
        now = time.time()
        if job.done or now - job.sampled < records.LIVE_EVERY_S:
            return
        job.sampled = now
        with contextlib.suppress(OSError, TypeError, ValueError):
            records.save(self._live_path(job.spec.name), {"t": ev.t or now, "tasks": ev.tasks})

    # ------------------------------------------------------------------ watch
    async def watch(self, name: str) -> AsyncIterator[Event]:
        """Pod events (scheduling, task states) merged with the coordinator agent's (progress, metrics,
        logs) once the payload is delivered, as records. Reads only: the cluster runs the job."""
        view = await self.status(name)
        yield SnapshotEvent(view=view.to_dict())
        if view.finished:
            return
        q: asyncio.Queue[Event] = asyncio.Queue()

        async def pump(source: AsyncIterator[Any], origin: str, what: str) -> None:
            said = Reader(origin)  # the pod watch's wire dicts become records here (records pass through)
            try:
                async for raw in source:
                    for ev in said.obj(raw):
                        await q.put(ev)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never leave the cell waiting on a dead watcher
                await q.put(
                    StateEvent(
                        state=JobState.FAILED,
                        t=time.time(),
                        message=f"{what}: {exc}"[:4096],
                        error=ErrorInfo(type=type(exc).__name__[:200], message=str(exc)[:4096]),
                    )
                )

        pods = pump(self._pod_events(name, view), "the job's pods", "lost track of the job's pods")
        workers = [asyncio.ensure_future(pods)]
        if name in self._jobs:
            agent = pump(self._agent_events(name), "the job's agent", "the coordinator")
            workers.append(asyncio.ensure_future(agent))
        if name in self._jobs and self.settings.kueue_queue:  # its place in Kueue's line while it waits
            line = queue_events(await self.kube.api(), self.namespace, name, self.settings.kueue_queue)
            workers.append(asyncio.ensure_future(pump(line, "Kueue", "lost track of the job's queue")))
        try:
            while True:
                ev = await q.get()
                final = isinstance(ev, StateEvent) and ev.state.terminal
                if final and ev.state != JobState.SUCCEEDED:
                    await self._release(name)
                    self._finish(name)
                yield ev
                if final:
                    return
        finally:
            for w in workers:
                w.cancel()

    async def _release(self, name: str) -> None:
        """A job that ended without results: the notebook has its verdict, so its coordinator need not wait
        (60 s) for the notebook to read it; the root ends now and its TTL frees the rest within seconds."""
        self._ended.add(name)
        job = self._jobs.get(name)
        if job is not None and job.agent is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(job.agent.done(), 10)

    async def _agent_events(self, name: str) -> AsyncIterator[Event]:
        job = self._jobs[name]
        await job.delivered.wait()
        if job.delivery_error is not None:  # the kernel's own verdict: end the job now, not at the deadline
            err = job.delivery_error
            await self.stop(name)
            raise err
        assert job.agent is not None
        async for ev in job.agent.events():
            if isinstance(ev, MetricsEvent):
                self._sampled(job, ev)
            yield ev

    def _pod_events(self, name: str, view: JobView) -> AsyncIterator[dict[str, Any]]:
        job = self._jobs.get(name)
        return PodWatch(
            kube=self.kube,
            namespace=self.namespace,
            name=name,
            selector=self._selector(name),
            ours=lambda pod: self._ours(name, pod),
            expected=job.spec.task_count if job else view.total_tasks,
            deadline=(job.created if job else view.created) + (job.spec.timeout_s if job else 600),
            timeout_s=job.spec.timeout_s if job else 600,
            on_timeout=(lambda: self.stop(name)) if job is not None else None,
            strategy=job.spec.strategy if job else view.spec.get("strategy", "ps"),
        ).events()

    # ------------------------------------------------------------------ the rest of the interface
    async def stop(self, name: str, reason: str = Reason.STOPPED) -> bool:
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
        return await self.kube.delete("Job", name, self.namespace)

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
        view = st.view(name, spec, pods, root, created)
        await self._place_in_line(view, root)
        if not view.finished and not view.metrics:  # another process of this server follows it
            live = records.load_live(self._live_path(name))
            if live is not None:
                view.metrics.append({"t": live["t"], "tasks": live["tasks"]})
        return view

    async def _place_in_line(self, view: JobView, root: dict[str, Any] | None) -> None:
        """A job Kueue has not admitted yet: its place in line (`%tfdist list`, the panel), read once. The
        queue is the one on its root Job (another kernel's job too), else this server's. Nothing where
        Kueue is absent or the Workloads are not readable: the queue is news, never a reason to fail."""
        labels = ((root or {}).get("metadata") or {}).get("labels") or {}
        queue = labels.get(L_QUEUE) or self.settings.kueue_queue
        if not queue or view.finished or view.state not in (JobState.PENDING, JobState.STARTING):
            return
        try:
            pos = await read_position(await self.kube.api(), self.namespace, view.name, queue)
        except Exception:
            return
        if pos is not None and not pos.admitted:
            view.apply(pos.event())

    async def list_jobs(self) -> list[JobSummary]:
        sel = f"{mf.L_ROOT}=true,{mf.L_USER}={mf.user_label(self.settings.user)}"
        roots = await self.kube.list_root_jobs(self.namespace, sel)
        out = []
        for name in sorted(set(roots) | set(self._jobs)):
            with contextlib.suppress(NoSuchJob):
                summary = (await self.status(name)).summary()
                summary |= self.detach_summary(name, summary.get("ended")).fields()
                out.append(JobSummary.model_validate(summary))
        return out

    def detach_summary(self, name: str, ended: float | None = None) -> DetachSummary:
        """From this server's record of the detached job (the kernel that started it wrote it): results
        waiting in the coordinator pod until the retention passes after the end, or already taken
        (`tfdist.job.detach.summary`)."""
        return dt.summary(records.load(self._record_path(name)), ended)

    async def logs(self, name: str, task: str | None = None, tail: int | None = None) -> dict[str, str]:
        from kubernetes_asyncio.client.exceptions import ApiException

        pods = [p for p in (await self._list_pods(self._selector(name)))["items"] if self._ours(name, p)]
        if not pods:
            raise NoSuchJob(name)
        out = {}
        for p in st.newest_per_task(pods):
            t = st.pod_task(p) or p["metadata"]["name"]
            if task and t != task:
                continue
            try:
                out[t] = await self.kube.pod_log(self.namespace, p["metadata"]["name"], tail)
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
                await self.kube.delete("Job", name, self.namespace)
            return data
        finally:
            self._finish(name)
            await job.agent.close()
            self._jobs.pop(name, None)
            self._forget(name, taken=True)

    # ------------------------------------------------------------------ detach / attach
    def _record_path(self, name: str) -> str:
        return records.path(self.settings.state_dir, self.namespace, name)

    def _remember(self, job: _Job, retention_s: float) -> None:
        """A detached job's token and identity, for `%tfdist attach` in a later kernel of this server."""
        rec = {
            "spec": json.loads(job.spec.to_json()),
            "token": job.token,
            "root_uid": job.root_uid,
            "job_uids": sorted(job.job_uids),
            "created": job.created,
            "retention_s": retention_s,
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
        if dt.taken(rec):
            raise JobSpecError(dt.already_taken(name))
        root = await self._root(name)
        if root is None or root["metadata"]["uid"] != rec["root_uid"]:
            self._forget(name)
            raise JobSpecError(dt.results_gone(name))
        job = _Job(
            spec=JobSpec.from_dict(rec["spec"]),
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
            job.agent = transport.client_for(await self._chief_ip(job), job.token)
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
        await self.kube.close()
