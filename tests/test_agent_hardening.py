"""Security issue 22, the agent and the log tail, each attacked as a user would (the real agent on 127.0.0.1):
a captured signed request sent again is refused, an unsigned or oversized PUT never reaches the disk, and a
log with no newline is tailed in bounded time and bytes."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import select
import socket
import time
from pathlib import Path

import pytest

from tests.test_agent_signing import TOKEN, free_port
from tfdist.errors import BackendUnavailable
from tfdist.kube import signing
from tfdist.kube.agent_client import AgentClient
from tfdist.runtime.agent import AgentState, serve


@pytest.fixture
def agent(tmp_path):
    state = AgentState(str(tmp_path), TOKEN)
    port = free_port()
    srv = serve(state, port, host="127.0.0.1")
    yield state, port
    srv.shutdown()


class Tap:
    """A TCP relay in front of the agent that keeps every byte the clients sent: someone on the path."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.sent: list[bytearray] = []  # per connection
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = bytearray()
        self.sent.append(seen)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, keep: bytearray | None) -> None:
            try:
                while data := await r.read(65536):
                    if keep is not None:
                        keep += data
                    w.write(data)
                    await w.drain()
            finally:
                w.close()

        await asyncio.gather(pipe(reader, uw, seen), pipe(ur, writer, None), return_exceptions=True)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def send_raw(port: int, raw: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of bytes sent as they are: a captured request replayed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        resp = http.client.HTTPResponse(s)
        resp.begin()
        return resp.status, dict(resp.getheaders()), resp.read()


async def captured(url: str, tap: Tap, call) -> bytes:
    """The bytes of one request the real client sent through `tap`, on a connection of its own."""
    client = AgentClient(url, TOKEN, retry_for=5)
    try:
        await call(client)
    finally:
        await client.close()
    await asyncio.sleep(0.1)
    return bytes(tap.sent[-1])


def files_in(d: str) -> dict[str, int]:
    """Name -> size of what is in `d` now (a file removed while looking is not there)."""
    out = {}
    for f in os.listdir(d):
        with contextlib.suppress(FileNotFoundError):
            out[f] = os.path.getsize(os.path.join(d, f))
    return out


# ---------------------------------------------------------------------------------------------- replays
async def test_a_captured_result_request_replayed_once_the_result_exists_gets_nothing(agent):
    """Another tenant on the path captured the notebook's GET /result while the job ran (404); replayed once
    the result is there, it got the user's results, signed, on the old agent."""
    state, port = agent
    tap = Tap(port)
    url = await tap.start()
    try:
        raw = await captured(url, tap, lambda c: c.result())
        assert raw.startswith(b"GET /result ")
        secret = b"the user's trained weights"
        (Path(state.jobdir) / "result.bin").write_bytes(secret)
        status, _, body = await asyncio.to_thread(send_raw, port, raw)
        assert status != 200 and secret not in body, (status, body)
        assert status == 503 and b"sign the request again" in body  # what a real client answers by re-signing
        client = AgentClient(url, TOKEN, retry_for=5)  # the notebook itself still gets them
        try:
            assert await client.result() == secret
        finally:
            await client.close()
    finally:
        tap.close()


async def test_a_captured_done_post_replayed_changes_nothing(agent):
    """A replayed POST /done would tell the agent the notebook has its results (the pod may then end)."""
    state, port = agent
    tap = Tap(port)
    url = await tap.start()
    try:
        raw = await captured(url, tap, lambda c: c.done())
        assert state.delivered.is_set()
        state.delivered.clear()  # a new phase of the job: nothing was delivered since
        status, _, _ = await asyncio.to_thread(send_raw, port, raw)
        assert status == 503 and not state.delivered.is_set()
    finally:
        tap.close()


async def test_a_request_the_network_delivers_twice_still_succeeds(agent):
    """A duplicate is refused with 503, which every client answers by signing again: aiohttp resends an
    idempotent request, headers and all, when a kept-alive connection drops, and that must not fail a job."""
    state, port = agent
    (Path(state.jobdir) / "result.bin").write_bytes(b"results")
    first = {"done": False}

    async def dup(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")  # a GET: no body
        if not first["done"]:
            first["done"] = True
            await asyncio.to_thread(send_raw, port, head)  # the copy that got there first
        ur, uw = await asyncio.open_connection("127.0.0.1", port)
        uw.write(head[:-2] + b"Connection: close\r\n\r\n")  # so that read() below ends
        await uw.drain()
        writer.write(await ur.read())  # the agent closes after a refusal; a good answer ends the relay too
        await writer.drain()
        writer.close()
        uw.close()

    proxy = await asyncio.start_server(dup, "127.0.0.1", 0)
    client = AgentClient(f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}", TOKEN, retry_for=10)
    try:
        status, body = await client.request("GET", "/result", timeout=5)
        assert (status, body) == (200, b"results") and client.requests >= 2
    finally:
        await client.close()
        proxy.close()


def test_the_replay_cache_is_bounded_by_its_window_and_its_size():
    cache = signing.ReplayCache(max_entries=1000, window_s=300, bucket_s=10)
    now = 1_000_000.0
    for i in range(1000):
        cache.admit(f"n{i}", now, now)
    with pytest.raises(signing.Replayed, match="already received"):
        cache.admit("n7", now, now + 299)
    with pytest.raises(signing.Replayed, match="1000 signed requests"):  # full: refuse, never forget one
        cache.admit("fresh", now, now + 1)
    cache.admit("n7", now, now + 311)  # its signature is too old by now anyway: the memory is freed
    assert len(cache) == 1
    # a timestamp ahead of the agent's clock is accepted longer, so its nonce is kept longer too
    cache.admit("ahead", now + 300, now + 311)
    with pytest.raises(signing.Replayed):
        cache.admit("ahead", now + 300, now + 599)


def test_verify_request_takes_a_nonce_once_and_only_after_its_signature():
    cache, path, empty = signing.ReplayCache(), "/events?from=0", signing.digest(b"")
    auth, nonce = signing.sign_request(TOKEN, "GET", path, empty, now=1000)
    with pytest.raises(signing.BadSignature, match="wrong signature"):  # no token: nothing remembered
        signing.verify_request("other", auth, "GET", path, empty, 1000, cache)
    assert len(cache) == 0
    assert signing.verify_request(TOKEN, auth, "GET", path, empty, 1000, cache) == nonce
    with pytest.raises(signing.Replayed):
        signing.verify_request(TOKEN, auth, "GET", path, empty, 1001, cache)


# ------------------------------------------------------------------------------------------- the PUT body
def test_an_unsigned_put_is_refused_before_a_byte_of_its_body_reaches_the_disk(agent):
    """Anyone who reaches the port streams a 'payload' of a GiB: the old agent wrote it to the pod's disk
    before looking at the signature."""
    state, port = agent
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PUT /payload HTTP/1.1\r\nHost: agent\r\nContent-Length: %d\r\n\r\n" % 2**30)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused before it was all sent
            for _ in range(256):  # 16 MiB of it, unless the answer comes first
                if select.select([s], [], [], 0)[0]:
                    break
                s.sendall(b"\0" * 65536)
        time.sleep(0.3)
        assert sum(files_in(state.jobdir).values()) == 0, files_in(state.jobdir)
        resp = http.client.HTTPResponse(s)
        resp.begin()  # answered without waiting for the GiB
        assert resp.status == 401
    assert files_in(state.jobdir) == {} and not state.payload_ready.is_set()


def test_a_signed_put_declaring_a_huge_body_gets_413_at_once(agent):
    state, port = agent
    auth, _ = signing.sign_request(TOKEN, "PUT", "/payload", signing.digest(b"x"))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"PUT /payload HTTP/1.1\r\nHost: agent\r\nAuthorization: %s\r\nContent-Length: %d\r\n\r\n"
            % (auth.encode(), 2**40)
        )
        resp = http.client.HTTPResponse(s)
        resp.begin()
        assert resp.status == 413 and b"over the agent's" in resp.read()
    assert files_in(state.jobdir) == {}


async def test_the_notebook_is_told_its_payload_is_too_big_and_a_good_one_still_goes_through(tmp_path):
    state = AgentState(str(tmp_path), TOKEN, max_put=2**20)
    port = free_port()
    srv = serve(state, port, host="127.0.0.1")
    client = AgentClient(f"http://127.0.0.1:{port}", TOKEN, retry_for=5)
    try:
        with pytest.raises(BackendUnavailable, match=r"refused the payload \(413\)"):
            await client.upload(b"\1" * (8 * 2**20))
        assert files_in(state.jobdir) == {}
        await client.upload(b"\2" * 2**20)
        assert (tmp_path / "payload.bin").read_bytes() == b"\2" * 2**20 and files_in(state.jobdir).keys() == {
            "payload.bin"
        }
    finally:
        await client.close()
        srv.shutdown()


def test_a_body_other_than_the_signed_one_or_cut_short_leaves_nothing(agent):
    """A signed header with another body (a tampering relay), or a body that stops halfway: refused, and
    no partial file is left behind."""
    state, port = agent
    good = b"A" * 300_000
    auth, _ = signing.sign_request(TOKEN, "PUT", "/payload", signing.digest(good))
    head = b"PUT /payload HTTP/1.1\r\nHost: agent\r\nAuthorization: %s\r\nContent-Length: %d\r\n\r\n"
    status, _, body = send_raw(port, head % (auth.encode(), len(good)) + b"B" * len(good))
    assert status == 400 and b"not the one that was signed" in body
    auth, _ = signing.sign_request(TOKEN, "PUT", "/payload", signing.digest(good))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head % (auth.encode(), len(good)) + good[:150_000])
        time.sleep(0.3)
    deadline = time.monotonic() + 5
    while files_in(state.jobdir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert files_in(state.jobdir) == {} and not state.payload_ready.is_set()


# -------------------------------------------------------------------------------------------- the log tail
async def test_the_tail_of_a_log_without_newlines_is_fast_and_bounded(tmp_path: Path) -> None:
    """The lab panel asks for 3 lines of each task's log every second; a task that printed 16 MiB without a
    newline (or a progress bar of '\\r' only) made the old tail re-read the whole file once per 64 KiB block
    and return all of it."""
    from tfdist.backends.local import LocalBackend
    from tfdist.jobspec import JobSpec

    d = tmp_path / "jobs" / "flood"
    (d / "logs").mkdir(parents=True)
    (d / "spec.json").write_text(JobSpec(name="flood", user="me").to_json())
    (d / "logs" / "worker-0.log").write_bytes(b"x" * (16 * 2**20))
    (d / "logs" / "chief-0.log").write_bytes(b"".join(b"step %d/999999\r" % i for i in range(700_000)))
    backend = LocalBackend(str(tmp_path / "jobs"))
    t0 = time.monotonic()
    tails = await backend.logs("flood", tail=3)
    took = time.monotonic() - t0
    one = tails["worker-0"]
    assert len(one) <= 64 * 1024 and one.startswith("[...] xxx"), len(one)
    assert took < 1.0, f"{took:.2f}s for two tails"
    assert tails["chief-0"].splitlines() == [f"step {i}/999999" for i in (699997, 699998, 699999)]


# ------------------------------------------------------------------------------------------ compatibility
def old_client_header(method: str, path: str, body: bytes) -> str:
    """What the notebook's client of the previous version sends: the same HMAC, no declared digest."""
    auth, _ = signing.sign_request(TOKEN, method, path, signing.digest(body))
    head, _, declared = auth.rpartition(",sha256=")
    assert declared == signing.digest(body)
    return head


def test_an_older_notebooks_requests_still_work_but_its_payload_is_refused_with_a_reason(agent):
    """Its GETs and its small POST /done are served (that body is read before the signature, at most 64
    KiB); its PUT cannot be checked before its body is read, so it is refused, saying why."""
    state, port = agent
    (Path(state.jobdir) / "result.bin").write_bytes(b"results")
    auth = old_client_header("GET", "/result", b"")
    status, _, body = send_raw(
        port, b"GET /result HTTP/1.1\r\nHost: a\r\nAuthorization: %s\r\n\r\n" % auth.encode()
    )
    assert (status, body) == (200, b"results")
    auth = old_client_header("POST", "/done", b"{}")
    raw = (
        b"POST /done HTTP/1.1\r\nHost: a\r\nAuthorization: %s\r\nContent-Length: 2\r\n\r\n{}" % auth.encode()
    )
    assert send_raw(port, raw)[0] == 200 and state.delivered.is_set()
    auth = old_client_header("PUT", "/payload", b"model")
    raw = (
        b"PUT /payload HTTP/1.1\r\nHost: a\r\nAuthorization: %s\r\nContent-Length: 5\r\n\r\nmodel"
        % auth.encode()
    )
    status, _, body = send_raw(port, raw)
    assert (
        status == 401 and b"older than the job image" in body and files_in(state.jobdir) == {"result.bin": 7}
    )


# ------------------------------------------------------------------------------------------- ownership
async def test_a_closed_client_opens_no_new_session_for_a_follower_still_polling(agent):
    """The backend closes a job's client when the job stops while its event follower may still be polling:
    the poll cut by the close was retried on a new session nobody closed (one "Unclosed client session" per
    stopped job in bench_kueue's 100-job run). Closed is final: the follower ends, no session is left."""
    client = AgentClient(f"http://127.0.0.1:{agent[1]}", TOKEN, retry_for=10)

    async def follow() -> None:
        async for _ in client.events():
            pass

    follower = asyncio.ensure_future(follow())
    await asyncio.sleep(0.5)  # its poll waits on the agent: no event yet
    assert client.requests >= 1 and not follower.done()
    await client.close()
    with pytest.raises(BackendUnavailable, match="closed"):
        await asyncio.wait_for(follower, 5)
    assert client._session is None, "a session was opened after close"
    assert not await client.reachable()
