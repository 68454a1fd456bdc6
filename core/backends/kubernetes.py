"""The Kubernetes backend: the kernel submits, watches and fetches; the cluster runs the job.

A job is a root batch/v1 Job (the coordinator) owning Indexed Jobs for the PS and the workers, a headless
Service, a NetworkPolicy and a token Secret (tfdist.kube.manifests). Worker restarts, completion and
clean-up are the Job controller's, the TTL controller's and the garbage collector's, whether or not a
kernel is watching. The pods followed are the ones whose controlling Job this backend created (by UID),
never pods that merely carry the job's labels; only the root Job's own pod gets the payload, and the
channel to it is signed both ways (tfdist.kube.signing, tfdist.kube.transport).

This module is the composition and the rest of the interface (stop, status with the place in Kueue's
line, list, logs, results, close); its parts are mixed in: submitting (`kubesubmit`: admission checks,
all-or-nothing creation, the detached handover), the kernel's background work for a job (`kubework`:
delivery, lifeline, samples), watching (`kubewatch`) and detached records and attach (`kubedetach`). The
API calls are tfdist.kube.cluster's, the pod watch tfdist.kube.podwatch's, the state derivation
tfdist.kube.status's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from ..errors import NoSuchJob
from ..job.vocab import JobState, Reason
from ..jobrecords import JobSummary
from ..jobspec import JobSpec
from ..jobview import JobView
from ..kube import checkpoints, lifeline, records
from ..kube import names as kn
from ..kube import podtemplate as pt
from ..kube import status as st
from ..kube.cluster import KubeApi, controller_uid, current_namespace
from ..kube.queueing import L_QUEUE
from ..kube.queueing_apply import read_position
from ..settings import Settings
from .base import Backend
from .kubedetach import KubeDetachedJobs
from .kubesubmit import QUOTA_RELEASE_WAIT_S, KubeSubmit
from .kubewatch import KubeWatch
from .kubework import KubeJob, KubeJobWork

__all__ = ["QUOTA_RELEASE_WAIT_S", "KubeJob", "KubernetesBackend"]


class KubernetesBackend(KubeSubmit, KubeWatch, KubeDetachedJobs, KubeJobWork, Backend):
    name = "kubernetes"

    def __init__(self, settings: Settings, kubeconfig: str | None = None):
        self.settings = settings
        self.namespace = current_namespace(settings.namespace)
        self.kube = KubeApi(kubeconfig or os.environ.get("KUBECONFIG"))
        self._jobs: dict[str, KubeJob] = {}
        self._ended: set[str] = set()  # jobs this backend stopped or took the results of
        # jobs the user stopped (not Kueue): a preempted one waiting to go back in line stays stopped; a
        # new submit of the name clears it
        self._stop_requested: set[str] = set()
        self.node_selector: dict[str, str] | None = settings.gpu_node_selector
        self.tolerations: list[dict] | None = settings.gpu_tolerations
        # the profile's GPU model (a MIG profile is a resource of its own); whole GPUs without one
        self.gpu_resource: str = settings.gpu_resource or pt.GPU_RESOURCE
        self.notebook_labels: dict[str, str] | None = (
            kn.notebook_pod_labels(settings.user) if settings.pod_name else None
        )
        self.lifeline_grace_s: float = settings.lifeline_grace_s
        self.lifeline_renew_s: float = lifeline.renew_every(settings.lifeline_grace_s)

    async def _root(self, name: str) -> dict[str, Any] | None:
        return await self.kube.read_job(name, self.namespace)

    async def _list_pods(self, sel: str) -> dict[str, Any]:
        return await self.kube.list_pods(self.namespace, sel)

    def _selector(self, name: str) -> str:
        return f"{kn.L_JOB}={name},{kn.L_USER}={kn.user_label(self.settings.user)}"

    def _ours(self, name: str, pod: dict[str, Any]) -> bool:
        """A pod of a Job this backend created (by UID). Without a local record (another kernel's job,
        shown read-only) any pod with the job's labels."""
        job = self._jobs.get(name)
        return job is None or controller_uid(pod) in job.job_uids

    # ------------------------------------------------------------------ the rest of the interface
    async def stop(self, name: str, reason: str = Reason.STOPPED) -> bool:
        """Delete the root: the garbage collector takes everything it owns, pods first."""
        self._ended.add(name)
        if reason != Reason.PREEMPTED:
            self._stop_requested.add(name)
            with contextlib.suppress(OSError):  # for this server's other processes (kubewatch._resubmit)
                records.save(self._stop_path(name), {"t": time.time(), "reason": str(reason)})
        self._finish(name)
        job = self._jobs.pop(name, None)
        if job is not None:
            others = [t for t in job.tasks if t is not asyncio.current_task()]
            await asyncio.gather(*others, return_exceptions=True)  # cancelled: let them unwind first
            if job.agent is not None:
                await job.agent.close()
        self._forget(name)
        if reason != Reason.PREEMPTED:  # a preempted job's checkpoint goes back with it (kubewatch)
            # what the kernel kept of its checkpoints (model weights, up to 512 MiB each): a stopped
            # job's are of no use to anyone, and its name (random by default) is never seen again
            checkpoints.drop(self.settings.state_dir, self.namespace, name)
        return await self.kube.delete("Job", name, self.namespace)

    async def status(self, name: str) -> JobView:
        root = await self._root(name)
        pods = [p for p in (await self._list_pods(self._selector(name)))["items"] if self._ours(name, p)]
        job = self._jobs.get(name)
        if root is None and not pods and job is None:
            raise NoSuchJob(name)
        spec = job.spec if job else None
        ann = ((root or {}).get("metadata", {}).get("annotations") or {}).get(kn.A_SPEC)
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
        sel = f"{kn.L_ROOT}=true,{kn.L_USER}={kn.user_label(self.settings.user)}"
        roots = await self.kube.list_root_jobs(self.namespace, sel)
        out = []
        for name in sorted(set(roots) | set(self._jobs)):
            with contextlib.suppress(NoSuchJob):
                summary = (await self.status(name)).summary()
                summary |= self.detach_summary(name, summary.get("ended")).fields()
                out.append(JobSummary.model_validate(summary))
        return out

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
