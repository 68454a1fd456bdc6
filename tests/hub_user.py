"""A hub user, driven over HTTP as a browser and JupyterLab would: log in, submit the spawn form with the
values it shows, open a notebook's kernel through the hub's proxy and run its cells over the kernel
websocket (Jupyter's messaging protocol). Used to test the main job the way users run it.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

import psutil
import requests
import websocket

from tests.kernels import idle_pool_of_live_kernel


class _FormDefaults(HTMLParser):
    """What a browser submits from the spawn form untouched: the checked profile's enabled fields."""

    def __init__(self) -> None:
        super().__init__()
        self.profile: str | None = None
        self.fieldsets: dict[str, list[tuple[str, str]]] = {}
        self._fs: str | None = None
        self._select: str | None = None
        self._options: list[tuple[str, bool, bool]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "input" and a.get("name") == "profile" and "checked" in a:
            self.profile = a["value"]
        elif tag == "fieldset" and a.get("id", "").startswith("tfdist-fields-"):
            self._fs = a["id"].removeprefix("tfdist-fields-")
            self.fieldsets[self._fs] = []
        elif self._fs and tag == "input" and a.get("name") and a.get("type") not in ("radio", "checkbox"):
            if "disabled" not in a:
                self.fieldsets[self._fs].append((a["name"], a.get("value", "")))
        elif self._fs and tag == "select" and "disabled" not in a:
            self._select, self._options = a.get("name"), []
        elif self._select and tag == "option":
            self._options.append((a.get("value", ""), "selected" in a, "disabled" in a))

    def handle_endtag(self, tag: str) -> None:
        if tag == "fieldset":
            self._fs = None
        elif tag == "select" and self._select and self._fs:
            usable = [o for o in self._options if not o[2]]
            chosen = next((o for o in usable if o[1]), usable[0] if usable else None)
            if chosen:
                self.fieldsets[self._fs].append((self._select, chosen[0]))
            self._select = None


def form_defaults(page: str) -> list[tuple[str, str]]:
    p = _FormDefaults()
    p.feed(page)
    assert p.profile, "no profile is checked in the form"
    return [("profile", p.profile), *p.fieldsets.get(p.profile, [])]


@dataclass
class CellResult:
    stdout: str = ""
    stderr: str = ""
    error: dict[str, Any] | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)


@dataclass
class HubUser:
    url: str  # http://127.0.0.1:PORT
    name: str
    password: str
    session: requests.Session = field(default_factory=requests.Session)
    token: str = ""

    def login(self) -> None:
        self.session.get(f"{self.url}/hub/login", timeout=30)
        r = self.session.post(
            f"{self.url}/hub/login",
            data={
                "username": self.name,
                "password": self.password,
                "_xsrf": self.session.cookies.get("_xsrf"),
            },
            timeout=30,
            allow_redirects=False,
        )
        assert r.status_code == 302, (r.status_code, r.text[:300])

    def post_spawn(self, fields: list[tuple[str, str]], server: str = "") -> requests.Response:
        """The spawn form POSTed as the browser does (XSRF header, no redirect followed)."""
        path = f"/hub/spawn/{self.name}/{server}" if server else f"/hub/spawn/{self.name}"
        return self.session.post(
            f"{self.url}{path}",
            data=fields,
            headers={"X-XSRFToken": self.session.cookies.get("_xsrf") or ""},
            timeout=120,
            allow_redirects=False,
        )

    def spawn_with(self, fields: list[tuple[str, str]], server: str = "") -> None:
        r = self.post_spawn(fields, server)
        assert r.status_code in (200, 302), (r.status_code, r.text[-500:])
        err = re.search(r'class="spawn-error-msg[^"]*">(.*?)</p>', r.text, re.S)
        assert not err, err.group(1) if err else ""

    def form(self, server: str = "") -> str:
        path = f"/hub/spawn/{self.name}/{server}" if server else f"/hub/spawn/{self.name}"
        r = self.session.get(f"{self.url}{path}", timeout=30)
        r.raise_for_status()
        return r.text

    def api_token(self) -> str:
        if not self.token:
            r = self.session.post(
                f"{self.url}/hub/api/users/{self.name}/tokens",
                json={"note": "test", "expires_in": 3600},
                headers={"X-XSRFToken": self.session.cookies.get("_xsrf") or ""},
                timeout=30,
            )
            assert r.status_code in (200, 201), r.text
            self.token = r.json()["token"]
        return self.token

    def server_api(self, method: str, path: str, server: str = "", **kw: Any) -> requests.Response:
        base = f"{self.url}/user/{self.name}/{server + '/' if server else ''}api"
        headers = {"Authorization": f"token {self.api_token()}"}
        return requests.request(method, base + path, headers=headers, timeout=60, **kw)

    def wait_server(self, server: str = "", timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException):
                r = self.server_api("GET", "/status", server)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            time.sleep(0.5)
        raise AssertionError(f"server of {self.name} did not answer in {timeout}s: {last}")

    def notebook(self, path: str, server: str = "") -> dict[str, Any]:
        r = self.server_api("GET", f"/contents/{path}", server)
        r.raise_for_status()
        return r.json()["content"]

    def open_kernel(self, path: str, server: str = "") -> Kernel:
        r = self.server_api(
            "POST",
            "/sessions",
            server,
            json={"path": path, "type": "notebook", "name": "", "kernel": {"name": "python3"}},
        )
        assert r.status_code == 201, r.text
        kid = r.json()["kernel"]["id"]
        ws_url = self.url.replace("http", "ws", 1)
        base = f"{ws_url}/user/{self.name}/{server + '/' if server else ''}api/kernels/{kid}/channels"
        conn = websocket.create_connection(
            base, header=[f"Authorization: token {self.api_token()}"], timeout=30
        )
        return Kernel(kid, conn)


@dataclass
class Kernel:
    """One kernel over its websocket channels (the JSON protocol JupyterLab speaks)."""

    id: str
    ws: websocket.WebSocket
    session: str = field(default_factory=lambda: uuid.uuid4().hex)

    def execute(self, code: str, timeout: float = 600) -> CellResult:
        msg_id = uuid.uuid4().hex
        self.ws.send(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "username": "test",
                        "session": self.session,
                        "msg_type": "execute_request",
                        "version": "5.3",
                        "date": "",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": {"code": code, "silent": False, "store_history": True, "allow_stdin": False},
                    "channel": "shell",
                    "buffers": [],
                }
            )
        )
        res = CellResult()
        deadline = time.monotonic() + timeout
        replied = idle = False
        while not (replied and idle):
            if time.monotonic() > deadline:
                raise AssertionError(f"cell did not finish in {timeout}s; stdout:\n{res.stdout[-2000:]}")
            try:
                raw = self.ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            if not isinstance(raw, str):
                continue  # binary frames: widget buffers
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status":
                res.statuses.append(content["execution_state"])
                idle = content["execution_state"] == "idle"
            elif kind == "stream":
                if content["name"] == "stdout":
                    res.stdout += content["text"]
                else:
                    res.stderr += content["text"]
            elif kind == "error":
                res.error = content
            elif kind in ("display_data", "execute_result", "update_display_data"):
                res.outputs.append(content)
            elif kind == "execute_reply":
                replied = True
        return res

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()


def server_process(user: str) -> psutil.Process:
    """The user's single-user server process (what the hub's memory watchdog measures)."""
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.info["cmdline"] or [])
            if "jupyterhub.singleuser" in cmd and p.environ().get("JUPYTERHUB_USER") == user:
                return p
    raise AssertionError(f"no server process of {user}")


class MemoryPeak:
    """Samples the server's process tree (what the hub's watchdog adds up) every 0.2 s."""

    def __init__(self, proc: psutil.Process):
        self.proc, self.peak, self._stop = proc, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.proc))
            time.sleep(0.2)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def tree_rss(p: psutil.Process) -> int:
    total = 0
    with contextlib.suppress(psutil.Error):
        for q in [p, *p.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += q.memory_info().rss
    return total


def job_processes(user: str) -> list[psutil.Process]:
    """Processes of %%tfdist jobs started by this hub user's kernels (supervisor, tasks, pooled processes
    that became tasks); not the idle warm pool of a living kernel, which is the kernel's
    (tests.kernels.idle_pool_of_live_kernel): once the kernel is gone its pool counts as left behind."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.info["cmdline"] or [])
            if (
                "tfdist.runtime." in cmd
                and not idle_pool_of_live_kernel(p)
                and p.environ().get("TFDIST_USER") == user
            ):
                out.append(p)
    return out
