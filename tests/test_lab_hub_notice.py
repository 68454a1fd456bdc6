"""The GPU-idle culler's warning as the user sees it: a JupyterLab notification in Debian's chromium.

A real `jupyter lab` server with the installed extension; the test posts the notice the way the hub's
GPU admin service does (POST tfdist/api/notice with a token) and the lab shows it, as text, with the time
left; withdrawing it (DELETE) closes the notification. Screenshot: artifacts/lab-hub-notice.png.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.browser_net import quiet_chromium
from tests.test_lab_browser import ARTIFACTS, CHROMIUM_ARGS, Lab, start_lab

pytestmark = pytest.mark.browser

HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """One lab server for the module (a refused notice changes nothing, so the tests share it)."""
    server = start_lab(tmp_path_factory.mktemp("lab"))
    try:
        yield server
    finally:
        server.stop()


def test_hub_notice_shows_as_a_lab_notification_and_goes_away(lab: Lab) -> None:
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    bad = lab.api("tfdist/api/notice", "GET")
    assert bad == {"notice": None}
    msg = f"Your server's GPUs have been idle. The hub will stop this server soon. {HOSTILE}"
    lab.api("tfdist/api/notice", "POST", {"message": msg, "cull_at": time.time() + 600})
    with sync_playwright() as pw, quiet_chromium(lab.url) as chromium:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            alerts: list[str] = []
            page.on("dialog", lambda d: (alerts.append(d.message), d.dismiss()))
            page.goto(f"{lab.url}/lab?token={lab.token}")
            toast = page.locator(".Toastify__toast", has_text="will stop this server")
            expect(toast).to_be_visible(timeout=60_000)
            expect(toast).to_contain_text(HOSTILE)  # the message is text, not markup
            expect(toast).to_contain_text("min left")
            assert toast.locator("img").count() == 0 and alerts == []
            page.screenshot(path=str(ARTIFACTS / "lab-hub-notice.png"))
            lab.api("tfdist/api/notice", "DELETE")
            expect(toast).to_have_count(0, timeout=30_000)
        finally:
            browser.close()


def test_bad_notices_are_refused(lab: Lab) -> None:
    import urllib.error

    for body, why in (
        ({}, "message must be"),
        ({"message": ""}, "message must be"),
        ({"message": "x" * 1001}, "message must be"),
        ({"message": "hi", "cull_at": "soon"}, "cull_at must be"),
        ({"message": "hi", "cull_at": True}, "cull_at must be"),
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            lab.api("tfdist/api/notice", "POST", body)
        assert e.value.code == 400 and why in e.value.read().decode(), body
    for q in (
        "busy_percent=-1",
        "busy_percent=101",
        "busy_percent=abc",
        "history=-5",
        "history=99999999",
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            lab.api(f"tfdist/api/activity?{q}")
        assert e.value.code == 400, q
    # no GPU on this machine: nothing tracked, no idle time, no jobs
    rep = lab.api("tfdist/api/activity?busy_percent=5&history=60")
    assert isinstance(rep, dict) and rep["gpus"] == [] and rep["idle_s"] is None and rep["jobs_running"] == []
