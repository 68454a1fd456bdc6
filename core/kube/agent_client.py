"""The notebook's side of the coordinator agent (tfdist.runtime.agent): upload, follow, download.

Blocking urllib calls run in threads (asyncio.to_thread), so the backend stays async without a new HTTP
dependency in the kernel.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any


class AgentClient:
    def __init__(self, base_url: str, token: str):
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {token}"}

    def _call(self, method: str, path: str, body: bytes | None = None, timeout: float = 30.0) -> bytes:
        req = urllib.request.Request(self.base_url + path, data=body, method=method, headers=self._auth)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    async def reachable(self) -> bool:
        try:
            await asyncio.to_thread(self._call, "GET", "/healthz", None, 3.0)
            return True
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    async def upload(self, payload: bytes) -> None:
        await asyncio.to_thread(self._call, "PUT", "/payload", payload, 600.0)

    async def events(self, start: int = 0) -> AsyncIterator[dict[str, Any]]:
        """Every event from `start` on, until the job's final state."""
        i = start
        while True:
            data = json.loads(await asyncio.to_thread(self._call, "GET", f"/events?from={i}", None, 30.0))
            i = max(i, data.get("first", i))  # events older than the agent's ring were dropped
            for ev in data["events"]:
                i += 1
                yield ev
                if ev.get("type") == "state" and ev.get("state") in ("succeeded", "failed"):
                    return

    async def result(self) -> bytes | None:
        try:
            return await asyncio.to_thread(self._call, "GET", "/result", None, 600.0)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    async def done(self) -> None:
        await asyncio.to_thread(self._call, "POST", "/done", b"{}", 10.0)
