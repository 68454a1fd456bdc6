"""GPU activity of this server for the hub's GPU-idle culler and admin page, and the culler's notice.

Why apart from `sampler.py`: that sampler runs only while a tab polls (an idle server costs nothing), but
the culler must see a server's GPUs whether or not a tab is open, and the admin page shows an hour. This
tracker samples the server's GPUs every `TFDIST_GPU_ACTIVITY_INTERVAL` seconds (default 10) from the
server's start on, keeps up to `RETENTION_S`, and answers "idle for how long below X %" server-side, so a
report carries one number instead of the history. A server without GPUs samples nothing. `reporter.py`
pushes the report to the hub's GPU admin service; nothing of the hub calls this server.

Routes (under ``{base_url}/tfdist/api/``, authenticated like every route, for the server's own user):

* ``GET activity?busy_percent=P&history=S`` -> the report as it would be pushed: GPUs, ``idle_s`` (time
  since any GPU was at or above P %, counted from when tracking began), the last S seconds of samples, and
  the running ``%%tfdist`` jobs, plus the current notice.
* ``GET notice``: the culler's warning the lab shows (set from the service's answer to a report);
  ``POST notice`` ``{"message", "cull_at"}`` / ``DELETE notice`` set and clear it by hand (the lab's tests).
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import time
from typing import Any

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado.ioloop import PeriodicCallback

from ..gpus import GpuInfo, visible_gpus
from ..hubadmin.report import MAX_GPUS, MAX_JOBS
from ..jobview import TERMINAL
from ..sampler import GpuReader
from ..settings import ENV_GPU_ACTIVITY_INTERVAL, LabSettings

__all__ = ["GpuActivity", "Notice", "setup_activity_handlers"]

RETENTION_S = 6 * 3600  # longest idle time an admin may set is checked against this (hubadmin.config)
ENV_INTERVAL = ENV_GPU_ACTIVITY_INTERVAL  # seconds between samples; bad or out of range: 10


def _interval() -> float:
    return LabSettings().activity_interval_s


class GpuActivity:
    """`(t, [util %], [mem used MiB])` per tick for this server's GPUs; starts on first use."""

    def __init__(self, interval_s: float | None = None, reader: GpuReader | None = None) -> None:
        self.interval_s = interval_s if interval_s is not None else _interval()
        self.samples: collections.deque[tuple[float, list[float | None], list[float | None]]] = (
            collections.deque(maxlen=max(10, int(RETENTION_S / self.interval_s)))
        )
        self._reader = reader
        self._gpus: list[GpuInfo] | None = None
        self._pc: PeriodicCallback | None = None
        self.since: float | None = None  # when tracking began: idle time cannot be known before it
        self._last_busy: dict[float, float] = {}  # threshold -> time of the last sample at/above it
        # (t, highest GPU utilization) of this server's running jobs' pods, as seen at each hub check: on
        # Kubernetes a job's GPUs are in its own pods, and they are this server's GPU use too
        self.job_samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)

    def gpus(self) -> list[GpuInfo]:
        if self._gpus is None:
            try:
                self._gpus = visible_gpus()
            except Exception:  # no driver, odd CUDA_VISIBLE_DEVICES: this server has no GPU
                self._gpus = []
        return self._gpus

    def ensure_running(self) -> None:
        if self._pc is not None or not self.gpus():
            return
        if self._reader is None:
            self._reader = GpuReader()
        self.since = time.time()
        self.sample()
        self._pc = PeriodicCallback(self.sample, self.interval_s * 1000)
        self._pc.start()

    def sample(self) -> None:
        assert self._reader is not None
        reads = [self._reader.read(g) for g in self.gpus()]
        self.samples.append(
            (time.time(), [r.get("util (%)") for r in reads], [r.get("mem_used (MiB)") for r in reads])
        )

    def idle_s(self, busy_percent: float, now: float | None = None) -> float | None:
        """Seconds since any GPU was at or above `busy_percent` (None: not tracking, no GPU)."""
        if self.since is None:
            return None
        now = time.time() if now is None else now
        last = self.since
        for t, utils, _ in reversed(self.samples):
            if any(u is not None and u >= busy_percent for u in utils):
                last = max(last, t)
                break
        for t, u in reversed(self.job_samples):
            if u >= busy_percent:
                last = max(last, t)
                break
        return max(0.0, now - last)

    def note_jobs(self, utils: list[float], now: float | None = None) -> None:
        """The running jobs' GPU utilization (their pods' latest samples) at this moment."""
        if utils:
            self.job_samples.append((time.time() if now is None else now, max(utils)))

    def report(self, busy_percent: float | None, after: float, max_samples: int = 1000) -> dict[str, Any]:
        """GPUs, idle time below `busy_percent` and the samples taken after time `after` (the newest
        `max_samples`): the fields of `tfdist.hubadmin.report.ActivityReport` this tracker knows."""
        self.ensure_running()
        now = time.time()
        samples = [s for s in self.samples if s[0] > after][-max_samples:] if max_samples > 0 else []
        return {
            "now": now,
            "since": self.since,
            "interval_s": self.interval_s,
            "gpus": [
                {"index": g.index, "name": g.name, "uuid": g.uuid, "memory_total_mib": g.memory_total_mib}
                for g in self.gpus()
            ],
            "busy_percent": busy_percent,
            "idle_s": self.idle_s(busy_percent, now) if busy_percent is not None else None,
            "samples": [{"t": t, "util": u, "mem": m} for t, u, m in samples],
        }

    def stop(self) -> None:
        if self._pc is not None:
            self._pc.stop()
            self._pc = None


class Notice:
    """The hub's latest warning to this server's user (one at a time; None: no warning)."""

    def __init__(self) -> None:
        self.value: dict[str, Any] | None = None

    def set(self, message: str | None, cull_at: float | None) -> None:
        """The service's notice from its answer; the same notice again keeps its time (the lab shows a
        notice once per `posted`)."""
        if message is None:
            self.value = None
        elif not self.value or (self.value["message"], self.value["cull_at"]) != (message, cull_at):
            self.value = {"message": message, "cull_at": cull_at, "posted": time.time()}


def _number(raw: str | None, name: str, default: float | None, low: float, high: float) -> float | None:
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise tornado.web.HTTPError(400, f"{name} must be a number") from None
    if not (low <= v <= high):
        raise tornado.web.HTTPError(400, f"{name} must be between {low:g} and {high:g}")
    return v


class _Base(APIHandler):
    auth_resource = "tfdist"  # as labserver.handlers: reading activity is read, the hub's notice is write

    @property
    def activity(self) -> GpuActivity:
        return self.settings["tfdist_activity"]

    @property
    def notice(self) -> Notice:
        return self.settings["tfdist_notice"]

    def write_json(self, data: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data, default=str))


async def current_report(
    web_settings: dict[str, Any], busy_percent: float | None, after: float, log: Any
) -> dict[str, Any]:
    """This server's report: the tracker's part and the user's running ``%%tfdist`` jobs (whose GPUs count
    as this server's GPU use)."""
    activity: GpuActivity = web_settings["tfdist_activity"]
    running, jobs_error = [], None
    try:
        jobs = await web_settings["tfdist"].list_jobs()
    except Exception as e:  # a broken backend must not make the server look idle-and-jobless silently
        log.warning("tfdist activity: cannot list jobs: %s", e)
        jobs_error, jobs = str(e)[:1000], []
    me = web_settings["tfdist"].settings.user
    for j in jobs[:MAX_JOBS]:  # typed summaries (JobSummary): checked where the backend made them
        if j.state not in TERMINAL and (j.user or "") == me:
            util = [min(100.0, max(0.0, u)) for u in j.gpu_util if math.isfinite(u)][:MAX_GPUS]
            running.append({"name": j.name[:200], "state": str(j.state)[:40], "gpu_util": util})
    activity.note_jobs([u for j in running for u in j["gpu_util"]])
    out = activity.report(busy_percent, after)
    out["jobs_error"] = jobs_error
    out["jobs_running"] = running
    return out


class ActivityHandler(_Base):
    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        busy = _number(self.get_argument("busy_percent", None), "busy_percent", None, 0, 100)
        history = _number(self.get_argument("history", None), "history", 0.0, 0, RETENTION_S) or 0.0
        after = time.time() - history if history > 0 else float("inf")
        out = await current_report(self.settings, busy, after, self.log)
        out["notice"] = self.notice.value
        self.write_json(out)


class NoticeHandler(_Base):
    @tornado.web.authenticated
    @authorized
    def get(self) -> None:
        self.write_json({"notice": self.notice.value})

    @tornado.web.authenticated
    @authorized
    def post(self) -> None:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            raise tornado.web.HTTPError(400, "body must be JSON") from None
        msg = body.get("message") if isinstance(body, dict) else None
        cull_at = body.get("cull_at") if isinstance(body, dict) else None
        if not isinstance(msg, str) or not msg.strip() or len(msg) > 1000:
            raise tornado.web.HTTPError(400, "message must be a non-empty string of at most 1000 characters")
        if cull_at is not None and (isinstance(cull_at, bool) or not isinstance(cull_at, (int, float))):
            raise tornado.web.HTTPError(400, "cull_at must be a UNIX time")
        self.notice.value = {"message": msg, "cull_at": cull_at, "posted": time.time()}
        self.log.info("tfdist: hub notice for this server: %s", msg)
        self.write_json({"notice": self.notice.value})

    @tornado.web.authenticated
    @authorized
    def delete(self) -> None:
        self.notice.value = None
        self.write_json({"notice": None})


def setup_activity_handlers(web_app: Any, base: str) -> None:
    """The routes; the reporter (`reporter.py`) is started with the event loop (`start_reporting`)."""
    web_app.settings["tfdist_activity"] = GpuActivity()
    web_app.settings["tfdist_notice"] = Notice()
    web_app.add_handlers(
        ".*$",
        [(url_path_join(base, "activity"), ActivityHandler), (url_path_join(base, "notice"), NoticeHandler)],
    )


def start_reporting(web_app: Any) -> None:
    """Start pushing reports when the spawner said where (TFDIST_GPU_ADMIN_URL); needs a running loop."""
    from .reporter import reporter_from_env

    rep = reporter_from_env(web_app.settings)
    if rep is not None:
        web_app.settings["tfdist_reporter"] = rep
        web_app.settings["tfdist_reporter_task"] = asyncio.ensure_future(rep.run())
