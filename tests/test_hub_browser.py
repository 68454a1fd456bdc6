"""The spawn form in a real browser: Debian's chromium driven by playwright, against a real hub.

It logs in, reads the free-GPU display, picks the GPU profile, fills CPU/memory/GPUs, starts the server,
and saves screenshots to artifacts/ (the form, and the running JupyterLab). No browser is downloaded:
playwright drives /usr/bin/chromium.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser_net import quiet_chromium
from tests.hub_fixtures import RunningHub, start_hub

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
PROFILES = """
gpu_models:
  h100:
    display_name: "NVIDIA H100 80GB"
    nvml_name: "NVIDIA H100.*"
profiles:
  - slug: cpu
    display_name: "CPU only"
    description: "For editing and small runs"
    groups: ["*"]
    cpu: {min: 0.5, max: 4, default: 1}
    memory_gib: {min: 0.5, max: 8, default: 1}
    images: [local]
  - slug: gpu
    display_name: "GPU training"
    description: "GPUs handed out exclusively"
    groups: ["*"]
    cpu: {min: 1, max: 8, default: 2}
    memory_gib: {min: 1, max: 64, default: 4}
    gpus: {min: 0, max: 4, default: 1}
    gpu_models: [h100]
    max_gpus_per_user: 4
    images: [local]
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test does this)")
    h = start_hub(
        tmp_path_factory.mktemp("browserhub"),
        profiles_yaml=PROFILES,
        fake_gpus=["NVIDIA H100 80GB HBM3"] * 3,
        examples=Path(__file__).resolve().parent.parent / "examples",
    )
    try:
        yield h
    finally:
        h.stop()


def test_form_in_chromium(hub: RunningHub) -> None:
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw, quiet_chromium(hub.url) as chromium:
        browser = pw.chromium.launch(
            executable_path=chromium,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1000})
            page.goto(f"{hub.url}/hub/login")
            page.fill("#username_input", "frank")
            page.fill("#password_input", hub.password)
            page.click("#login_submit")
            page.wait_for_url("**/hub/spawn**")

            free = page.locator("#tfdist-free-gpus")
            expect(free).to_contain_text("NVIDIA H100 80GB: 3 of 3 free")
            page.check('input[name="profile"][value="gpu"]')
            fields = page.locator("#tfdist-fields-gpu")
            expect(fields.locator('input[name="cpu"]')).to_be_enabled()
            expect(page.locator("#tfdist-cpu-cpu")).to_be_disabled()  # the other profile's fields are off
            fields.locator('input[name="cpu"]').fill("2")
            fields.locator('input[name="memory"]').fill("3")
            fields.locator('input[name="gpus"]').fill("2")
            expect(fields.locator(".tfdist-gpu-hint")).to_contain_text("0 to 3")  # 3 free bounds the input
            page.screenshot(path=str(ARTIFACTS / "spawn-form.png"), full_page=True)

            page.click('form#spawn_form input[type="submit"], form#spawn_form button[type="submit"]')
            page.wait_for_url("**/user/frank/**", timeout=120_000)
            # the server opens the example notebook (default_url), copied into the user's folder
            assert "examples/digits.ipynb" in page.url
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="visible", timeout=120_000)
            expect(page.get_by_role("tab", name="digits.ipynb")).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "server-started.png"))
        finally:
            browser.close()

    server = hub.servers("frank")[""]
    assert server["ready"] and server["user_options"]["gpus"] == 2
    # the form of the next user shows the two GPUs as taken
    other = hub.spawn_form("grace").text
    assert "NVIDIA H100 80GB: 1 of 3 free" in other
    shot = (ARTIFACTS / "spawn-form.png").read_bytes()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000
    hub.stop_server("frank")
