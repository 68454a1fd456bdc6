"""Detached Kubernetes jobs: this server's record of them, `attach` in a later kernel and the summary.

Why a module of its own: a detached job outlives the kernel that started it, so what a later kernel needs
to follow it (the token, the root's and the Jobs' UIDs, the retention it was started under) is a file of
this server's (tfdist.kube.records), and its rules and sentences are tfdist.job.detach's. `attach` takes
the job up again only if its root is still the one recorded. `KubernetesBackend` mixes it in; it needs
the backend's state, `_root` and `_chief_ip`.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from ..errors import JobSpecError, NoSuchJob
from ..job import detach as dt
from ..job.detach import DetachSummary
from ..jobspec import JobSpec
from ..kube import records, transport
from ..settings import Settings
from .kubework import KubeJob


class KubeDetachedJobs:
    """The detached half of `KubernetesBackend`."""

    settings: Settings
    namespace: str
    _jobs: dict[str, KubeJob]

    if TYPE_CHECKING:

        async def _root(self, name: str) -> dict[str, Any] | None: ...
        async def _chief_ip(self, job: KubeJob) -> str: ...

    def detach_summary(self, name: str, ended: float | None = None) -> DetachSummary:
        """From this server's record of the detached job (the kernel that started it wrote it): results
        waiting in the coordinator pod until the retention passes after the end, or already taken
        (`tfdist.job.detach.summary`)."""
        return dt.summary(records.load(self._record_path(name)), ended)

    def _record_path(self, name: str) -> str:
        return records.path(self.settings.state_dir, self.namespace, name)

    def _remember(self, job: KubeJob, retention_s: float) -> None:
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
        job = KubeJob(
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
