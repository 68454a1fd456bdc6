"""A real JupyterHub process for tests: generated config, free ports, login, form and REST helpers.

Why: the spawn form and validation must be proven through JupyterHub's own handlers (xsrf, the spawn page,
the REST API's error path), not by calling our functions. Import with
``from tests.hub_fixtures import RunningHub, start_hub``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

DOUBLES = Path(__file__).parent / "doubles"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningHub:
    url: str
    token: str
    password: str
    proc: subprocess.Popen[bytes]
    state_dir: Path
    log_path: Path
    sessions: dict[str, requests.Session] = field(default_factory=dict)

    # ---- REST -------------------------------------------------------------------------------------

    def api(self, method: str, path: str, **kw: Any) -> requests.Response:
        headers = {"Authorization": f"token {self.token}", **kw.pop("headers", {})}
        return requests.request(method, f"{self.url}/hub/api{path}", headers=headers, timeout=30, **kw)

    def user_model(self, name: str) -> dict[str, Any]:
        r = self.api("GET", f"/users/{name}")
        r.raise_for_status()
        return r.json()

    def servers(self, name: str) -> dict[str, Any]:
        return self.user_model(name).get("servers") or {}

    def wait_ready(self, name: str, server: str = "", timeout: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.servers(name).get(server)
            if s and s.get("ready"):
                return s
            if s is None and time.monotonic() > deadline - timeout + 5:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server {name}/{server} not ready in {timeout}s; log tail:\n{self.log_tail()}")

    def stop_server(self, name: str, server: str = "", timeout: float = 60) -> None:
        path = f"/users/{name}/servers/{server}" if server else f"/users/{name}/server"
        r = self.api("DELETE", path)
        assert r.status_code in (202, 204), r.text
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server not in self.servers(name):
                return
            time.sleep(0.3)
        raise AssertionError(f"server {name}/{server} did not stop")

    def server_pid(self, name: str, server: str = "") -> int:
        s = self.servers(name)[server]
        return int(s["state"]["pid"])

    # ---- browser-like session -----------------------------------------------------------------------

    def login(self, username: str) -> requests.Session:
        s = requests.Session()
        r = s.get(f"{self.url}/hub/login", timeout=30)
        r.raise_for_status()
        r = s.post(
            f"{self.url}/hub/login",
            data={"username": username, "password": self.password, "_xsrf": s.cookies.get("_xsrf")},
            timeout=30,
            allow_redirects=False,
        )
        assert r.status_code == 302, (r.status_code, r.text[:500])
        self.sessions[username] = s
        return s

    def session(self, username: str) -> requests.Session:
        return self.sessions.get(username) or self.login(username)

    def spawn_form(self, username: str, server: str = "") -> requests.Response:
        s = self.session(username)
        path = f"/hub/spawn/{username}/{server}" if server else f"/hub/spawn/{username}"
        return s.get(f"{self.url}{path}", timeout=30)

    def post_form(
        self, username: str, fields: Mapping[str, str | Sequence[str]], server: str = ""
    ) -> requests.Response:
        s = self.session(username)
        path = f"/hub/spawn/{username}/{server}" if server else f"/hub/spawn/{username}"
        data = [(k, v) for k, vs in fields.items() for v in ([vs] if isinstance(vs, str) else vs)]
        return s.post(
            f"{self.url}{path}",
            data=data,
            headers={"X-XSRFToken": s.cookies.get("_xsrf") or ""},
            timeout=60,
            allow_redirects=False,
        )

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    # ---- teardown -----------------------------------------------------------------------------------

    def stop(self) -> None:
        stop_hub_process(self.proc)
        for s in self.sessions.values():
            s.close()


def stop_hub_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the hub stops its servers and proxy), then SIGKILL whatever of it is left, by PID."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for p in family:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()


def write_config(
    state_dir: Path,
    *,
    port: int,
    password: str,
    token: str,
    profiles: Path,
    fake_gpus: Sequence[str] | None,
    groups: Mapping[str, Sequence[str]],
    examples: Path | None = None,
    extra: str = "",
) -> Path:
    cfg = state_dir / "jupyterhub_config.py"
    settings = {
        "state_dir": str(state_dir),
        "port": port,
        "profiles": str(profiles),
        "examples": str(examples) if examples else None,
        "user_password": password,
    }
    cfg.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(DOUBLES)!r})
            from tfdist.spawner.localhub import configure
            configure(c, **{settings!r})
            c.JupyterHub.load_groups = {{k: {{"users": list(v)}} for k, v in {dict(groups)!r}.items()}}
            c.JupyterHub.services = [{{"name": "tester", "api_token": {token!r}}}]
            c.JupyterHub.load_roles = [{{
                "name": "tester",
                "scopes": ["admin:users", "admin:servers", "admin:server_state", "read:users", "servers",
                           "access:servers", "admin:groups"],
                "services": ["tester"],
            }}]
            # bad input is a handled 4xx: it must never count towards this limit (which stops the hub)
            c.JupyterHub.consecutive_failure_limit = 3
            c.JupyterHub.log_level = "INFO"
            c.Spawner.start_timeout = 90
            """
        )
        + (
            f"from fake_nvml import FakeNvmlInventory\n"
            f"c.TfdistLocalSpawner.gpu_inventory = FakeNvmlInventory({list(fake_gpus)!r})\n"
            if fake_gpus is not None
            else ""
        )
        + textwrap.dedent(extra)
    )
    return cfg


def hub_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("JUPYTERHUB_API_TOKEN", None)
    return env


def start_hub(
    tmp: Path,
    *,
    profiles_yaml: str,
    fake_gpus: Sequence[str] | None = None,
    groups: Mapping[str, Sequence[str]] | None = None,
    examples: Path | None = None,
    extra: str = "",
    timeout: float = 60,
) -> RunningHub:
    tmp.mkdir(parents=True, exist_ok=True)
    profiles = tmp / "profiles.yaml"
    profiles.write_text(textwrap.dedent(profiles_yaml))
    port = free_port()
    password = secrets.token_urlsafe(12)
    token = secrets.token_hex(24)
    cfg = write_config(
        tmp,
        port=port,
        password=password,
        token=token,
        profiles=profiles,
        fake_gpus=fake_gpus,
        groups=groups or {},
        examples=examples,
        extra=extra,
    )
    log_path = tmp / "hub.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterhub", "-f", str(cfg)],
        cwd=tmp,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=hub_env(),
    )
    log.close()
    hub = RunningHub(
        url=f"http://127.0.0.1:{port}",
        token=token,
        password=password,
        proc=proc,
        state_dir=tmp,
        log_path=log_path,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"hub exited with {proc.returncode}:\n{hub.log_tail()}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{hub.url}/hub/api/", timeout=2).status_code == 200:
                return hub
        time.sleep(0.25)
    hub.stop()
    raise AssertionError(f"hub did not answer in {timeout}s:\n{hub.log_tail()}")


@contextlib.contextmanager
def running_hub(tmp: Path, **kw: Any) -> Iterator[RunningHub]:
    hub = start_hub(tmp, **kw)
    try:
        yield hub
    finally:
        hub.stop()


def error_text(resp: requests.Response) -> str:
    """The user-facing message of a failed form POST (HTML) or REST call (JSON)."""
    if resp.headers.get("Content-Type", "").startswith("application/json"):
        return str(json.loads(resp.text).get("message", ""))
    import html
    import re

    m = re.search(r'class="spawn-error-msg[^"]*">(.*?)</p>', resp.text, re.S)
    return html.unescape(m.group(1)).strip() if m else ""


@dataclass
class LocalHubCommand:
    """`tfdist-local-hub` started as scripts/run-hub starts it (the installed console script), nothing else
    configured: what a user of the README's main command gets."""

    url: str
    password: str
    proc: subprocess.Popen[bytes]
    state_dir: Path
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_hub_process(self.proc)


def start_local_hub_command(
    tmp: Path, *extra: str, timeout: float = 90, ignore_sigint: bool = False
) -> LocalHubCommand:
    """`tfdist-local-hub` as a user runs it; ignore_sigint: as `cmd &` from a script starts it (a shell
    without job control starts background commands with SIGINT ignored, and children inherit that)."""
    import re

    port = free_port()
    exe = Path(sys.executable).parent / "tfdist-local-hub"
    log_path = tmp / "out.log"
    state = tmp / "state"
    args = [str(exe), "--port", str(port), "--state-dir", str(state)]
    args += ["--examples", str(REPO / "examples"), "--notebook", "digits.ipynb", *extra]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=hub_env(),
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None,
        )
    hub = LocalHubCommand(f"http://127.0.0.1:{port}", "", proc, state, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"password\s+(\S+)", hub.output())
        hub.password = m.group(1) if m else ""
        with contextlib.suppress(requests.RequestException):
            if hub.password and requests.get(f"{hub.url}/hub/api/", timeout=2).status_code == 200:
                return hub
        time.sleep(0.3)
    hub.stop()
    raise AssertionError(f"tfdist-local-hub did not come up:\n{hub.output()[-3000:]}")
