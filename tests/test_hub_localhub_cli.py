"""`tfdist-local-hub`, the command behind scripts/run-hub: it prints a generated password that logs in.

The hub is started exactly as the README's main command does (the console script of the installed wheel),
on 127.0.0.1 and a free port; the test reads the password from its output, logs in over HTTP and gets the
spawn form. Nothing else is configured, so this is what a user sees on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

from tests.hub_fixtures import free_port, hub_env

REPO = Path(__file__).resolve().parent.parent


def test_local_hub_prints_a_password_that_logs_in(tmp_path: Path) -> None:
    port = free_port()
    exe = Path(sys.executable).parent / "tfdist-local-hub"
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(exe),
                "--port",
                str(port),
                "--state-dir",
                str(tmp_path / "state"),
                "--examples",
                str(REPO / "examples"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=hub_env(),
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        password = None
        while time.monotonic() < deadline and proc.poll() is None:
            text = log.read_text(errors="replace")
            m = re.search(r"password\s+(\S+)", text)
            password = m.group(1) if m else None
            with contextlib.suppress(requests.RequestException):
                if password and requests.get(f"{url}/hub/api/", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        assert password, log.read_text(errors="replace")[-3000:]
        s = requests.Session()
        s.get(f"{url}/hub/login", timeout=30)
        bad = s.post(
            f"{url}/hub/login",
            data={"username": "ana", "password": "wrong-password", "_xsrf": s.cookies.get("_xsrf")},
            timeout=30,
        )
        assert "Invalid username or password" in bad.text
        r = s.post(
            f"{url}/hub/login",
            data={"username": "ana", "password": password, "_xsrf": s.cookies.get("_xsrf")},
            timeout=30,
        )
        assert r.status_code == 200 and r.url.endswith("/hub/spawn"), r.url
        assert 'id="tfdist-form"' in r.text and 'value="cpu"' in r.text
        # the generated config holds the passwords: private to the hub's user
        cfg = tmp_path / "state" / "jupyterhub_config.py"
        assert cfg.stat().st_mode & 0o077 == 0
    finally:
        family = []
        with contextlib.suppress(psutil.Error):
            family = psutil.Process(proc.pid).children(recursive=True)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
