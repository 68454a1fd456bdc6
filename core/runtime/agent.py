"""The coordinator pod's agent: how a notebook reaches its job on Kubernetes.

A small HTTP server in the coordinator pod. The notebook PUTs the payload (any size: streamed to disk,
not a 1 MiB ConfigMap), reads the job's events, and GETs the results; workers POST their samples. Every
call but /healthz must be signed with the job's token (a per-job Secret; tfdist.kube.signing: the token
itself never travels) and every answer is signed back, so the notebook unpickles only what this agent
sent; the NetworkPolicy admits only the job's pods and the notebook pod to this port.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from ..kube import signing
from . import events as wire

CHUNK = 1 << 20
POLL_WAIT_S = 10.0


class JobLog:
    """Events in order, readable from any index (long-poll); thread-safe. A ring bounded by count *and*
    bytes: the coordinator pod's memory is the job's --memory, and one metrics event of a 66-task job is
    tens of KiB (20,000 of them were ~840 MiB), so only the newest events stay (a reader that fell
    behind skips ahead)."""

    def __init__(self, keep: int = 20000, keep_bytes: int = 32 * 2**20) -> None:
        self._events: list[dict[str, Any]] = []
        self._sizes: list[int] = []
        self._bytes = 0
        self._base = 0  # index of self._events[0]
        self._keep, self._keep_bytes = keep, keep_bytes
        self._cond = threading.Condition()

    def add(self, ev: dict[str, Any]) -> None:
        size = len(wire.dumps(ev))
        with self._cond:
            self._events.append(ev)
            self._sizes.append(size)
            self._bytes += size
            drop = max(len(self._events) - self._keep, 0)
            freed = sum(self._sizes[:drop])
            while self._bytes - freed > self._keep_bytes and drop < len(self._events) - 1:
                freed += self._sizes[drop]
                drop += 1
            if drop:
                self._bytes -= freed
                del self._events[:drop], self._sizes[:drop]
                self._base += drop
            self._cond.notify_all()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def read(self, start: int, wait: float) -> tuple[int, list[dict[str, Any]]]:
        """(index of the first event returned, events from `start` on)."""
        with self._cond:
            if start >= self._base + len(self._events):
                self._cond.wait(wait)
            first = max(start, self._base)
            return first, self._events[first - self._base :]


class MetricsMerger:
    """Each server pod posts its own sample; the notebook gets one metrics event per second for all."""

    def __init__(self, log: JobLog, period: float = 1.0) -> None:
        self._log, self._period = log, period
        self._latest: dict[str, Any] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="tfdist-metrics", daemon=True).start()

    def add(self, ev: dict[str, Any]) -> None:
        with self._lock:
            self._latest.update(ev.get("tasks", {}))

    def _run(self) -> None:
        while True:
            time.sleep(self._period)
            with self._lock:
                tasks, self._latest = self._latest, {}
            if tasks:
                self._log.add({"type": "metrics", "t": time.time(), "tasks": tasks})


class AgentState:
    def __init__(self, jobdir: str, token: str):
        self.jobdir = jobdir
        self.token = token
        self.log = JobLog()
        self.metrics = MetricsMerger(self.log)
        self.payload_ready = threading.Event()
        self.payload_digest = ""
        self.delivered = threading.Event()
        self.finished = threading.Event()


def make_handler(state: AgentState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "tfdist-agent"

        def log_message(self, fmt: str, *args: Any) -> None:  # requests are not job logs
            pass

        _nonce: str | None = None

        def _authorized(self, body_digest: str = signing.digest(b"")) -> bool:
            try:
                self._nonce = signing.verify_request(
                    state.token, self.headers.get("Authorization", ""), self.command, self.path, body_digest
                )
            except signing.BadSignature as exc:
                self._nonce = None
                self._send(401, {"error": f"a request signed with the job's token is required ({exc})"})
                return False
            return True

        def _sign(self, code: int, body_digest: str) -> None:
            if self._nonce:
                self.send_header(
                    signing.RESPONSE_HEADER,
                    signing.sign_response(state.token, self._nonce, code, body_digest),
                )

        def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self._sign(code, signing.digest(data))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/healthz":
                self._send(200, {"finished": state.finished.is_set()})
                return
            if not self._authorized():
                return
            if url.path == "/events":
                try:
                    start = max(0, int(parse_qs(url.query).get("from", ["0"])[0]))
                except ValueError:
                    self._send(400, {"error": "from must be a number"})
                    return
                first, evs = state.log.read(start, POLL_WAIT_S)
                self._send(200, {"first": first, "events": evs})
            elif url.path == "/result":
                path = os.path.join(state.jobdir, "result.bin")
                if not os.path.exists(path):
                    self._send(404, {"error": "no result"})
                    return
                size = os.path.getsize(path)
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self._sign(200, h.hexdigest())
                self.end_headers()
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        self.wfile.write(chunk)
            else:
                self._send(404, {"error": "unknown path"})

        def do_PUT(self) -> None:
            # the body is read (and hashed) before the signature over it can be checked
            left = int(self.headers.get("Content-Length", "0"))
            tmp = os.path.join(state.jobdir, f"payload.bin.part{threading.get_ident()}")
            h = hashlib.sha256()
            with open(tmp, "wb") as f:
                while left > 0:
                    chunk = self.rfile.read(min(CHUNK, left))
                    if not chunk:
                        break
                    f.write(chunk)
                    h.update(chunk)
                    left -= len(chunk)
            if not self._authorized(h.hexdigest()):
                os.unlink(tmp)
                return
            if self.path != "/payload" or state.payload_ready.is_set():
                os.unlink(tmp)
                ok = state.payload_digest == h.hexdigest()  # a retried upload of the same payload
                self._send(
                    200 if ok else 409, {"ok": True} if ok else {"error": "another payload was received"}
                )
                return
            if left:
                os.unlink(tmp)
                self._send(400, {"error": "the payload was cut short"})
                return
            state.payload_digest = h.hexdigest()
            os.replace(tmp, os.path.join(state.jobdir, "payload.bin"))
            state.payload_ready.set()
            self._send(200, {"ok": True})

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(n) if n else b""
            if not self._authorized(signing.digest(body)):
                return
            body = body or b"{}"
            if self.path == "/metrics":
                ev = wire.loads(body)
                if ev.get("type") == "metrics":
                    state.metrics.add(ev)
                self._send(200, {"ok": True})
            elif self.path == "/done":
                state.delivered.set()
                self._send(200, {"ok": True})
            else:
                self._send(404, {"error": "unknown path"})

    return Handler


def serve(state: AgentState, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer((host, port), make_handler(state))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="tfdist-agent", daemon=True).start()
    return srv


def wait_until(pred, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False
