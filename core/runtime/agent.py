"""The coordinator pod's agent: how a notebook reaches its job on Kubernetes.

A small HTTP server in the coordinator pod. The notebook PUTs the payload (any size: streamed to disk,
not a 1 MiB ConfigMap), reads the job's events, and GETs the results; workers POST their samples. Every
call but /healthz needs the job's token (a per-job Secret), and the NetworkPolicy admits only the job's
pods and the notebook pod to this port.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from . import events as wire

CHUNK = 1 << 20
POLL_WAIT_S = 10.0


class JobLog:
    """Events in order, readable from any index (long-poll); thread-safe."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def add(self, ev: dict[str, Any]) -> None:
        with self._cond:
            self._events.append(ev)
            self._cond.notify_all()

    def read(self, start: int, wait: float) -> list[dict[str, Any]]:
        with self._cond:
            if start >= len(self._events):
                self._cond.wait(wait)
            return self._events[start:]


class AgentState:
    def __init__(self, jobdir: str, token: str):
        self.jobdir = jobdir
        self.token = token
        self.log = JobLog()
        self.payload_ready = threading.Event()
        self.delivered = threading.Event()
        self.finished = threading.Event()


def make_handler(state: AgentState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "tfdist-agent"

        def log_message(self, fmt: str, *args: Any) -> None:  # requests are not job logs
            pass

        def _authorized(self) -> bool:
            got = self.headers.get("Authorization", "")
            ok = hmac.compare_digest(got.encode(), f"Bearer {state.token}".encode())
            if not ok:
                self._send(401, {"error": "a valid job token is required"})
            return ok

        def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
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
                start = int(parse_qs(url.query).get("from", ["0"])[0])
                self._send(200, {"events": state.log.read(start, POLL_WAIT_S)})
            elif url.path == "/result":
                path = os.path.join(state.jobdir, "result.bin")
                if not os.path.exists(path):
                    self._send(404, {"error": "no result"})
                    return
                size = os.path.getsize(path)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        self.wfile.write(chunk)
            else:
                self._send(404, {"error": "unknown path"})

        def do_PUT(self) -> None:
            if not self._authorized():
                return
            if self.path != "/payload" or state.payload_ready.is_set():
                self._send(409, {"error": "the payload was already received"})
                return
            left = int(self.headers.get("Content-Length", "0"))
            tmp = os.path.join(state.jobdir, "payload.bin.part")
            with open(tmp, "wb") as f:
                while left > 0:
                    chunk = self.rfile.read(min(CHUNK, left))
                    if not chunk:
                        break
                    f.write(chunk)
                    left -= len(chunk)
            if left:
                self._send(400, {"error": "the payload was cut short"})
                return
            os.replace(tmp, os.path.join(state.jobdir, "payload.bin"))
            state.payload_ready.set()
            self._send(200, {"ok": True})

        def do_POST(self) -> None:
            if not self._authorized():
                return
            n = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(n) if n else b"{}"
            if self.path == "/metrics":
                ev = wire.loads(body)
                if ev.get("type") == "metrics":
                    state.log.add(ev)
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
