"""The jobs panel in a real browser: a real JupyterLab server, a real `%%tfdist run` job, Debian's chromium.

The test starts `jupyter lab` as its own process (the installed extension, found as any user's would be),
creates a notebook session through the server's REST API and runs the job cell in that session's kernel
(over the kernel's connection file). Chromium, driven by playwright (no browser download: /usr/bin/chromium),
opens JupyterLab, the "Distributed jobs" panel, the running job, clicks Stop, confirms, and sees the job
end; then every process of the job must be gone. A job whose directory name and messages hold
`<img src=x onerror=...>` (names the magic refuses, so it is written to disk as the local backend writes
jobs) must show as text. Screenshots go to artifacts/.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.browser_net import quiet_chromium
from tests.kernels import RUN_MARK, job_processes, kernel_env
from tfdist.jobspec import JobSpec

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
USER = "labtester"
JOB = "lab-job"
HOSTILE = "<img src=x onerror=alert(1)>"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The kernel needs TensorFlow imported (the magic checks it); the job itself only sleeps, so it starts fast
# and would end on its own after a minute, long enough to be seen running and stopped from the panel.
SETUP = 'import os\nos.environ["TF_USE_LEGACY_KERAS"] = "1"\nimport tensorflow as tf\n%load_ext tfdist\n'
JOB_CELL = (
    f"%%tfdist run --name {JOB} --workers 1 --ps 1\nimport time\nfor _ in range(600):\n    time.sleep(0.1)\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    state_dir: Path
    runtime_dir: Path
    proc: subprocess.Popen
    pids: set[int] = field(default_factory=set)  # every process the server started (kernels), to end

    def api(self, path: str, method: str = "GET", body: dict | None = None) -> dict | list | None:
        req = urllib.request.Request(
            f"{self.url}/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
        return json.loads(data) if data else None

    def remember_children(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.pids |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}

    def stop(self) -> None:
        self.remember_children()
        with contextlib.suppress(Exception):
            for s in self.api("api/sessions") or []:  # type: ignore[union-attr]
                self.api(f"api/sessions/{s['id']}", method="DELETE")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the server's own shutdown (kernels included)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.pids:  # whatever the shutdown missed, by PID
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def start_lab(tmp: Path, **extra_env: str) -> Lab:
    """A real `jupyter lab` process with the installed extension, its state and config all under `tmp`."""
    root, state, runtime, settings = (tmp / "root", tmp / "state", tmp / "runtime", tmp / "settings")
    for d in (root, runtime, settings):
        d.mkdir(parents=True, exist_ok=True)
    state.mkdir(mode=0o700, exist_ok=True)
    # no news/update toasts over the panel
    notif = settings / "@jupyterlab" / "apputils-extension"
    notif.mkdir(parents=True, exist_ok=True)
    (notif / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    port, token = free_port(), secrets.token_hex(16)
    env = kernel_env(
        str(state),
        TFDIST_USER=USER,
        TFDIST_BACKEND="local",
        JUPYTER_RUNTIME_DIR=str(runtime),
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
        **extra_env,
    )
    assert env["TFDIST_TEST_RUN"] == RUN_MARK
    log = open(tmp / "jupyter.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}",
            "--allow-root",
        ],
        env=env,
        cwd=str(root),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    lab = Lab(f"http://127.0.0.1:{port}", token, root, state, runtime, proc)
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"jupyter lab exited ({proc.returncode}):\n{(tmp / 'jupyter.log').read_text()}"
            )
        try:
            lab.api("api/status")
            return lab
        except OSError:
            if time.time() > deadline:
                lab.stop()
                raise RuntimeError(
                    f"jupyter lab did not answer:\n{(tmp / 'jupyter.log').read_text()}"
                ) from None
            time.sleep(0.3)


class NotebookKernel:
    """A notebook session made through the server's REST API, driven over its kernel's connection file."""

    def __init__(self, lab: Lab, path: str):
        from jupyter_client.blocking import BlockingKernelClient

        nb = {
            "cells": [
                {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
                for src in (SETUP, JOB_CELL)
            ],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        (lab.root / path).write_text(json.dumps(nb))
        session = lab.api(
            "api/sessions",
            "POST",
            {"path": path, "name": path, "type": "notebook", "kernel": {"name": "python3"}},
        )
        assert isinstance(session, dict)
        self.kernel_id = session["kernel"]["id"]
        lab.remember_children()
        self.kc = BlockingKernelClient(connection_file=str(lab.runtime_dir / f"kernel-{self.kernel_id}.json"))
        self.kc.load_connection_file()
        self.kc.start_channels()
        # a kernel late with a heartbeat on a loaded 2-core machine is busy, not dead (the default is 1 s)
        self.kc.hb_channel.time_to_dead = 30.0
        self.kc.wait_for_ready(timeout=120)

    def execute(self, code: str) -> str:
        return self.kc.execute(code)

    def outcome(self, msg_id: str, timeout: float) -> tuple[str, dict | None]:
        """The cell's text output and its error (if any), once it has ended."""
        text, error, deadline = [], None, time.time() + timeout
        while time.time() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.time()))
            except Exception:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            t, c = msg["msg_type"], msg["content"]
            if t == "status" and c["execution_state"] == "idle":
                return "".join(text), error
            if t == "stream":
                text.append(c["text"])
            elif t == "error":
                error = c
        raise TimeoutError(f"cell did not finish in {timeout}s: {''.join(text)[-2000:]}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kc.stop_channels()


def hostile_job(state_dir: Path) -> None:
    """A finished job for USER, as LocalBackend leaves one, whose name, message and log hold HTML."""
    d = state_dir / HOSTILE  # no '/' in it: a valid directory name, and what the backend names the view by
    (d / "logs").mkdir(parents=True)
    spec = json.loads(JobSpec(name="hostile", user=USER, workers=1, ps=1).to_json())
    spec["name"] = HOSTILE
    (d / "spec.json").write_text(json.dumps(spec))
    (d / "state.json").write_text(
        json.dumps(
            {
                "state": "failed",
                "message": f"crashed: {HOSTILE}",
                "created": time.time() - 3600,
                "ended": time.time() - 3500,
                "tasks_total": 2,
            }
        )
    )
    (d / "logs" / "worker-0.log").write_text(f"hello\n{HOSTILE}\n<script>window.__xss = 1</script>\n")


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test does this)")
    lab = start_lab(tmp_path)
    try:
        yield lab
    finally:
        lab.stop()


def wait_for(pred, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError(what)


def test_panel_shows_stops_and_escapes_jobs_in_chromium(lab: Lab) -> None:
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    hostile_job(lab.state_dir)
    nbk = NotebookKernel(lab, "job.ipynb")
    try:
        assert nbk.outcome(nbk.execute(SETUP), 120)[1] is None
        run_id = nbk.execute(JOB_CELL)  # runs until the job ends: the panel's Stop ends it

        with sync_playwright() as pw, quiet_chromium(lab.url) as chromium:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                alerts: list[str] = []
                page.on("dialog", lambda d: (alerts.append(d.message), d.dismiss()))
                page.goto(f"{lab.url}/lab/tree/job.ipynb?token={lab.token}")
                tab = page.locator('.jp-SideBar .lm-TabBar-tab[data-id="tfdist-jobs"]')
                tab.wait_for(timeout=60_000)
                if not page.locator("#tfdist-jobs").is_visible():
                    tab.click()
                panel = page.locator("#tfdist-jobs")
                expect(panel).to_be_visible()

                # the hostile job: its name, message and logs are text, no element made from them
                hostile = panel.locator(".tfdist-job", has_text="onerror")
                expect(hostile.locator(".tfdist-job-name")).to_have_text(HOSTILE, timeout=20_000)
                # the tooltip holds the full name and how the job ended, as plain text
                assert hostile.get_attribute("title") == f"{HOSTILE}\nfailed: crashed: {HOSTILE}"
                hostile.click()
                expect(panel.locator(".tfdist-detail-name")).to_have_text(HOSTILE)
                expect(panel.locator(".tfdist-message")).to_have_text(f"crashed: {HOSTILE}")
                expect(panel.locator(".tfdist-logs")).to_contain_text(f"[worker-0] {HOSTILE}", timeout=10_000)
                expect(panel.locator(".tfdist-stop")).to_be_disabled()  # a finished job cannot be stopped
                assert panel.locator("img, script").count() == 0
                page.screenshot(path=str(ARTIFACTS / "lab-hostile-name.png"))
                panel.locator(".tfdist-back").click()

                # the notebook's job: running in the list, opened, stopped with confirmation
                row = panel.locator(".tfdist-job", has=page.locator(".tfdist-job-name", has_text=JOB))
                expect(row).to_have_attribute("data-state", "running", timeout=90_000)
                row.click()
                expect(panel.locator(".tfdist-detail-name")).to_have_text(JOB)
                expect(panel.locator(".tfdist-detail-head .tfdist-state")).to_have_text("running")
                expect(panel.locator(".tfdist-task-name").first).to_be_visible(timeout=10_000)
                page.screenshot(path=str(ARTIFACTS / "lab-job-running.png"))
                pids = [p.pid for p in job_processes()]
                assert len(pids) >= 3, "supervisor, coordinator, worker and ps should be running"

                panel.locator(".tfdist-stop").click()
                dialog = page.locator(".jp-Dialog")
                expect(dialog).to_contain_text(f'Stop job "{JOB}"')
                page.screenshot(path=str(ARTIFACTS / "lab-stop-confirm.png"))
                dialog.locator("button.jp-mod-warn", has_text="Stop").click()
                expect(panel.locator(".tfdist-detail-head .tfdist-state")).to_have_text(
                    "stopped", timeout=30_000
                )
                expect(panel.locator(".tfdist-stop")).to_be_disabled()
                page.screenshot(path=str(ARTIFACTS / "lab-job-stopped.png"))

                # the status-bar item shows this server's GPUs, or its CPU when it has none
                expect(page.locator(".tfdist-status")).to_contain_text(r"%", timeout=10_000)
                assert page.evaluate("window.__xss === undefined") and alerts == [], alerts
            finally:
                browser.close()

        assert wait_for(lambda: not job_processes(), 15, "job processes still alive after Stop") is True
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        _, error = nbk.outcome(run_id, 30)  # the notebook's cell ended with the job, saying why
        assert error and f"job {JOB} stopped" in error["evalue"], error
        listed = lab.api("tfdist/api/jobs")
        assert isinstance(listed, dict)
        assert {j["name"]: j["state"] for j in listed["jobs"]} == {JOB: "stopped", HOSTILE: "failed"}
    finally:
        nbk.close()

    shot = (ARTIFACTS / "lab-job-stopped.png").read_bytes()
    assert shot[:8] == PNG_MAGIC and len(shot) > 10_000
