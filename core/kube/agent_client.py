"""The notebook's side of the coordinator agent (tfdist.runtime.agent): upload, follow, download.

aiohttp (already in the kernel through kubernetes_asyncio). Every request is signed and every answer's
signature is checked (tfdist.kube.signing): the token never leaves the notebook, and bytes that did not
come from the job's agent are never returned (so never unpickled). A dropped connection, a timeout or a
5xx is retried with backoff for up to `retry_for` seconds: one reset connection does not fail a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from ..errors import BackendUnavailable, TfdistError
from ..job import checkpoint as ck
from ..job import signing
from ..job.events import Event, Reader, StateEvent
from ..job.vocab import JobState

TRANSIENT_STATUS = (502, 503, 504)


class AgentForged(TfdistError):
    """An answer not signed with the job's token: something other than the job's agent answered."""


class AgentClosed(BackendUnavailable):
    """This kernel closed the client (the job was stopped or its results taken): nothing more to read."""


class AgentClient:
    def __init__(self, base_url: str, token: str, *, retry_for: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.retry_for = retry_for
        self._session: Any = None
        self._closed = False  # final: a request after close (a follower still polling) opens nothing
        self.requests = 0  # HTTP requests sent, retries included (benchmarks)

    async def _http(self) -> Any:
        import aiohttp

        if self._closed:
            raise AgentClosed(
                f"the client of the agent at {urlsplit(self.base_url).netloc} was closed: the job ended here"
            )
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        """For good: what still polls through this client ends with AgentClosed."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _once(self, method: str, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        import aiohttp

        auth, nonce = signing.sign_request(self._token, method, path, signing.digest(body))
        session = await self._http()
        self.requests += 1
        async with session.request(
            method,
            self.base_url + path,
            data=body if method in ("PUT", "POST") else None,
            headers={"Authorization": auth},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            data = await r.read()
            if r.status in TRANSIENT_STATUS:
                raise ConnectionError(f"agent answered {r.status}")
            if r.status == 401:
                raise AgentForged(
                    f"the coordinator's agent at {urlsplit(self.base_url).netloc} refused the job's "
                    f"signature: {data[:200]!r}"
                )
            try:
                signing.verify_response(
                    self._token, nonce, r.status, data, r.headers.get(signing.RESPONSE_HEADER)
                )
            except signing.BadSignature:
                raise AgentForged(
                    f"{urlsplit(self.base_url).netloc} answered without the job's signature: it is not this "
                    "job's coordinator; nothing it sent was used"
                ) from None
            return r.status, data

    async def request(
        self, method: str, path: str, body: bytes = b"", timeout: float = 30.0
    ) -> tuple[int, bytes]:
        """(status, body) of a signed request, retried on transient failures for `retry_for` seconds."""
        import aiohttp

        deadline = time.monotonic() + self.retry_for
        delay = 0.25
        while True:
            try:
                return await self._once(method, path, body, timeout)
            except RuntimeError:  # aiohttp's "Session is closed": closed between taking it and using it
                if self._closed:
                    await self._http()  # raises AgentClosed
                raise
            except (aiohttp.ClientError, ConnectionError, TimeoutError, OSError) as exc:
                if self._closed:  # the poll this close cut short: not the network's fault, not retried
                    await self._http()  # raises, with the reason
                if time.monotonic() + delay > deadline:
                    raise BackendUnavailable(
                        f"lost the coordinator's agent at {urlsplit(self.base_url).netloc} for "
                        f"{self.retry_for:g}s: {exc!r}"
                    ) from None
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)

    async def reachable(self) -> bool:
        """Whether the agent answers at all (an unsigned probe; nothing it says is trusted)."""
        import aiohttp

        if self._closed:
            return False
        try:
            session = await self._http()
            self.requests += 1
            async with session.get(self.base_url + "/healthz", timeout=aiohttp.ClientTimeout(total=3)) as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def upload(self, payload: bytes) -> None:
        """Once per job; a retry after a lost answer is accepted by the agent (same digest)."""
        status, data = await self.request("PUT", "/payload", payload, timeout=600.0)
        if status != 200:
            raise BackendUnavailable(f"the coordinator refused the payload ({status}): {data[:200]!r}")

    async def events(self, start: int = 0) -> AsyncIterator[Event]:
        """Every event from `start` on, until the job's final state, as checked records.

        The agent relays what the job's pods sent: each event is parsed here, where it enters the
        kernel, so the backend's watch never reads an unchecked one; a malformed one is dropped, and the
        first of them is said in the job's log."""
        i = start
        said = Reader("the job's agent")
        while True:
            _, body = await self.request("GET", f"/events?from={i}", timeout=30.0)
            data = json.loads(body)
            i = max(i, data.get("first", i))  # events older than the agent's ring were dropped
            for raw in data["events"]:
                i += 1
                for ev in said.obj(raw):
                    yield ev
                    if isinstance(ev, StateEvent) and ev.state in (JobState.SUCCEEDED, JobState.FAILED):
                        return

    async def result(self) -> bytes | None:
        status, data = await self.request("GET", "/result", timeout=600.0)
        if status == 404:
            return None
        if status != 200:
            raise BackendUnavailable(f"the coordinator's agent answered {status} for the results")
        return data

    async def done(self) -> None:
        await self.request("POST", "/done", b"{}", timeout=10.0)

    async def latest_checkpoint(self) -> ck.CheckpointInfo | None:
        """The newest checkpoint the job's coordinator wrote (--checkpoint-every), or None (none yet, or
        being rotated: ask again later)."""
        status, data = await self.request("GET", "/checkpoint/latest", timeout=120.0)
        if status in (404, 409):
            return None
        if status != 200:
            raise BackendUnavailable(f"the coordinator's agent answered {status} for its checkpoint")
        return ck.CheckpointInfo.model_validate_json(data)

    async def fetch_checkpoint(
        self, dest: str, max_bytes: int = ck.MAX_BYTES, timeout: float = 600.0
    ) -> bool:
        """The bundle GET /checkpoint/latest announced, streamed to `dest` (never whole in memory) and kept
        only if the agent signed it and it is within `max_bytes`; False when the agent has none."""
        import aiohttp

        auth, nonce = signing.sign_request(self._token, "GET", "/checkpoint", signing.digest(b""))
        session = await self._http()
        self.requests += 1
        tmp = f"{dest}.part"
        try:
            async with session.get(
                self.base_url + "/checkpoint",
                headers={"Authorization": auth},
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as r:
                if r.status == 404:
                    await r.read()
                    return False
                if r.status == 401:
                    raise AgentForged(
                        f"the coordinator's agent at {urlsplit(self.base_url).netloc} refused the job's "
                        "signature for its checkpoint"
                    )
                if r.status != 200:
                    raise BackendUnavailable(
                        f"the coordinator's agent answered {r.status} for its checkpoint"
                    )
                if (r.content_length or 0) > max_bytes:
                    raise BackendUnavailable(
                        f"the job's checkpoint is {r.content_length} bytes, over {max_bytes}"
                    )
                h, got = hashlib.sha256(), 0
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        got += len(chunk)
                        if got > max_bytes:
                            raise BackendUnavailable(f"the job's checkpoint is over {max_bytes} bytes")
                        h.update(chunk)
                        await asyncio.to_thread(f.write, chunk)
                expected = signing.sign_response(self._token, nonce, 200, h.hexdigest())
                if not hmac.compare_digest(r.headers.get(signing.RESPONSE_HEADER) or "", expected):
                    raise AgentForged(
                        f"{urlsplit(self.base_url).netloc} sent a checkpoint without the job's signature: "
                        "it was not kept"
                    )
            os.replace(tmp, dest)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    async def hand_back_checkpoint(self, bundle: bytes) -> ck.Resume:
        """Give a readmitted job's coordinator its checkpoint, before the payload: its fit resumes there."""
        status, data = await self.request("PUT", "/checkpoint", bundle, timeout=600.0)
        if status != 200:
            raise BackendUnavailable(f"the coordinator refused the checkpoint ({status}): {data[:300]!r}")
        body = json.loads(data)
        return ck.Resume(epoch=int(body["epoch"]), step=int(body["step"]))
