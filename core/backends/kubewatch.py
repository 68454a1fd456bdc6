"""Watching a Kubernetes job: its pods' events, its agent's and its place in Kueue's line, merged into one
stream of records.

Why a module of its own: `watch` only reads (the cluster runs the job). Three sources, each pumped into
one queue: the pod watch (tfdist.kube.podwatch: scheduling, task states, the verdict), the coordinator's
agent once the payload is delivered (progress, metrics, logs) and the Kueue line while the job waits. A
source that dies becomes a failed state, never a cell left waiting; a job that ended without results is
released at once. A job Kueue preempted (tfdist.kube.preemption) whose cell this kernel still holds is
submitted again, same spec and payload, and followed on: it waits in line and starts over when admitted.
`KubernetesBackend` mixes it in; it needs the backend's state, `status`, `stop`, `submit`, `_root`,
`_finish` and `_sampled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..job.events import ErrorInfo, Event, MetricsEvent, Reader, SnapshotEvent, StateEvent
from ..job.vocab import JobState, Reason
from ..jobspec import JobSpec
from ..jobview import JobView
from ..kube import checkpoints, preemption
from ..kube.agent_client import AgentClosed
from ..kube.cluster import KubeApi
from ..kube.podwatch import PodWatch
from ..kube.queueing_apply import queue_events, workload_of
from ..settings import Settings
from .base import Launch
from .kubework import KubeJob

GONE_WAIT_S = (
    120.0  # how long a preempted job's old Jobs and Workload may take to go before it is resubmitted
)


class KubeWatch:
    """The watching half of `KubernetesBackend`."""

    settings: Settings
    namespace: str
    kube: KubeApi
    _jobs: dict[str, KubeJob]
    _ended: set[str]
    _stop_requested: set[str]

    if TYPE_CHECKING:

        def _selector(self, name: str) -> str: ...
        def _ours(self, name: str, pod: dict[str, Any]) -> bool: ...
        def _finish(self, name: str) -> None: ...
        def _kept_checkpoint(self, job: KubeJob) -> str | None: ...
        def _sampled(self, job: KubeJob, ev: MetricsEvent) -> None: ...
        async def status(self, name: str) -> JobView: ...
        async def stop(self, name: str, reason: str = Reason.STOPPED) -> bool: ...
        async def submit(self, spec: JobSpec, payload: bytes, launch: Launch) -> None: ...
        async def _root(self, name: str) -> dict[str, Any] | None: ...
        def _stopped_by_user(self, name: str) -> bool: ...

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
            except AgentClosed:  # stopped here, or its results taken: the pods' watch says how it ended
                return
            except Exception as exc:  # never leave the cell waiting on a dead watcher
                await q.put(
                    StateEvent(
                        state=JobState.FAILED,
                        t=time.time(),
                        message=f"{what}: {exc}"[:4096],
                        error=ErrorInfo(type=type(exc).__name__[:200], message=str(exc)[:4096]),
                    )
                )

        async def sources() -> list[asyncio.Future]:
            pods = pump(self._pod_events(name, view), "the job's pods", "lost track of the job's pods")
            started = [asyncio.ensure_future(pods)]
            if name in self._jobs:
                agent = pump(self._agent_events(name), "the job's agent", "the coordinator")
                started.append(asyncio.ensure_future(agent))
            if name in self._jobs and self.settings.kueue_queue:  # its place in Kueue's line while it waits
                line = queue_events(await self.kube.api(), self.namespace, name, self.settings.kueue_queue)
                started.append(asyncio.ensure_future(pump(line, "Kueue", "lost track of the job's queue")))
            return started

        workers = await sources()
        try:
            while True:
                ev = await q.get()
                final = isinstance(ev, StateEvent) and ev.state.terminal
                if final and self._resumable(name, ev):  # preempted: in line again, same cell
                    for w in workers:
                        w.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)
                    while not q.empty():  # the evicted run's last words
                        q.get_nowait()
                    try:
                        back = await self._resubmit(name, ev)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        ev = StateEvent(
                            state=JobState.FAILED,
                            t=time.time(),
                            message=f"preempted, and could not be submitted again: {exc}"[:4096],
                            error=ErrorInfo(
                                type=type(exc).__name__[:200],
                                message=str(exc)[:4096],
                                reason=Reason.PREEMPTED,
                            ),
                        )
                        self._finish(name)
                        checkpoints.drop(self.settings.state_dir, self.namespace, name)
                        yield ev
                        return
                    yield back
                    if back.state.terminal:  # stopped while it waited to go back in line
                        return
                    workers = await sources()
                    continue
                if final and (job := self._jobs.get(name)) is not None:
                    job.payload = None  # kept for a queued job while it could be preempted (_resubmit)
                    checkpoints.drop(self.settings.state_dir, self.namespace, name)
                if final and ev.state != JobState.SUCCEEDED:
                    await self._release(name)
                    self._finish(name)
                yield ev
                if final:
                    return
        finally:
            for w in workers:
                w.cancel()

    def _resumable(self, name: str, ev: StateEvent) -> bool:
        """A verdict of preemption for a job whose cell this kernel holds (payload kept: a queued job)."""
        job = self._jobs.get(name)
        preempted = ev.error is not None and ev.error.reason == Reason.PREEMPTED
        return preempted and job is not None and job.payload is not None and not job.detach

    async def _resubmit(self, name: str, ev: StateEvent) -> StateEvent:
        """Submit a preempted job again once its evicted objects are gone (a Workload of the same name
        left behind would take the new pods for the finished group's); what the cell says meanwhile."""
        job = self._jobs[name]
        spec, payload = job.spec, job.payload or b""
        kept = self._kept_checkpoint(job)
        await self.stop(name, Reason.PREEMPTED)
        resume = checkpoints.prepare_resume(kept) if kept is not None else None  # handed back at delivery
        self._ended.discard(name)  # not ended: it comes back
        api = await self.kube.api()
        deadline = time.monotonic() + GONE_WAIT_S
        while not self._stopped_by_user(name) and (  # stopped meanwhile: nothing to wait for
            await self._root(name) is not None
            or await workload_of(api, self.namespace, name) is not None
            # the PS and worker Jobs go after the root (the garbage collector follows their owner reference):
            # one still there would refuse the new job's of the same name
            or await self.kube.list_root_jobs(self.namespace, self._selector(name))
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"its evicted objects were still there after {GONE_WAIT_S:g}s")
            await asyncio.sleep(0.5)
        # Stopped meanwhile (an interrupted cell, `%tfdist stop`, the lab panel's Stop, another kernel): not
        # resubmitted, and what a submit in flight made goes too
        if not self._stopped_by_user(name):
            await self.submit(spec, payload, Launch())  # (no await between the check and its clearing)
        if self._stopped_by_user(name):
            await self.stop(name, Reason.STOPPED)
            checkpoints.drop(self.settings.state_dir, self.namespace, name)
            return StateEvent(
                state=JobState.STOPPED,
                t=time.time(),
                reason=Reason.STOPPED,
                message="preempted, then stopped before it was back in line: not submitted again",
            )
        await preemption.mark_resubmitted(self.kube, self.namespace, name, resume)
        said = ev.error.message if ev.error is not None else ""
        queue = self.settings.kueue_queue or ""
        return StateEvent(
            state=JobState.PENDING,
            reason=Reason.PREEMPTED,
            message=preemption.requeued(said, queue, spec.checkpoint_every, resume),
        )

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
