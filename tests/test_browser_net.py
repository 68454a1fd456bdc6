"""The browser tests' Chromium (tests/browser_net.py) keeps its requests when the host's network changes, as
it does all the time beside the real node (a veth per pod, an address per Service); plain Chromium aborts
them with net::ERR_NETWORK_CHANGED (CI on 6022d26 lost a kernel's websocket to it)."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.browser_net import CHROMIUM, quiet_chromium

pytestmark = [pytest.mark.browser]
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SLOW_S = 2.0
FETCHES = 16  # more than Chromium's 6 connections per host: the rest wait for one, as a page's do
PAGE = f"""<html><body><p id=done></p><script>
Promise.allSettled([...Array({FETCHES}).keys()].map(i => fetch('/slow?' + i).then(r => r.text())))
  .then(rs => {{ document.getElementById('done').textContent =
    rs.map(r => r.status === 'fulfilled' ? 'ok' : 'failed: ' + r.reason).join('; '); }});
</script></body></html>""".encode()


class _Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/slow"):
            time.sleep(SLOW_S)  # the host's network changes meanwhile
            body = b"x"
        else:
            body = PAGE
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def slow_server() -> Iterator[int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def _churn(stop: threading.Event) -> None:
    """What the real node's network plugin does to the host for each pod: a veth pair comes, gets an
    address, goes."""
    ip = shutil.which("ip") or "/usr/sbin/ip"
    name = f"tfq{uuid.uuid4().hex[:8]}"
    time.sleep(0.5)
    while not stop.is_set():
        pair = [ip, "link", "add", name, "type", "veth", "peer", "name", f"{name}p"]
        subprocess.run(pair, capture_output=True)
        subprocess.run([ip, "addr", "add", "10.254.254.1/30", "dev", name], capture_output=True)
        subprocess.run([ip, "link", "set", name, "up"], capture_output=True)
        time.sleep(0.3)
        subprocess.run([ip, "link", "del", name], capture_output=True)
        time.sleep(0.3)


def _load(executable: str, port: int) -> list[str]:
    """What each of the page's fetches got in Chromium at ``executable`` while the host's network churns."""
    from playwright.sync_api import sync_playwright

    stop = threading.Event()
    churn = threading.Thread(target=_churn, args=(stop,), daemon=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=ARGS)
        try:
            page = browser.new_page()
            churn.start()
            try:
                page.goto(f"http://127.0.0.1:{port}/", timeout=30_000)
                page.wait_for_function("document.getElementById('done').textContent", timeout=60_000)
                return page.locator("#done").inner_text().split("; ")
            finally:
                stop.set()
                churn.join()
        finally:
            browser.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces, and the churn it resists")
def test_the_browser_tests_chromium_keeps_its_requests_while_the_host_network_changes(slow_server):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test does this)")
    plain = _load(CHROMIUM, slow_server)  # what the tests met before: "Failed to fetch" in JupyterLab
    assert len(plain) == FETCHES and any("Failed to fetch" in r for r in plain), plain
    with quiet_chromium(f"http://127.0.0.1:{slow_server}/") as chromium:
        assert _load(chromium, slow_server) == ["ok"] * FETCHES
