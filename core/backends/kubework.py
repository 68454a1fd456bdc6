"""What the kernel does in the background for a Kubernetes job it holds: the job's record, the delivery of
the payload, the lifeline and the latest metrics sample.

Why a module of its own: the cluster runs the job; the kernel keeps only a few tasks beside it, each one
started by submit or attach and cancelled by `_finish`. The payload goes once to the root Job's own pod
(tfdist.kube.transport) and is dropped then; the lifeline (tfdist.kube.lifeline) keeps a job whose kernel
is alive from its deadline; the sample is written where this server's other processes read it
(tfdist.kube.records.live_path). `KubernetesBackend` mixes it in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

from ..job.events import MetricsEvent
from ..jobspec import JobSpec
from ..kube import checkpoints, lifeline, records, transport
from ..kube import names as kn
from ..kube.agent_client import AgentClient
from ..kube.cluster import KubeApi
from ..settings import Settings


@dataclasses.dataclass
class KubeJob:
    """A job this kernel submitted or attached to: what it needs to reach the job's agent and pods."""

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


class KubeJobWork:
    """The background half of `KubernetesBackend`."""

    settings: Settings
    namespace: str
    kube: KubeApi
    _jobs: dict[str, KubeJob]
    _stop_requested: set[str]
    lifeline_grace_s: float
    lifeline_renew_s: float

    if TYPE_CHECKING:

        def _selector(self, name: str) -> str: ...

    async def _deliver(self, name: str) -> None:
        """Hand the payload to the root Job's own pod, once (tfdist.kube.transport)."""
        job = self._jobs[name]
        kept = self._kept_checkpoint(job)
        resume = kept if kept is not None and checkpoints.resuming(kept) else None
        try:
            job.agent = transport.client_for(await self._chief_ip(job), job.token)
            if resume is not None:  # a readmitted job resumes from the checkpoint its evicted run left
                await checkpoints.hand_back(job.agent, resume, job.created, job.spec.timeout_s)
            await transport.deliver(job.agent, job.payload or b"", job.created, job.spec.timeout_s)
            if kept is not None:
                job.tasks.append(asyncio.ensure_future(checkpoints.follow(job.agent, kept)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            job.delivery_error = exc
        finally:
            if not self.settings.kueue_queue:  # a queued job may be preempted and sent again (kubewatch)
                job.payload = None  # delivered or failed: the kernel keeps no copy (it may be hundreds of MB)
            job.delivered.set()

    def _kept_checkpoint(self, job: KubeJob) -> str | None:
        """Where the kernel keeps the newest checkpoint of a job Kueue may preempt (tfdist.kube.checkpoints):
        a queued --checkpoint-every job whose cell this kernel holds; else None."""
        if not (job.spec.checkpoint_every and self.settings.kueue_queue and job.payload and not job.detach):
            return None
        digest = checkpoints.payload_digest(job.payload)
        return checkpoints.kept_path(self.settings.state_dir, self.namespace, job.spec.name, digest)

    async def _chief_ip(self, job: KubeJob) -> str:
        sel = f"{self._selector(job.spec.name)},{kn.L_ROLE}=chief"
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

    def _stop_path(self, name: str) -> str:
        return records.stop_path(self.settings.state_dir, self.namespace, name)

    def _stopped_by_user(self, name: str) -> bool:
        """This kernel or another process of this server (the lab panel, another kernel) stopped `name`
        since its last submit."""
        return name in self._stop_requested or os.path.exists(self._stop_path(name))

    def _sampled(self, job: KubeJob, ev: MetricsEvent) -> None:
        """Leave the job's latest sample where this server's other processes read it (records.live_path)."""
        now = time.time()
        if job.done or now - job.sampled < records.LIVE_EVERY_S:
            return
        job.sampled = now
        with contextlib.suppress(OSError, TypeError, ValueError):
            records.save(self._live_path(job.spec.name), {"t": ev.t or now, "tasks": ev.tasks})
