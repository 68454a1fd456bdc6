"""The service's HTTP side: the admin page, its JSON, and Prometheus metrics, all behind hub auth.

Admins only: a logged-in user who is not a hub admin gets 403 on every route; a token of a hub service
(Prometheus' own, with ``access:services!service=tfdist-gpu-admin``) may read ``metrics`` only.
"""

from __future__ import annotations

import html
import time
from importlib import resources
from typing import Any

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from jupyterhub.utils import url_path_join
from tornado import web

from .metrics import render_metrics
from .service import GpuAdminState

__all__ = ["make_app"]

ADMIN_CACHE_S = 30.0


class _Base(HubOAuthenticated, web.RequestHandler):
    @property
    def state(self) -> GpuAdminState:
        return self.settings["gpu_admin"]

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
            model = await self.state.hub(f"/users/{name}")
            ok = bool(model and model.get("admin"))
        except Exception:
            ok = False
        cache[name] = (time.monotonic(), ok)
        return ok

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        reason = self._reason
        exc = kwargs.get("exc_info")
        if exc and isinstance(exc[1], web.HTTPError) and exc[1].log_message:
            reason = exc[1].log_message
        self.finish(f"{status_code}: {reason}\n")


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
        await self.state.refresh(max_age=1.5)  # "a change shows within 2 s" while someone looks
        self.set_header("Content-Type", "application/json")
        self.finish(self.state.view_json())


class MetricsHandler(_Base):
    @web.authenticated
    async def get(self) -> None:
        await self.require_admin(allow_services=True)
        await self.state.refresh(max_age=5.0)
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(render_metrics(self.state))


def make_app(state: GpuAdminState, prefix: str) -> web.Application:
    return web.Application(
        [
            (prefix, PageHandler),
            (url_path_join(prefix, "admin.js"), ScriptHandler),
            (url_path_join(prefix, "api/servers"), ServersHandler),
            (url_path_join(prefix, "metrics"), MetricsHandler),
            (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
        ],
        gpu_admin=state,
        compress_response=True,
        admin_cache={},
        cookie_secret=__import__("os").urandom(32),
    )
