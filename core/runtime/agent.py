"""The coordinator pod's agent: how a notebook reaches its job on Kubernetes.

A small HTTP server in the coordinator pod (aiohttp, the maintained server the notebook's client already
uses, on its own loop in a thread). The notebook PUTs the payload (to MAX_PUT, streamed to disk, not a 1 MiB
ConfigMap), reads the job's events (a long poll), and GETs the results; workers POST their samples, and
all-reduce workers GET the payload (they run the cell too). Every call but /healthz must be signed with
the job's token (a per-job Secret; tfdist.kube.signing: the token itself never travels) and every answer
is signed back, so the notebook unpickles only what this agent sent; the NetworkPolicy admits only the
job's pods and the notebook pod to this port.

A request's signature is checked before its body is read (the header declares the body's digest; the body
is checked against it at the end), so nothing unsigned reaches the disk or memory; a signed request is
taken once (signing.ReplayCache: a captured one sent again is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from typing import Any

from aiohttp import web

from ..events import MetricsEvent, parse, to_wire
from ..job import checkpoint as ck
from ..job import signing
from ..job.events import LogEvent, ProgressEvent
from . import bodyfiles, ckptbundle
from . import events as wire
from .joblog import JobLog, MetricsMerger
from .psrecovery import CKPT_DIR

POLL_WAIT_S = 10.0
MAX_POST = 64 * 2**20  # a metrics sample of a 66-task job is tens of KiB; the payload is a streamed PUT
MAX_PUT = 16 * 2**30  # the payload: the notebook's models and in-memory data, streamed to the pod's disk
LEGACY_POST = 64 * 2**10  # a POST from a sender that declares no digest (an older notebook's /done: "{}")


class AgentState:
    def __init__(self, jobdir: str, token: str, max_put: int = MAX_PUT):
        self.jobdir = jobdir
        self.token = token
        self.max_put = max_put
        self.seen = signing.ReplayCache()
        self.log = JobLog()
        self.metrics = MetricsMerger(self.log)
        self.payload_ready = threading.Event()
        self.payload_digest = ""
        self.delivered = threading.Event()
        self.finished = threading.Event()
        # --checkpoint-every: the coordinator's checkpoints (psrecovery), the newest packed for the kernel
        self.ckpt_dir = os.path.join(jobdir, CKPT_DIR)
        self.ckpt_export = os.path.join(jobdir, "checkpoint-export.bin")
        self.exported: ck.CheckpointInfo | None = None
        self.resumed: ck.Resume | None = None  # the checkpoint a readmitted job was handed (PUT)


def _reply(code: int, body: Any, nonce: str | None, token: str) -> web.Response:
    """A JSON (or bytes) answer, signed over its status and body when the request was signed."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {}
    if nonce:
        headers[signing.RESPONSE_HEADER] = signing.sign_response(token, nonce, code, signing.digest(data))
    return web.Response(status=code, body=data, content_type="application/json", headers=headers)


class _Refused(Exception):
    def __init__(self, response: web.Response):
        self.response = response


def _refuse(code: int, error: str, nonce: str | None = None, token: str = "", **headers: str) -> _Refused:
    """A refusal that closes the connection: the body the request came with (if any) is never read. Signed
    when the request's signature was checked (`nonce`), so its sender can trust what it says."""
    resp = _reply(code, {"error": error}, nonce, token)
    resp.headers.update(headers)
    resp.force_close()
    return _Refused(resp)


def make_app(state: AgentState) -> web.Application:
    """The agent's routes. One catch-all route: a request is authenticated before its path is judged,
    so an unsigned caller learns nothing about which paths exist."""

    def authorize(request: web.Request, body_digest: str) -> str:
        try:
            return signing.verify_request(
                state.token,
                request.headers.get("Authorization", ""),
                request.method,
                request.raw_path,
                body_digest,
                seen=state.seen,
            )
        except signing.Replayed as exc:
            # 503, which every client of this agent (older ones too) answers by signing the request again:
            # aiohttp itself resends an idempotent request, headers and all, when a kept-alive connection
            # drops, and that resend must not fail the job
            raise _refuse(503, f"sign the request again ({exc})", **{"Retry-After": "1"}) from None
        except signing.BadSignature as exc:
            raise _refuse(401, f"a request signed with the job's token is required ({exc})") from None

    def authorize_declared(request: web.Request) -> tuple[str, str]:
        """(nonce, the body's declared digest), checked before the body is read."""
        try:
            declared = signing.parse_header(request.headers.get("Authorization", "")).body_digest
        except signing.BadSignature as exc:
            raise _refuse(401, f"a request signed with the job's token is required ({exc})") from None
        if declared is None:
            raise _refuse(401, "the signature declares no body digest (a notebook older than the job image)")
        return authorize(request, declared), declared

    async def events(request: web.Request, nonce: str) -> web.StreamResponse:
        try:
            start = max(0, int(request.query.get("from", "0")))
        except ValueError:
            return _reply(400, {"error": "from must be a number"}, nonce, state.token)
        # a long poll without a thread: the log is filled by other threads, so look again every 50 ms
        deadline = time.monotonic() + POLL_WAIT_S
        first, evs = state.log.read(start, 0)
        while not evs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            first, evs = state.log.read(start, 0)
        return _reply(200, {"first": first, "events": evs}, nonce, state.token)

    async def result(request: web.Request, nonce: str) -> web.StreamResponse:
        path = os.path.join(state.jobdir, "result.bin")
        if not os.path.exists(path):
            return _reply(404, {"error": "no result"}, nonce, state.token)
        return await bodyfiles.send_file(request, path, nonce, state.token)

    async def payload(request: web.Request, nonce: str) -> web.StreamResponse:
        # all-reduce workers run the cell too: they fetch it here, signed like everything else (the token
        # is the job's own Secret, which only the job's pods and the notebook hold)
        if not state.payload_ready.is_set():
            return _reply(404, {"error": "no payload yet"}, nonce, state.token)
        return await bodyfiles.send_file(
            request, os.path.join(state.jobdir, "payload.bin"), nonce, state.token
        )

    ckpt_lock = asyncio.Lock()  # a bundle is not repacked while it is being sent

    async def latest_checkpoint(nonce: str) -> web.StreamResponse:
        """The newest checkpoint's record (ck.CheckpointInfo), packed for GET /checkpoint when newer."""
        async with ckpt_lock:
            prog = await asyncio.to_thread(ckptbundle.progress, state.ckpt_dir)
            if prog is None:
                return _reply(404, {"error": "no checkpoint yet"}, nonce, state.token)
            if state.exported is None or (state.exported.step, state.exported.epoch) != (
                prog.step,
                prog.epoch,
            ):
                try:
                    state.exported = await asyncio.to_thread(
                        ckptbundle.pack, state.ckpt_dir, state.ckpt_export
                    )
                except ck.CheckpointError as exc:  # rotated meanwhile, or over the bound: said, asked again
                    return _reply(409, {"error": str(exc)}, nonce, state.token)
            return _reply(200, state.exported.model_dump(mode="json"), nonce, state.token)

    async def checkpoint(request: web.Request, nonce: str) -> web.StreamResponse:
        async with ckpt_lock:
            if state.exported is None:
                return _reply(
                    404, {"error": "no checkpoint packed (GET /checkpoint/latest)"}, nonce, state.token
                )
            return await bodyfiles.send_file(request, state.ckpt_export, nonce, state.token)

    async def put_checkpoint(
        request: web.Request, nonce: str, declared: str, size: int
    ) -> web.StreamResponse:
        """A readmitted job's checkpoint, before its payload: checked whole, then the coordinator's fit
        resumes from it (psrecovery). After the payload the fit may have started: refused."""
        if size > ck.MAX_BYTES:
            raise _refuse(413, f"a checkpoint is at most {ck.MAX_BYTES} bytes", nonce, state.token)
        if state.payload_ready.is_set():
            await bodyfiles.drain(request)
            return _reply(
                409, {"error": "the payload came first: the fit may have started"}, nonce, state.token
            )
        tmp = os.path.join(state.jobdir, f"checkpoint-in.part{id(request)}")
        try:
            got, digest = await bodyfiles.stream_to(request, tmp)
            if got != size or digest != declared:
                return _reply(400, {"error": "the body is not the one that was signed"}, nonce, state.token)
            try:
                prog = await asyncio.to_thread(ckptbundle.unpack, tmp, state.ckpt_dir)
            except ck.CheckpointError as exc:
                return _reply(400, {"error": f"not a checkpoint: {exc}"[:500]}, nonce, state.token)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        state.resumed = ck.Resume(epoch=prog.epoch, step=prog.step)
        state.log.add(to_wire(LogEvent(lines=(("chief-0", "tfdist: " + state.resumed.sentence()),))))
        state.log.add(to_wire(ProgressEvent(phase="resuming", epoch=prog.epoch, step=prog.step)))
        return _reply(200, {"ok": True, "epoch": prog.epoch, "step": prog.step}, nonce, state.token)

    async def put(request: web.Request) -> web.StreamResponse:
        nonce, declared = authorize_declared(request)
        size = request.content_length
        if size is None:
            raise _refuse(411, "a payload needs a Content-Length", nonce, state.token)
        if size > state.max_put:
            raise _refuse(413, f"{size} bytes is over the agent's {state.max_put}", nonce, state.token)
        if request.raw_path == "/checkpoint":
            return await put_checkpoint(request, nonce, declared, size)
        if request.raw_path != "/payload":
            await bodyfiles.drain(request)
            return _reply(404, {"error": "unknown path"}, nonce, state.token)
        if not state.payload_ready.is_set():
            got = await receive(request, os.path.join(state.jobdir, "payload.bin"), declared, size)
            if got != "ok":
                return _reply(400, {"error": got}, nonce, state.token)
        else:
            await bodyfiles.drain(request)
        ok = state.payload_digest == declared  # this one, or a retried upload of the same payload
        body = {"ok": True} if ok else {"error": "another payload was received"}
        return _reply(200 if ok else 409, body, nonce, state.token)

    async def receive(request: web.Request, dest: str, declared: str, size: int) -> str:
        """Stream a signed body to `dest` ("ok"), or say why not: nothing of it is left on disk."""
        tmp = f"{dest}.part{id(request)}"
        try:
            got, digest = await bodyfiles.stream_to(request, tmp)
            if got < size:
                return "the payload was cut short"
            if digest != declared:
                return "the body is not the one that was signed"
            if not state.payload_ready.is_set():  # a concurrent upload may have won meanwhile
                state.payload_digest = digest
                os.replace(tmp, dest)
                state.payload_ready.set()
            return "ok"
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    async def post(request: web.Request) -> web.StreamResponse:
        if _declared_digest(request) is not None:
            nonce, declared = authorize_declared(request)
            if (request.content_length or 0) > MAX_POST:
                raise _refuse(413, f"a POST is at most {MAX_POST} bytes", nonce, state.token)
            body = await request.read()  # at most MAX_POST (client_max_size), and only once signed
            if signing.digest(body) != declared:
                return _reply(400, {"error": "the body is not the one that was signed"}, nonce, state.token)
        else:  # an older sender: its (small) body is read before its signature can be checked
            if request.content_length is None or request.content_length > LEGACY_POST:
                raise _refuse(413, f"an unsigned-digest body is at most {LEGACY_POST} bytes")
            body = await request.read()
            nonce = authorize(request, signing.digest(body))
        if request.raw_path == "/metrics":
            try:  # a job's own pod, but checked: its sample goes into every watcher's view
                ev = parse(wire.loads(body or b"{}"))
            except ValueError as exc:  # EventError is one
                return _reply(400, {"error": f"not a metrics event: {exc}"[:500]}, nonce, state.token)
            if isinstance(ev, MetricsEvent):
                state.metrics.add(ev)
            return _reply(200, {"ok": True}, nonce, state.token)
        if request.raw_path == "/done":
            state.delivered.set()
            return _reply(200, {"ok": True}, nonce, state.token)
        return _reply(404, {"error": "unknown path"}, nonce, state.token)

    async def dispatch(request: web.Request) -> web.StreamResponse:
        try:
            if request.method == "GET":
                if request.path == "/healthz":
                    return _reply(200, {"finished": state.finished.is_set()}, None, "")
                nonce = authorize(request, signing.digest(b""))
                if request.path == "/events":
                    return await events(request, nonce)
                if request.path == "/result":
                    return await result(request, nonce)
                if request.path == "/payload":
                    return await payload(request, nonce)
                if request.path == "/checkpoint/latest":
                    return await latest_checkpoint(nonce)
                if request.path == "/checkpoint":
                    return await checkpoint(request, nonce)
                return _reply(404, {"error": "unknown path"}, nonce, state.token)
            if request.method == "PUT":
                return await put(request)
            if request.method == "POST":
                return await post(request)
            return _reply(405, {"error": f"{request.method} is not served here"}, None, "")
        except _Refused as refused:
            return refused.response

    app = web.Application(client_max_size=MAX_POST)
    app.router.add_route("*", "/{tail:.*}", dispatch)
    return app


def _declared_digest(request: web.Request) -> str | None:
    try:
        return signing.parse_header(request.headers.get("Authorization", "")).body_digest
    except signing.BadSignature:
        return None


class AgentServer:
    """The agent served by aiohttp on its own event loop in a background thread: the pod's entry point
    (runtime.podmain) stays plain blocking code around the coordinator process."""

    def __init__(self, state: AgentState, port: int, host: str = "0.0.0.0"):
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(
            make_app(state), access_log=None, handle_signals=False, shutdown_timeout=1
        )
        self._up = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(host, port), name="tfdist-agent", daemon=True)
        self._thread.start()
        self._up.wait()
        if self._error is not None:  # a port in use: raised in the caller, as a bind error would be
            self._thread.join()
            raise self._error

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, host, port).start())
        except BaseException as exc:
            self._error = exc
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()
            return
        finally:
            self._up.set()
        self._loop.run_forever()

    def shutdown(self) -> None:
        """Stop serving: open long polls are cut, the port is free when this returns."""
        if self._loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        with contextlib.suppress(Exception):
            fut.result(15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(15)
        if not self._thread.is_alive():
            self._loop.close()


def serve(state: AgentState, port: int, host: str = "0.0.0.0") -> AgentServer:
    return AgentServer(state, port, host)


def wait_until(pred, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False
