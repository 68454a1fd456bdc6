"""EventBackend: a `Backend` whose jobs are `JobView`s folded from the events a test hands it.

For the displays' tests where the producer cannot run here (Kueue's queue watcher needs a cluster with
Kueue): the job's events are the real records, folded by the real `JobView`, and every reader (`%tfdist
list`, the lab server, the cell's monitor) goes through the real `Backend` interface. Unknown jobs raise
`NoSuchJob`, as the real backends do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from tfdist.backends.base import Backend, Launch
from tfdist.errors import JobSpecError, NoSuchJob
from tfdist.events import Event, SnapshotEvent
from tfdist.jobrecords import JobSummary
from tfdist.jobspec import JobSpec
from tfdist.jobview import JobView


class EventBackend(Backend):
    name = "local"

    def __init__(self) -> None:
        self.views: dict[str, JobView] = {}
        self.streams: dict[str, list[Event]] = {}

    def feed(self, name: str, *events: Event, user: str = "", total_tasks: int = 0) -> JobView:
        """The job `name` (created on first use) after `events`; what `watch` replays to a subscriber."""
        view = self.views.setdefault(name, JobView(name=name, user=user, total_tasks=total_tasks))
        for ev in events:
            if not view.apply(ev):
                raise ValueError(f"a malformed event was fed to {name}: {ev!r}")
        self.streams.setdefault(name, []).extend(events)
        return view

    async def submit(self, spec: JobSpec, payload: bytes, launch: Launch) -> None:
        if spec.name in self.views:
            raise JobSpecError(f"a job named {spec.name!r} is already running")
        self.feed(spec.name, user=spec.user, total_tasks=spec.task_count)

    async def watch(self, name: str) -> AsyncIterator[Event]:
        view = self._view(name)
        yield SnapshotEvent(view=JobView(name=name, user=view.user, total_tasks=view.total_tasks).to_dict())
        for ev in self.streams.get(name, []):
            yield ev

    async def stop(self, name: str, reason: str = "stopped") -> bool:
        view = self._view(name)
        return not view.finished

    async def list_jobs(self) -> list[JobSummary]:
        return [JobSummary.model_validate(v.summary()) for v in self.views.values()]

    async def status(self, name: str) -> JobView:
        return self._view(name)

    async def logs(self, name: str, task: str | None = None, tail: int | None = None) -> dict[str, str]:
        self._view(name)
        return {}

    async def fetch_result(self, name: str) -> bytes | None:
        self._view(name)
        return None

    def _view(self, name: str) -> JobView:
        try:
            return self.views[name]
        except KeyError:
            raise NoSuchJob(name) from None
