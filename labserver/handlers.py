"""Thin REST handlers over the backend interface (`tfdist.backends.base.Backend`).

Ownership is checked here, on every route: a job whose `JobView.user` is not this server's user is
answered exactly like a job that does not exist (404), so its name does not leak either.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from ..backends import Backend, get_backend
from ..errors import NoSuchJob
from ..job.vocab import JobState
from ..jobrecords import GpuStatus, JobDetail, JobList, JobSummary, wire
from ..settings import Settings, from_environ
from .activity import setup_activity_handlers
from .logfilter import readable
from .sampler import ServerSampler

NAMESPACE = "tfdist"
AUTH_RESOURCE = "tfdist"  # what a jupyter_server Authorizer is asked about for every route of this extension
LOG_TAIL = 200  # lines per task in a job's view
METRICS_TAIL = 120  # utilization samples in a job's view


class SharedReads:
    """Backend reads shared by every tab for a moment: three tabs polling at 1 Hz ask the job's
    supervisor once per `ttl`, not three times; concurrent asks share one in-flight call."""

    def __init__(self, ttl: float = 0.5):
        self.ttl = ttl
        self._entries: dict[Any, tuple[float, asyncio.Future]] = {}

    async def get(self, key: Any, make: Callable[[], Awaitable[Any]]) -> Any:
        now = time.monotonic()
        hit = self._entries.get(key)
        if hit is None or now - hit[0] >= self.ttl:
            hit = (now, asyncio.ensure_future(make()))
            self._entries[key] = hit
        try:
            return await asyncio.shield(hit[1])
        except Exception:
            if self._entries.get(key) is hit:
                self._entries.pop(key, None)  # errors are not cached
            raise

    def clear(self) -> None:
        self._entries.clear()


class LabState:
    """What the handlers share for the server's lifetime: settings, one backend, one sampler."""

    def __init__(
        self, settings: Settings, backend: Backend | None = None, sampler: ServerSampler | None = None
    ):
        self.settings = settings
        self._backend = backend
        self.sampler = sampler or ServerSampler()
        self.reads = SharedReads()

    async def list_jobs(self) -> list[JobSummary]:
        return await self.reads.get("list", self.backend.list_jobs)

    async def status(self, name: str) -> Any:
        return await self.reads.get(("status", name), lambda: self.backend.status(name))

    @property
    def backend(self) -> Backend:
        if self._backend is None:  # created on first use: a broken k8s config must not stop the server
            self._backend = get_backend(self.settings.backend, self.settings)
        return self._backend

    def owns(self, user: str | None) -> bool:
        return (user or "") == self.settings.user


def valid_name(name: str) -> bool:
    """Names become paths in the local backend: refuse anything that could leave the state directory."""
    return (
        bool(name) and "/" not in name and "\0" not in name and not name.startswith(".") and len(name) < 256
    )


class BaseHandler(APIHandler):
    # jupyter_server's Authorizer decides each request (GET: read; POST: write) on this resource, as it does
    # on its own contents and kernels: where an admin grants some identities less (a read-only guest of a
    # shared server), they may look at the jobs but not stop them
    auth_resource = AUTH_RESOURCE

    @property
    def tfdist(self) -> LabState:
        return self.settings["tfdist"]

    def write_json(self, data: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data, default=str))

    async def own_view(self, name: str):  # -> JobView, 404 if missing or not the user's
        if not valid_name(name):
            raise tornado.web.HTTPError(404, "no such job")
        try:
            view = await self.tfdist.status(name)
        except NoSuchJob:
            raise tornado.web.HTTPError(404, "no such job") from None
        if not self.tfdist.owns(view.user):
            raise tornado.web.HTTPError(404, "no such job")
        return view


class JobsHandler(BaseHandler):
    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        jobs = await self.tfdist.list_jobs()
        mine = [j for j in jobs if self.tfdist.owns(j.user)]
        self.write_json(wire(JobList, {"user": self.tfdist.settings.user, "jobs": mine}))


class JobHandler(BaseHandler):
    @tornado.web.authenticated
    @authorized
    async def get(self, name: str) -> None:
        view = await self.own_view(name)
        d = view.to_dict()
        d["metrics"] = d["metrics"][-METRICS_TAIL:]
        d["summary"] = view.summary()
        d["summary"] |= self.tfdist.backend.detach_summary(name, d["summary"].get("ended")).fields()
        raw: dict[str, list[str]] = {}
        for task, line in view.logs:
            raw.setdefault(task, []).append(line)
        if not raw:  # nothing live (the supervisor is gone or silent): read the files it left
            try:
                # tails only (a few hundred lines, not whole files or pod logs) on every 1 Hz poll
                full = await self.tfdist.backend.logs(name, tail=LOG_TAIL * 4)
            except (NoSuchJob, OSError):
                full = {}
            raw = {t: text.splitlines() for t, text in full.items()}
        logs: dict[str, list[str]] = {}
        hidden = 0
        for task, lines in raw.items():  # TensorFlow's start-up chatter stays in the files, not in the panel
            kept, n = readable(lines)
            logs[task], hidden = kept[-LOG_TAIL:], hidden + n
        d["logs"] = logs
        d["logs_hidden"] = hidden
        self.write_json(wire(JobDetail, d))


class StopHandler(BaseHandler):
    @tornado.web.authenticated
    @authorized
    async def post(self, name: str) -> None:
        view = await self.own_view(name)
        stopped = await self.tfdist.backend.stop(name)
        self.tfdist.reads.clear()
        try:
            state = (await self.tfdist.backend.status(name)).state
        except NoSuchJob:  # Kubernetes: a stopped job leaves no objects to read
            state = JobState.STOPPED
        self.log.info("tfdist: %s stopped job %s (was %s)", self.tfdist.settings.user, name, view.state)
        self.write_json({"name": name, "stopped": stopped, "state": state})


class GpusHandler(BaseHandler):
    @tornado.web.authenticated
    @authorized
    def get(self) -> None:
        self.write_json(wire(GpuStatus, self.tfdist.sampler.snapshot()))


def setup_route_handlers(serverapp: Any, state: LabState | None = None) -> LabState:
    web_app = serverapp.web_app
    state = state or LabState(from_environ())
    web_app.settings["tfdist"] = state
    base = url_path_join(web_app.settings["base_url"], NAMESPACE, "api")
    name = r"(?P<name>[^/]+)"
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "jobs"), JobsHandler),
            (url_path_join(base, "jobs", name), JobHandler),
            (url_path_join(base, "jobs", name, "stop"), StopHandler),
            (url_path_join(base, "gpus"), GpusHandler),
        ],
    )
    setup_activity_handlers(web_app, base)  # the hub's GPU-idle culler and admin page (activity.py)
    return state
