"""Push this server's GPU activity to the hub's GPU admin service, and take the culler's notice back.

Why push: the service must never send a credential to a server (its user controls the server's code), so
the server reports, with its own token (``JUPYTERHUB_API_TOKEN``, good for this one server only), to the
URL its spawner gave it (``TFDIST_GPU_ADMIN_URL``). The answer says when to report next, which idle
threshold to count against, and the notice (warning) for this server's user, which the lab shows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from ..hubadmin.report import MAX_SAMPLES, ReportReply
from ..settings import ENV_GPU_ADMIN_URL, LabSettings
from .activity import Notice, current_report

__all__ = ["ENV_URL", "Reporter", "reporter_from_env"]

ENV_URL = ENV_GPU_ADMIN_URL
FIRST_HISTORY_S = 3600.0  # the first report after a (service) restart carries the page's hour
RETRY_S = 10.0
NOT_LISTED_RETRY_S = 2.0  # the hub lists a server only once it is ready: that is seconds away

log = logging.getLogger("tfdist.labserver.reporter")


@dataclass
class Reporter:
    url: str
    token: str
    web_settings: dict[str, Any]
    busy_percent: float | None = None  # told by the service; None until its first answer
    sent_until: float | None = None  # time of the newest sample the service accepted
    failing: bool = False
    http: Any = field(default_factory=AsyncHTTPClient)

    @property
    def notice(self) -> Notice:
        return self.web_settings["tfdist_notice"]

    async def once(self, now: float) -> float:
        """One report; returns the seconds until the next."""
        after = self.sent_until if self.sent_until is not None else now - FIRST_HISTORY_S
        rep = await current_report(self.web_settings, self.busy_percent, after, log)
        rep["samples"] = rep["samples"][-MAX_SAMPLES:]
        req = HTTPRequest(
            self.url,
            method="POST",
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
            body=json.dumps(rep),
            request_timeout=10,
            follow_redirects=False,
        )
        try:
            resp = await self.http.fetch(req)
            reply = ReportReply.model_validate_json(resp.body)
        except HTTPClientError as e:
            body = e.response.body.decode(errors="replace").strip() if e.response is not None else ""
            self._failed(f"{e.code} {body or e.message}")
            return NOT_LISTED_RETRY_S if e.code == 404 else RETRY_S
        except (OSError, ValidationError, ValueError) as e:
            self._failed(str(e))
            return RETRY_S
        if self.failing:
            log.info("tfdist: GPU activity reports to %s work again", self.url)
        self.failing = False
        if rep["samples"]:
            self.sent_until = rep["samples"][-1]["t"]
        self.busy_percent = reply.busy_percent
        n = reply.notice
        self.notice.set(n.message if n else None, n.cull_at if n else None)
        return reply.next_report_s

    def _failed(self, why: str) -> None:
        (log.debug if self.failing else log.warning)("tfdist: GPU activity report not taken: %s", why)
        self.failing = True

    async def run(self) -> None:
        while True:
            try:
                delay = await self.once(time.time())
            except Exception:  # never let the reporter die with the server still up
                log.exception("tfdist: GPU activity report failed")
                delay = RETRY_S
            await asyncio.sleep(max(0.2, delay))


def reporter_from_env(web_settings: dict[str, Any]) -> Reporter | None:
    """A reporter when the spawner said where to report; None for a lab not started by a tfdist hub."""
    url, token = LabSettings().gpu_admin_url, os.environ.get("JUPYTERHUB_API_TOKEN")
    if not url or not token:
        return None
    return Reporter(url, token, web_settings)
