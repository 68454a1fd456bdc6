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
import json
import logging
import time
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from .config import CullingConfig, CullingRule
from .culler import NOT_CULLED, Decision, decide, warning_text
from .identity import IdentityCache, ServerId
from .page import page_view
from .report import ActivityReport, NoticeRecord, ReportReply
from .servers import ServerRecord, UnknownServer

__all__ = ["GpuAdminState"]

log = logging.getLogger("tfdist.hubadmin")

LIVE_REPORT_S = 2.0  # while an admin looks at the page, servers are asked to report this often
LIVE_FOR_S = 60.0  # ... for this long after the page's last poll
DEFAULT_BUSY = 5.0  # threshold of servers without a culling rule (the page's busy/idle totals)
PAGINATION = "application/jupyterhub-pagination+json"  # the hub's paged answers, with the next offset
PAGE_LIMIT = 200  # the hub's own default cap per answer (api_page_max_limit): it may lower it
MAX_PAGES = 10_000  # 2 million users at the default cap: a guard against a hub that never says "no more"


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

    async def _request(
        self, url: str, token: str, method: str = "GET", body: Any = None, accept: str | None = None
    ) -> Any:
        headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}
        if accept:
            headers["Accept"] = accept
        req = HTTPRequest(
            url,
            method=method,
            headers=headers,
            body=None if body is None and method in ("GET", "DELETE") else json.dumps(body or {}),
            request_timeout=10,
            follow_redirects=False,
            allow_nonstandard_methods=True,
        )
        resp = await self.http.fetch(req)
        return json.loads(resp.body) if resp.body else None

    async def hub(self, path: str, method: str = "GET", body: Any = None) -> Any:
        return await self._request(f"{self.api_url}{path}", self.token, method, body)

    async def active_users(self) -> list[dict[str, Any]]:
        """Every user with a server, page by page: the hub caps any one answer at its
        `api_page_max_limit` (200 by default) whatever `limit` asks, so one read missed every later user's
        servers (never culled, not on the page, their reports refused as unknown)."""
        users: list[dict[str, Any]] = []
        offset = 0
        for _ in range(MAX_PAGES):
            page = await self._request(
                f"{self.api_url}/users?state=active&offset={offset}&limit={PAGE_LIMIT}",
                self.token,
                accept=PAGINATION,
            )
            if isinstance(page, list):  # a hub without pagination answers every user at once
                return page
            users.extend(page.get("items") or [])
            nxt = (page.get("_pagination") or {}).get("next")
            if not nxt or not page.get("items"):
                break
            offset = int(nxt["offset"])
        return users

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
        users = await self.active_users()
        seen = set()
        for u in users:
            for sname, s in (u.get("servers") or {}).items():
                if not s.get("ready"):
                    continue
                opts = s.get("user_options") or {}
                key = f"{u['name']}/{sname}"
                seen.add(key)
                rec = self.servers.get(key)
                url = s.get("url") or f"/user/{quote(u['name'])}/{quote(sname)}/"
                if rec is None or rec.url != url or rec.started != s.get("started"):
                    # a server stopped and started again between two reads has the same URL: its record
                    # (profile, culling rule, warning, history) is a new one
                    given = opts.get("gpus")
                    rec = self.servers[key] = ServerRecord(
                        user=u["name"],
                        name=sname,
                        profile=opts.get("profile"),
                        gpu_model=opts.get("gpu_model"),
                        url=url,
                        asked_s=self.period,
                        started=s.get("started"),
                        gpus_given=given if isinstance(given, int) and not isinstance(given, bool) else None,
                    )
        for key, rec in list(self.servers.items()):
            if key in seen:
                rec.missed = 0
                continue
            # gone from one read: a server that started or stopped between two of its pages shifts the
            # offsets, and one user is missed. A record goes after two reads without it
            rec.missed += 1
            if rec.missed >= 2:
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
        """The admin page's data (`page.page_view`)."""
        return page_view(
            self.servers.values(),
            self.threshold,
            self.model_names,
            self.machine_gpus,
            self.last_refresh,
            time.time(),
        )
