"""`tfdist-local-hub`, the command behind scripts/run-hub: it prints a generated password that logs in.

The hub is started exactly as the README's main command does (the console script of the installed wheel),
on 127.0.0.1 and a free port; the test reads the password from its output, logs in over HTTP and gets the
spawn form. Nothing else is configured, so this is what a user sees on a machine without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import requests

from tests.hub_fixtures import start_local_hub_command


def test_local_hub_prints_a_password_that_logs_in(tmp_path: Path) -> None:
    hub = start_local_hub_command(tmp_path)
    try:
        url, password = hub.url, hub.password
        assert password, hub.output()[-3000:]
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
        hub.stop()
