"""The GPU admin service's state: the hub's running servers, the activity each one reported, culling.

Why servers push (and the service never calls them): a user's server is code its user controls, so no
credential may be sent to it. Each server reports with its own token (`identity.server_of` says which
server that token is for), the report is checked (`report.parse_report`), and the answer carries the
culler's notice back. The service's own token (scopes: `hubconfig.SERVICE_SCOPES`) is used on the hub's
API only. A server without a recent report has "no data" and is never culled, nor is one with a GPU whose
utilization is not measured (a MIG instance: NVML cannot; a GPU whose NVML read failed): its idle time
counts only from the last moment every GPU of it was measured.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from .config import CullingConfig, CullingRule
from .culler import NOT_CULLED, Decision, decide, warning_text
from .identity import IdentityCache, ServerId
from .report import ActivityReport, GpuRecord, JobRecord, NoticeRecord, ReportReply

__all__ = ["GpuAdminState", "ServerRecord", "UnknownServer"]

log = logging.getLogger("tfdist.hubadmin")

HISTORY_S = 3600.0  # the admin page's sparklines
SPARK_POINTS = 60
LIVE_REPORT_S = 2.0  # while an admin looks at the page, servers are asked to report this often
LIVE_FOR_S = 60.0  # ... for this long after the page's last poll
DEFAULT_BUSY = 5.0  # threshold of servers without a culling rule (the page's busy/idle totals)


class UnknownServer(LookupError):
    """A report from a server the hub does not list as running (not ready yet, or stopped)."""


@dataclass
class ServerRecord:
    user: str
    name: str  # "" for the default server
    profile: str | None
    gpu_model: str | None
    url: str  # path on the proxy, e.g. /user/alice/
    gpus: list[GpuRecord] = field(default_factory=list)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4000))
    points: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4000))
    idle_s: float | None = None
    jobs_running: list[JobRecord] = field(default_factory=list)
    decision: Decision | None = None
    warned_cull_at: float | None = None
    notice: NoticeRecord | None = None  # what the server's next report is answered with
    refused: str | None = None  # why its last report was refused (cleared by the next good one)
    refusals: int = 0  # reports refused since the hub started: a misbehaving reporter stays visible
    last_refusal: tuple[float, str] | None = None  # when and why, kept after a good report
    seen: float = 0.0  # when its last report was accepted (0: never)
    asked_s: float = 30.0  # the report interval it was last asked for
    last_cull_check: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.user}/{self.name}"

    def fresh(self, now: float) -> bool:
        """A report recent enough to act on: three missed reports (and some slack) make it stale."""
        return self.seen > 0 and now - self.seen <= 3 * self.asked_s + 15

    def no_data_reason(self, now: float) -> str | None:
        if self.fresh(now):
            return self.refused and f"last report refused: {self.refused}"
        why = "never reported" if not self.seen else f"no report for {now - self.seen:.0f} s"
        if self.refused:
            why += f"; last report refused: {self.refused}"
        return f"no data ({why}); not culled"

    def last_utils(self, now: float) -> list[float | None]:
        if not self.history or not self.fresh(now):
            return [None] * len(self.gpus)
        return list(self.history[-1][1])

    def unmeasured(self, now: float) -> list[str]:
        """This server's GPUs whose utilization is not known now, each in words (all of them when no recent
        sample came): what keeps the culler from stopping it."""
        if not self.gpus:
            return []
        if not self.history or now - self.history[-1][0] > 3 * self.asked_s + 60:
            return ["no recent GPU sample"]
        utils = list(self.history[-1][1])
        return [
            f"{g.label}: " + ("not measurable on a MIG instance" if g.is_mig else "utilization not read")
            for g, u in zip(self.gpus, utils + [None] * (len(self.gpus) - len(utils)), strict=False)
            if u is None
        ]

    def measured_idle_s(self, now: float) -> float | None:
        """The reported idle time, but no longer than since the last sample in which a GPU had no
        utilization: a time nobody measured is never counted as idle."""
        if self.idle_s is None:
            return None
        for t, utils, _ in reversed(self.history):
            if len(utils) < len(self.gpus) or any(u is None for u in utils):
                return max(0.0, min(self.idle_s, now - t))
        return self.idle_s

    def last_mem(self, now: float) -> list[float | None]:
        if not self.history or not self.fresh(now):
            return [None] * len(self.gpus)
        return list(self.history[-1][2])

    def add(self, t: float, utils: list[float | None], mems: list[float | None]) -> None:
        """One sample; the sparkline's point (max utilization, summed memory) is made here, once."""
        self.history.append((t, utils, mems))
        us = [x for x in utils if x is not None]
        ms = [x for x in mems if x is not None]
        self.points.append((t, max(us) if us else None, sum(ms) if ms else None))

    def spark(self, now: float) -> dict[str, list[float | None]]:
        """Times, max utilization and memory used (MiB, summed over GPUs) for the last hour, at most
        SPARK_POINTS each: three flat lists keep 200 servers' JSON small."""
        cut = now - HISTORY_S
        pts = [p for p in self.points if p[0] >= cut]
        pts = pts[:: max(1, -(-len(pts) // SPARK_POINTS))]
        return {
            "t": [round(p[0]) for p in pts],
            "util": [None if p[1] is None else round(p[1], 1) for p in pts],
            "mem": [None if p[2] is None else round(p[2]) for p in pts],
        }

    def take(self, rep: ActivityReport, threshold: float, now: float) -> None:
        """An accepted report. Its idle time counts only when measured against this server's threshold."""
        self.gpus = list(rep.gpus)
        self.idle_s = rep.idle_s if rep.busy_percent == threshold else None
        self.jobs_running = list(rep.jobs_running)
        last_t = self.history[-1][0] if self.history else None
        for s in sorted(rep.samples, key=lambda s: s.t):
            if last_t is None or s.t > last_t:
                self.add(s.t, list(s.util), list(s.mem))
                last_t = s.t
        self.seen = now
        self.refused = None


def _reason(rec: ServerRecord, now: float) -> str | None:
    """Why the culler leaves a reporting server alone, in words, when it is for lack of a measurement."""
    if rec.decision is None or rec.decision.action != "unmeasured":
        return None
    return "GPU utilization not measured (" + "; ".join(rec.unmeasured(now)) + "); not culled"


class GpuAdminState:
    """Everything the service knows; `refresh()` reads the hub's running servers, `accept()` a report."""

    def __init__(
        self,
        *,
        api_url: str,
        api_token: str,
        culling: CullingConfig | None,
        profile_models: dict[str, str] | None = None,
        machine_gpus: list[str] | None = None,
        period: float = 30.0,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = api_token
        self.culling = culling
        self.period = period  # how often servers report (and the hub's server list is read)
        self.model_names = profile_models or {}  # gpu model key -> display name
        # embedded hub: the NVML names of this machine's GPUs (free = these - held); None on Kubernetes
        self.machine_gpus = machine_gpus
        self.servers: dict[str, ServerRecord] = {}
        self.last_refresh = 0.0
        self.last_viewed = 0.0  # an admin's page polled (servers are asked to report faster for a while)
        self.refresh_seconds = 0.0  # wall time of the last round
        self.culled_total = 0
        self.warned_total = 0
        self.check_seconds_total = 0.0
        self.checks_total = 0  # reports accepted
        self.refused_total = 0  # reports refused (bad body, or a token of no running server)
        self._round: asyncio.Future | None = None
        self.http = AsyncHTTPClient()
        self.identities = IdentityCache(self.whoami)

    # ---- HTTP (the hub's API only) ----------------------------------------------------------------

    async def _request(self, url: str, token: str, method: str = "GET", body: Any = None) -> Any:
        req = HTTPRequest(
            url,
            method=method,
            headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
            body=None if body is None and method in ("GET", "DELETE") else json.dumps(body or {}),
            request_timeout=10,
            follow_redirects=False,
            allow_nonstandard_methods=True,
        )
        resp = await self.http.fetch(req)
        return json.loads(resp.body) if resp.body else None

    async def hub(self, path: str, method: str = "GET", body: Any = None) -> Any:
        return await self._request(f"{self.api_url}{path}", self.token, method, body)

    async def whoami(self, token: str) -> Any:
        """The hub's model of `token`'s owner, with the token's scopes; None when the hub refuses it."""
        try:
            return await self._request(f"{self.api_url}/user", token)
        except HTTPClientError as e:
            if e.code in (401, 403, 404):
                return None
            raise

    # ---- the hub's servers ------------------------------------------------------------------------

    def rule_for(self, rec: ServerRecord) -> CullingRule | None:
        return self.culling.rule(rec.profile) if self.culling else None

    def threshold(self, rec: ServerRecord) -> float:
        rule = self.rule_for(rec)
        return rule.idle_below_percent if rule else DEFAULT_BUSY

    async def refresh(self, max_age: float = 0.0) -> None:
        """Read the hub's servers, or wait for the read in flight; nothing when the last is under `max_age`
        old."""
        if max_age and time.time() - self.last_refresh < max_age:
            return
        if self._round is None or self._round.done():
            self._round = asyncio.ensure_future(self._refresh())
        await asyncio.shield(self._round)

    async def _refresh(self) -> None:
        t0 = time.perf_counter()
        users = await self.hub("/users?state=active&limit=10000")
        if isinstance(users, dict):  # paginated form
            users = users.get("items", [])
        seen = set()
        for u in users or []:
            for sname, s in (u.get("servers") or {}).items():
                if not s.get("ready"):
                    continue
                opts = s.get("user_options") or {}
                key = f"{u['name']}/{sname}"
                seen.add(key)
                rec = self.servers.get(key)
                if rec is None or rec.url != s.get("url"):
                    rec = self.servers[key] = ServerRecord(
                        user=u["name"],
                        name=sname,
                        profile=opts.get("profile"),
                        gpu_model=opts.get("gpu_model"),
                        url=s.get("url") or f"/user/{quote(u['name'])}/{quote(sname)}/",
                        asked_s=self.period,
                    )
        for key in list(self.servers):
            if key not in seen:
                del self.servers[key]
        now = time.time()
        for rec in self.servers.values():
            if not rec.fresh(now):
                rec.decision = Decision("no-data")  # never culled on what is not known
        self.refresh_seconds = time.perf_counter() - t0
        self.last_refresh = time.time()

    # ---- reports ----------------------------------------------------------------------------------

    def report_interval(self) -> float:
        live = time.time() - self.last_viewed < LIVE_FOR_S
        return min(self.period, LIVE_REPORT_S) if live else self.period

    async def record_for(self, sid: ServerId) -> ServerRecord:
        rec = self.servers.get(sid.key)
        if rec is None:  # started since the last read of the hub's servers
            await self.refresh(max_age=2.0)
            rec = self.servers.get(sid.key)
        if rec is None:
            raise UnknownServer(f"the hub has no running server {sid.key!r}")
        return rec

    def refuse(self, sid: ServerId | None, why: str) -> None:
        self.refused_total += 1
        rec = self.servers.get(sid.key) if sid else None
        if rec is not None:
            rec.refused = why
            rec.refusals += 1
            rec.last_refusal = (time.time(), why)

    async def accept(self, rec: ServerRecord, rep: ActivityReport) -> ReportReply:
        """Take `rec`'s report, run its culling check when one is due, and say what the server is told."""
        t0 = time.perf_counter()
        now = time.time()
        threshold = self.threshold(rec)
        rec.take(rep, threshold, now)
        rec.asked_s = self.report_interval()
        if self.culling is not None and now - rec.last_cull_check >= self.culling.check_interval_s:
            rec.last_cull_check = now
            await self._cull_step(rec, self.rule_for(rec), now)
        elif rec.decision is not None and rec.decision.action == "no-data":
            rec.decision = None
        self.checks_total += 1
        self.check_seconds_total += time.perf_counter() - t0
        return ReportReply(notice=rec.notice, next_report_s=rec.asked_s, busy_percent=threshold)

    async def _cull_step(self, rec: ServerRecord, rule: CullingRule | None, now: float) -> None:
        facts = {
            "gpus": rec.gpus,
            "idle_s": rec.measured_idle_s(now),
            "jobs_running": rec.jobs_running,
            "unmeasured": rec.unmeasured(now),
        }
        d = decide(rule, facts, rec.warned_cull_at, now)
        rec.decision = d
        in_use = d.action in ("active", "job-running")
        if (in_use or d.action in NOT_CULLED) and rec.warned_cull_at is not None:
            rec.warned_cull_at = None
            rec.notice = None
            log.info("tfdist gpu admin: %s: %s; warning withdrawn", rec.key, d.action)
        elif d.action == "warn" and rule is not None:
            assert d.cull_at is not None
            rec.warned_cull_at = d.cull_at
            self.warned_total += 1
            rec.notice = NoticeRecord(message=warning_text(rule, d.cull_at - now), cull_at=d.cull_at)
            log.info(
                "tfdist gpu admin: warned %s (GPUs idle %.0f s); stop at %.0f", rec.key, d.idle_s, d.cull_at
            )
        elif d.action == "cull":
            log.warning("tfdist gpu admin: stopping %s: GPUs idle for %.0f s", rec.key, d.idle_s or 0)
            path = (
                f"/users/{quote(rec.user, safe='')}/servers/{quote(rec.name, safe='')}"
                if rec.name
                else f"/users/{quote(rec.user, safe='')}/server"
            )
            try:
                await self.hub(path, "DELETE")
                self.culled_total += 1
            except (HTTPClientError, OSError) as e:
                log.error("tfdist gpu admin: could not stop %s: %s", rec.key, e)

    async def run_forever(self, period: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("tfdist gpu admin: round failed")
            await asyncio.sleep(period)

    # ---- views ------------------------------------------------------------------------------------

    def view_json(self) -> str:
        """`view()` as JSON, built at most once a second, however many admins look."""
        key = (self.last_refresh, self.checks_total, self.refused_total)
        cached = getattr(self, "_view_cache", None)
        if cached and cached[0] == key and time.monotonic() - cached[1] < 1.0:
            return cached[2]
        body = json.dumps(self.view())
        self._view_cache = (key, time.monotonic(), body)
        return body

    def view(self) -> dict[str, Any]:
        """The admin page's data: one row per server and totals per GPU model."""
        now = time.time()
        rows = []
        totals: dict[str, dict[str, Any]] = {}
        for rec in sorted(self.servers.values(), key=lambda r: (r.user, r.name)):
            utils = rec.last_utils(now)
            thr = self.threshold(rec)
            for g, u in zip(rec.gpus, utils + [None] * (len(rec.gpus) - len(utils)), strict=False):
                name = g.name or "?"
                t = totals.setdefault(name, {"model": name, "held": 0, "busy": 0})
                t["held"] += 1
                if u is not None and u >= thr:
                    t["busy"] += 1
            fresh = rec.fresh(now)
            rows.append(
                {
                    "user": rec.user,
                    "server": rec.name,
                    "profile": rec.profile,
                    "gpu_model": self.model_names.get(rec.gpu_model or "", rec.gpu_model),
                    "gpus": [
                        {"index": g.index, "name": g.name, "uuid": g.uuid, "label": g.label} for g in rec.gpus
                    ],
                    "util": utils,
                    # per GPU, what the page shows: "35%", "n/a (MIG)" (NVML cannot measure it), "—"
                    "util_text": [
                        f"{u:.0f}%" if u is not None else "n/a (MIG)" if g.is_mig else "\u2014"
                        for g, u in zip(rec.gpus, utils + [None] * len(rec.gpus), strict=False)
                    ],
                    "mem_mib": rec.last_mem(now),
                    "idle_s": rec.idle_s if fresh else None,
                    "jobs": [j.model_dump() for j in rec.jobs_running] if fresh else [],
                    "action": (rec.decision.action if rec.decision else None) if fresh else "no-data",
                    "reason": _reason(rec, now) if fresh else None,
                    "cull_at": rec.warned_cull_at,
                    "error": rec.no_data_reason(now),
                    "refusals": (
                        {"count": rec.refusals, "at": rec.last_refusal[0], "why": rec.last_refusal[1]}
                        if rec.last_refusal
                        else None
                    ),
                    "spark": rec.spark(now),
                }
            )
        for name in self.machine_gpus or []:
            totals.setdefault(name, {"model": name, "held": 0, "busy": 0})
        for t in totals.values():
            t["free"] = (
                None if self.machine_gpus is None else max(0, self.machine_gpus.count(t["model"]) - t["held"])
            )
        return {
            "now": now,
            "refreshed": self.last_refresh,
            "servers": rows,
            "totals": sorted(totals.values(), key=lambda t: t["model"]),
        }
