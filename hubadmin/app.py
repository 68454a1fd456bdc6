"""The service's HTTP side: the admin page, its JSON, Prometheus metrics, and the servers' reports.

Admins only: a logged-in user who is not a hub admin gets 403 on the page, its JSON and the metrics; a token
of a hub service (Prometheus' own, with ``access:services!service=tfdist-gpu-admin``) may read ``metrics``
only. ``POST api/report`` takes a server's activity report with that server's own token (see `identity`).
"""

from __future__ import annotations

import html
import time
from importlib import resources
from typing import Any
from urllib.parse import quote

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from jupyterhub.utils import url_path_join
from tornado import web
from tornado.httpclient import HTTPClientError

from .metrics import render_metrics
from .report import ReportError, parse_report
from .servers import UnknownServer
from .service import GpuAdminState

__all__ = ["make_app"]

ADMIN_CACHE_S = 30.0


class _Plain(web.RequestHandler):
    """Errors as one line of text (the reason given), never a page."""

    @property
    def state(self) -> GpuAdminState:
        return self.settings["gpu_admin"]

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        reason = self._reason
        exc = kwargs.get("exc_info")
        if exc and isinstance(exc[1], web.HTTPError) and exc[1].log_message:
            reason = exc[1].log_message
        self.finish(f"{status_code}: {reason}\n")


class _Base(HubOAuthenticated, _Plain):
    async def require_admin(self, allow_services: bool = False) -> dict[str, Any]:
        user = self.get_current_user()
        if user is None:
            raise web.HTTPError(403)
        if user.get("kind") == "service":
            if allow_services:
                return user
            raise web.HTTPError(403, "hub admins only")
        if not await self._is_admin(user["name"]):
            raise web.HTTPError(403, "hub admins only")
        return user

    async def _is_admin(self, name: str) -> bool:
        cache: dict[str, tuple[float, bool]] = self.settings["admin_cache"]
        hit = cache.get(name)
        if hit and time.monotonic() - hit[0] < ADMIN_CACHE_S:
            return hit[1]
        try:
            # quoted: a user named "admin?" or "admin/x" must not be read as the user "admin"
            model = await self.state.hub(f"/users/{quote(name, safe='')}")
            ok = bool(model and model.get("admin"))
        except Exception:
            ok = False
        cache[name] = (time.monotonic(), ok)
        return ok


class PageHandler(_Base):
    @web.authenticated
    async def get(self) -> None:
        await self.require_admin()
        page = (resources.files("tfdist.hubadmin") / "static" / "admin.html").read_text()
        # the page's fetches are cookie-authenticated, not navigations: JupyterHub wants its xsrf token
        token = html.escape(
            self.xsrf_token.decode() if isinstance(self.xsrf_token, bytes) else self.xsrf_token
        )
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
        self.finish(page.replace("{{xsrf}}", token))


class ScriptHandler(_Base):
    @web.authenticated
    async def get(self) -> None:
        await self.require_admin()
        self.set_header("Content-Type", "text/javascript; charset=utf-8")
        self.finish((resources.files("tfdist.hubadmin") / "static" / "admin.js").read_text())


class ServersHandler(_Base):
    @web.authenticated
    async def get(self) -> None:
        await self.require_admin()
        self.state.last_viewed = time.time()  # servers are asked to report every 2 s while someone looks
        await self.state.refresh(max_age=1.5)
        self.set_header("Content-Type", "application/json")
        self.finish(self.state.view_json())


class MetricsHandler(_Base):
    @web.authenticated
    async def get(self) -> None:
        await self.require_admin(allow_services=True)
        await self.state.refresh(max_age=5.0)
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(render_metrics(self.state))


def _bearer(header: str) -> str | None:
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() not in ("token", "bearer"):
        return None
    return token.strip() or None


class ReportHandler(_Plain):
    """A server's activity report, attributed to the server its token was issued for (never to a name in
    the body); the answer is the culler's notice for that server and when to report next."""

    async def post(self) -> None:
        token = _bearer(self.request.headers.get("Authorization", ""))
        if token is None:
            raise web.HTTPError(401, "send the report with your server's token (Authorization: token ...)")
        try:
            sid = await self.state.identities.server_for(token)
        except (HTTPClientError, OSError) as e:
            raise web.HTTPError(503, f"cannot ask the hub whose token this is: {e}") from None
        if sid is None:
            self.state.refuse(None, "not a server's token")
            raise web.HTTPError(403, "this token is not a server's own token (JUPYTERHUB_API_TOKEN)")
        try:
            rep = parse_report(self.request.body, time.time())
        except ReportError as e:
            self.state.refuse(sid, str(e))
            raise web.HTTPError(400, str(e)) from None
        try:
            rec = await self.state.record_for(sid)
        except UnknownServer as e:
            raise web.HTTPError(404, str(e)) from None
        why = rec.overclaim(rep)
        if why is not None:
            self.state.refuse(sid, why)
            raise web.HTTPError(400, why)
        reply = await self.state.accept(rec, rep)
        self.set_header("Content-Type", "application/json")
        self.finish(reply.model_dump_json())


def make_app(state: GpuAdminState, prefix: str) -> web.Application:
    return web.Application(
        [
            (prefix, PageHandler),
            (url_path_join(prefix, "admin.js"), ScriptHandler),
            (url_path_join(prefix, "api/servers"), ServersHandler),
            (url_path_join(prefix, "metrics"), MetricsHandler),
            (url_path_join(prefix, "api/report"), ReportHandler),
            (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
        ],
        gpu_admin=state,
        compress_response=True,
        admin_cache={},
        cookie_secret=__import__("os").urandom(32),
    )
