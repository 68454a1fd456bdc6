"""The GPU admin service: one loop that reads every running server's GPU activity, culls idle GPU servers,
and keeps what the admin page and the metrics show.

Why one loop: the page, the metrics and the culler need the same facts (who holds which GPUs, how busy);
fetching them once per round keeps the cost per server one small HTTP request per check, whoever is
looking. Requests to servers carry the service's own token (scopes: see `hubconfig.SERVICE_SCOPES`).
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
from .culler import Decision, decide, warning_text

__all__ = ["GpuAdminState", "ServerRecord"]

log = logging.getLogger("tfdist.hubadmin")

HISTORY_S = 3600.0  # the admin page's sparklines
SPARK_POINTS = 60


@dataclass
class ServerRecord:
    user: str
    name: str  # "" for the default server
    profile: str | None
    gpu_model: str | None
    url: str  # path on the proxy, e.g. /user/alice/
    gpus: list[dict[str, Any]] = field(default_factory=list)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4000))
    points: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4000))
    idle_s: float | None = None
    jobs_running: list[dict[str, Any]] = field(default_factory=list)
    decision: Decision | None = None
    warned_cull_at: float | None = None
    error: str | None = None
    seen: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.user}/{self.name}"

    def last_utils(self) -> list[float | None]:
        return list(self.history[-1][1]) if self.history else [None] * len(self.gpus)

    def last_mem(self) -> list[float | None]:
        return list(self.history[-1][2]) if self.history else [None] * len(self.gpus)

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


class GpuAdminState:
    """Everything the service knows; `refresh()` is one round over the hub's running servers."""

    def __init__(
        self,
        *,
        api_url: str,
        api_token: str,
        public_url: str,
        culling: CullingConfig | None,
        profile_models: dict[str, str] | None = None,
        machine_gpus: list[str] | None = None,
        concurrency: int = 16,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = api_token
        self.public_url = public_url.rstrip("/")
        self.culling = culling
        self.model_names = profile_models or {}  # gpu model key -> display name
        # embedded hub: the NVML names of this machine's GPUs (free = these - held); None on Kubernetes
        self.machine_gpus = machine_gpus
        self.servers: dict[str, ServerRecord] = {}
        self.last_refresh = 0.0
        self.last_cull_check = 0.0
        self.refresh_seconds = 0.0  # wall time of the last round
        self.culled_total = 0
        self.warned_total = 0
        self.check_seconds_total = 0.0
        self.checks_total = 0
        self._sem = asyncio.Semaphore(concurrency)
        self._round: asyncio.Future | None = None
        self.http = AsyncHTTPClient()

    # ---- HTTP -------------------------------------------------------------------------------------

    async def _request(self, url: str, method: str = "GET", body: Any = None, timeout: float = 10) -> Any:
        req = HTTPRequest(
            url,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
            body=None if body is None and method in ("GET", "DELETE") else json.dumps(body or {}),
            request_timeout=timeout,
            follow_redirects=False,
            allow_nonstandard_methods=True,
        )
        resp = await self.http.fetch(req)
        return json.loads(resp.body) if resp.body else None

    async def hub(self, path: str, method: str = "GET", body: Any = None) -> Any:
        return await self._request(f"{self.api_url}{path}", method, body)

    async def server_api(self, rec: ServerRecord, path: str, method: str = "GET", body: Any = None) -> Any:
        return await self._request(f"{self.public_url}{rec.url}tfdist/api/{path}", method, body)

    # ---- one round --------------------------------------------------------------------------------

    def rule_for(self, rec: ServerRecord) -> CullingRule | None:
        return self.culling.rule(rec.profile) if self.culling else None

    async def refresh(self, max_age: float = 0.0) -> None:
        """One round, or wait for the one in flight; nothing when the last ended under `max_age` ago."""
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
                    )
        for key in list(self.servers):
            if key not in seen:
                del self.servers[key]
        now = time.time()
        cull_due = self.culling is not None and now - self.last_cull_check >= self.culling.check_interval_s
        await asyncio.gather(*(self._one(rec, cull_due) for rec in list(self.servers.values())))
        if cull_due:
            self.last_cull_check = now
        self.refresh_seconds = time.perf_counter() - t0
        self.last_refresh = time.time()

    async def _one(self, rec: ServerRecord, cull_due: bool) -> None:
        async with self._sem:
            t0 = time.perf_counter()
            rule = self.rule_for(rec)
            busy = rule.idle_below_percent if rule else 5.0
            last_t = rec.history[-1][0] if rec.history else None
            history = HISTORY_S if last_t is None else max(1.0, min(HISTORY_S, time.time() - last_t + 1))
            try:
                rep = await self.server_api(rec, f"activity?busy_percent={busy:g}&history={history:g}")
            except (HTTPClientError, OSError, ValueError) as e:
                rec.error = str(e)
                log.warning("tfdist gpu admin: cannot read %s's activity: %s", rec.key, e)
                return
            rec.error = None
            rec.seen = time.time()
            rec.gpus = rep.get("gpus") or []
            rec.idle_s = rep.get("idle_s")
            rec.jobs_running = rep.get("jobs_running") or []
            for t, u, m in rep.get("samples") or []:
                if last_t is None or t > last_t:
                    rec.add(t, u, m)
            if cull_due:
                await self._cull_step(rec, rule, rep)
            self.check_seconds_total += time.perf_counter() - t0
            self.checks_total += 1

    async def _cull_step(self, rec: ServerRecord, rule: CullingRule | None, rep: dict[str, Any]) -> None:
        now = time.time()
        d = decide(rule, rep, rec.warned_cull_at, now)
        rec.decision = d
        if d.action in ("active", "job-running") and rec.warned_cull_at is not None:
            rec.warned_cull_at = None
            await self._quiet(self.server_api(rec, "notice", "DELETE"), rec)
            log.info("tfdist gpu admin: %s is in use again (%s); warning withdrawn", rec.key, d.action)
        elif d.action == "warn" and rule is not None:
            assert d.cull_at is not None
            rec.warned_cull_at = d.cull_at
            self.warned_total += 1
            text = warning_text(rule, d.cull_at - now)
            await self._quiet(
                self.server_api(rec, "notice", "POST", {"message": text, "cull_at": d.cull_at}), rec
            )
            log.info(
                "tfdist gpu admin: warned %s (GPUs idle %.0f s); stop at %.0f", rec.key, d.idle_s, d.cull_at
            )
        elif d.action == "cull":
            log.warning("tfdist gpu admin: stopping %s: GPUs idle for %.0f s", rec.key, d.idle_s or 0)
            path = (
                f"/users/{quote(rec.user)}/servers/{quote(rec.name)}"
                if rec.name
                else f"/users/{quote(rec.user)}/server"
            )
            try:
                await self.hub(path, "DELETE")
                self.culled_total += 1
            except (HTTPClientError, OSError) as e:
                log.error("tfdist gpu admin: could not stop %s: %s", rec.key, e)

    async def _quiet(self, aw: Any, rec: ServerRecord) -> None:
        try:
            await aw
        except (HTTPClientError, OSError, ValueError) as e:
            log.warning("tfdist gpu admin: notice to %s failed: %s", rec.key, e)

    async def run_forever(self, period: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("tfdist gpu admin: round failed")
            await asyncio.sleep(period)

    # ---- views ------------------------------------------------------------------------------------

    def view_json(self) -> str:
        """`view()` as JSON, built once per round and at most once a second, however many admins look."""
        key = self.last_refresh
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
            utils = rec.last_utils()
            rule = self.rule_for(rec)
            thr = rule.idle_below_percent if rule else 5.0
            for g, u in zip(rec.gpus, utils + [None] * (len(rec.gpus) - len(utils)), strict=False):
                t = totals.setdefault(
                    g.get("name") or "?", {"model": g.get("name") or "?", "held": 0, "busy": 0}
                )
                t["held"] += 1
                if u is not None and u >= thr:
                    t["busy"] += 1
            rows.append(
                {
                    "user": rec.user,
                    "server": rec.name,
                    "profile": rec.profile,
                    "gpu_model": self.model_names.get(rec.gpu_model or "", rec.gpu_model),
                    "gpus": [
                        {"index": g.get("index"), "name": g.get("name"), "uuid": g.get("uuid")}
                        for g in rec.gpus
                    ],
                    "util": utils,
                    "mem_mib": rec.last_mem(),
                    "idle_s": rec.idle_s,
                    "jobs": rec.jobs_running,
                    "action": rec.decision.action if rec.decision else None,
                    "cull_at": rec.warned_cull_at,
                    "error": rec.error,
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
