"""Submitting a Kubernetes job: the admission checks, the all-or-nothing creation, the detached handover.

Why a module of its own: everything before the job runs is one question, "may it start, and did all of it
start?". A job its Kueue queue can never hold, or that the namespace's quota cannot admit now, is refused
before anything is created; every Job is created suspended, so a refusal half-way (or an interrupted
cell) rolls back and leaves no pod. The checks run together, the objects are created together and the Jobs
resumed together: three round trips after the checks, whatever the job's size, and no pod starts before the
objects it needs (its token Secret) exist. A detached job returns only once its pods hold the cell.
`KubernetesBackend` mixes it in; it needs the backend's state, `_deliver`, `_lifeline`, `_remember`,
`stop` and `retention`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import BackendUnavailable, JobSpecError, TfdistError
from ..job import detach as dt
from ..job.vocab import Reason
from ..jobspec import JobSpec, validate
from ..kube import allreduce, runas, transport
from ..kube import datavolumes as dv
from ..kube import manifests as mf
from ..kube import names as kn
from ..kube.api_errors import translate
from ..kube.cluster import KubeApi, job_resources, quota_shortfall
from ..kube.queueing_apply import queue_refusal
from ..kube.queueline import job_demand
from ..settings import Settings
from .base import Launch
from .kubework import KubeJob

# a job refused for quota that this user's ending jobs still hold waits this long for them to let go
QUOTA_RELEASE_WAIT_S = 90.0
UNRESUMED_AFTER_S = 120.0  # a root still suspended this long after its creation: a dead submit's leftover
# the root's uid in its children's dry run (the root is not created yet)
DRY_RUN_UID = "00000000-0000-0000-0000-000000000000"
T = TypeVar("T")


class KubeSubmit:
    """The submitting half of `KubernetesBackend`."""

    settings: Settings
    namespace: str
    kube: KubeApi
    _jobs: dict[str, KubeJob]
    _ended: set[str]
    _stop_requested: set[str]
    node_selector: dict[str, str] | None
    tolerations: list[dict] | None
    gpu_resource: str
    notebook_labels: dict[str, str] | None
    lifeline_grace_s: float

    if TYPE_CHECKING:

        async def _root(self, name: str) -> dict[str, Any] | None: ...
        async def _list_pods(self, sel: str) -> dict[str, Any]: ...
        async def _deliver(self, name: str) -> None: ...
        async def _lifeline(self, name: str, root: dict[str, Any]) -> None: ...
        def _remember(self, job: KubeJob, retention_s: float) -> None: ...
        async def stop(self, name: str, reason: str = Reason.STOPPED) -> bool: ...
        def retention(self) -> dt.Retention: ...
        def _stop_path(self, name: str) -> str: ...

    async def _sweep_unresumed(self) -> list[str]:
        """Delete this user's roots that a submit created and never resumed (its kernel SIGKILLed between
        the two, a rollback whose deletes failed): a suspended Job never starts, so its deadline (the
        lifeline) never fires, and it held the name, the quota's counts and its objects until the
        notebook's pod went. Every submit resumes its Jobs within seconds of creating them: a root still
        suspended and never written since its creation (generation 1: a resume, a user's own suspend or
        Kueue's would have raised it) after UNRESUMED_AFTER_S is such a leftover. Errors are swallowed (the
        submit's own checks say what matters)."""
        sel = f"{kn.L_ROOT}=true,{kn.L_USER}={kn.user_label(self.settings.user)}"
        try:
            roots = await self.kube.list_job_objects(self.namespace, sel)
        except Exception:
            return []
        gone = []
        now = time.time()
        for r in roots:
            meta, status = r.get("metadata") or {}, r.get("status") or {}
            name = meta.get("name") or ""
            if not (r.get("spec") or {}).get("suspend") or status.get("startTime") or name in self._jobs:
                continue
            if meta.get("generation") != 1:  # written since: resumed once, or suspended by someone
                continue
            created = _timestamp(meta.get("creationTimestamp"))
            if created is None or now - created < UNRESUMED_AFTER_S or meta.get("deletionTimestamp"):
                continue
            with contextlib.suppress(Exception):
                await self.kube.delete("Job", name, self.namespace)
                gone.append(name)
        return gone

    async def submit(self, spec: JobSpec, payload: bytes, launch: Launch) -> None:
        self.unclaim(spec.name)
        self._stop_requested.discard(spec.name)  # (kubewatch._resubmit checks it before calling this)
        with contextlib.suppress(OSError):
            os.unlink(self._stop_path(spec.name))
        await self._sweep_unresumed()
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
        validate(spec, None)  # the magic checked it too; a direct caller of the backend gets the same
        detach = spec.detach
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
        # every pod of the job mounts the profile's data volumes where the notebook has them
        data, identity = self.settings.data_volumes, self.settings.pod_identity
        dv.with_data_volumes(root, data)
        runas.with_identity(root, identity)  # every pod as the notebook's user (the shared data volumes)
        # The checks read and create nothing, so they run together; the first refusal cancels the others.
        # A job its queue can never hold is refused at once, not after the namespace's quota waited for
        # this user's ending jobs to let go.
        await first_refusal(
            self._check_name(spec), self._check_queue(spec, build, root), self._check_quota(spec)
        )

        def children(root_uid: str) -> list[dict[str, Any]]:
            objects = build.job_objects(
                spec,
                token=token,
                root=kn.root_reference(spec, root_uid),
                notebook_labels=self.notebook_labels,
                node_selector=self.node_selector,
                tolerations=self.tolerations,
                gpu_resource=self.gpu_resource,
                queue=self.settings.kueue_queue,
            )
            for obj in objects:
                dv.with_data_volumes(obj, data)
                runas.with_identity(obj, identity)
                if obj["kind"] == "Job":
                    obj["spec"]["suspend"] = True
            return objects

        # Every object through the API server's validation, admission and quota first, none stored: a job
        # refused there (a worker Job the admission policy denies) is refused before its root, Secret,
        # Service and policy exist even for a moment (a rollback would leave nothing, but they would have
        # been there: other watchers, Kueue among them, would have seen them)
        await self._dry_run([root, *children(DRY_RUN_UID)], spec)
        self._claim(spec.name)
        created: list[dict[str, Any]] = []
        # All or nothing, also when the cell is interrupted half-way (CancelledError): the clean-up is
        # shielded from the cancellation that triggered it. Every Job is created suspended and all of them
        # are resumed together at the end: no pod of a job that is refused half-way ever exists, and no
        # pod waits for another object of its job to be created after it.
        try:
            root = await self._create_translated(root, spec)
            created.append(root)
            await self._create_all(children(root["metadata"]["uid"]), spec, created)
            resumed = await self._resume_all([o for o in created if o["kind"] == "Job"], spec)
            root = resumed[0]
        except BaseException:
            await asyncio.shield(self._rollback(created))
            raise
        job = KubeJob(
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

    async def _handed_over(self, job: KubeJob) -> None:
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

    async def _check_name(self, spec: JobSpec) -> None:
        try:
            exists = await self._root(spec.name) is not None
        except Exception as exc:
            raise translate(exc, "Job", spec.name, spec.namespace or "") from None
        if exists:
            raise JobSpecError(
                f"a job named {spec.name!r} already exists in namespace {spec.namespace!r}: "
                f"pick another --name or `%tfdist stop {spec.name}`"
            )

    async def _create_translated(
        self, obj: dict[str, Any], spec: JobSpec, dry_run: bool = False
    ) -> dict[str, Any]:
        try:
            return await self.kube.create(obj, dry_run=dry_run)
        except Exception as exc:
            raise translate(exc, obj["kind"], obj["metadata"]["name"], spec.namespace or "") from None

    async def _dry_run(self, objects: list[dict[str, Any]], spec: JobSpec) -> None:
        """All of `objects` created with dryRun=All at once (one round trip); the first refusal raised."""
        await all_then_first_error([self._create_translated(o, spec, dry_run=True) for o in objects])

    async def _create_all(
        self, objects: list[dict[str, Any]], spec: JobSpec, created: list[dict[str, Any]]
    ) -> None:
        """Create `objects` at once (one round trip, not one each). Every answer is awaited before a
        refusal is raised, so that `created` holds everything the rollback must delete."""

        async def create(obj: dict[str, Any]) -> None:
            created.append(await self._create_translated(obj, spec))

        await all_then_first_error([create(o) for o in objects])

    async def _resume_all(self, jobs: list[dict[str, Any]], spec: JobSpec) -> list[dict[str, Any]]:
        """Unsuspend every Job of the job at once (the root first in `jobs`, and in the answer).

        Unconditionally (no resourceVersion): the Job controller writes its Suspended condition into the
        status of each Job just created, so the version the create returned is always stale, and a
        conditional update cost a conflict, a read and a second update per Job. Nothing else writes a
        Job's spec between its creation and this (the status is not written through this update)."""

        async def resume(job: dict[str, Any]) -> dict[str, Any]:
            meta = {k: v for k, v in job["metadata"].items() if k != "resourceVersion"}
            try:
                return await self._replace_root(
                    {**job, "metadata": meta, "spec": {**job["spec"], "suspend": False}}
                )
            except TfdistError:
                raise
            except Exception as exc:
                raise translate(exc, "Job", job["metadata"]["name"], spec.namespace or "") from None

        return await all_then_first_error([resume(j) for j in jobs])

    async def _rollback(self, created: list[dict[str, Any]]) -> None:
        """Delete what was created: the root's children first, then the root (whose garbage collection
        would take them too, but later)."""

        async def delete(obj: dict[str, Any]) -> None:
            with contextlib.suppress(Exception):
                await self.kube.delete(obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"])

        await asyncio.gather(*(delete(o) for o in created[1:]))
        if created:
            await delete(created[0])

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
            pods = (await self._list_pods(f"{kn.L_USER}={kn.user_label(self.settings.user)}"))["items"]
        except Exception:
            return False
        for p in pods:
            meta = p.get("metadata") or {}
            if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue  # a finished pod holds no quota
            if meta.get("deletionTimestamp") or (meta.get("labels") or {}).get(kn.L_JOB) in self._ended:
                return True
        return False

    async def _quota_shortfall(self, spec: JobSpec) -> str | None:
        quotas = await self.kube.quotas(spec.namespace or self.namespace)
        return quota_shortfall(job_resources(spec, self.gpu_resource), quotas or [])

    def _owner(self) -> dict[str, Any] | None:
        if self.settings.pod_name and self.settings.pod_uid:
            return kn.owner_reference(self.settings.pod_name, self.settings.pod_uid)
        return None


async def first_refusal(*checks: Coroutine[Any, Any, None]) -> None:
    """Run `checks` together and raise the refusal of the first in their order that refuses: a refusal
    waits only for the checks before it, and cancels those after it (a quota wait, say). Where several
    refuse the same job (a queue and a quota both too small), the sentence is the same on every run, not
    whichever answer came back first."""
    tasks = [asyncio.ensure_future(c) for c in checks]
    try:
        for task in tasks:
            await task
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def all_then_first_error(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Await every call, in parallel; then raise the first failure (in `calls`' order), or return the
    answers in that order. Unlike a bare gather, nothing is still in flight when the caller rolls back."""
    got = await asyncio.gather(*calls, return_exceptions=True)
    for r in got:
        if isinstance(r, BaseException):
            raise r
    return list(got)  # type: ignore[arg-type]


def _timestamp(value: Any) -> float | None:
    """An API timestamp (an RFC 3339 string, or the datetime the client made of it) in epoch seconds."""
    from datetime import datetime

    if isinstance(value, datetime):
        return value.timestamp()
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
