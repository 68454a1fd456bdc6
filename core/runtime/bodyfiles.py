"""Request and response bodies of any size to and from the coordinator pod's disk, with their SHA-256, for
the agent (the payload, results and checkpoints run to hundreds of MB: never whole in memory), and a
response signed over the whole body's digest.
"""

from __future__ import annotations

import asyncio
import hashlib

from aiohttp import web

from ..job import signing

CHUNK = 1 << 20


async def stream_to(request: web.Request, path: str) -> tuple[int, str]:
    """(bytes, sha256) of the request's body, written to `path` as it comes (hundreds of MB: not in RAM)."""
    h, got = hashlib.sha256(), 0
    with open(path, "wb") as f:
        async for chunk in request.content.iter_chunked(CHUNK):
            await asyncio.to_thread(f.write, chunk)
            h.update(chunk)
            got += len(chunk)
    return got, h.hexdigest()


async def drain(request: web.Request) -> None:
    """Read a signed body to nowhere: its sender gets its answer after sending it, as it expects."""
    async for _ in request.content.iter_chunked(CHUNK):
        pass


async def send_file(request: web.Request, path: str, nonce: str, token: str) -> web.StreamResponse:
    """A file of any size, streamed, its response signed over the whole body's digest."""
    size, digest = await asyncio.to_thread(size_and_digest, path)  # hundreds of MB: off the loop
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "application/octet-stream",
            signing.RESPONSE_HEADER: signing.sign_response(token, nonce, 200, digest),
        },
    )
    resp.content_length = size
    await resp.prepare(request)
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            await resp.write(chunk)
    await resp.write_eof()
    return resp


def size_and_digest(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()
