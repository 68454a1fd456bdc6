"""GPU-idle culling end to end: a real hub, real notebook servers, the real GPU admin service.

The servers' NVML is the named double `tests/doubles/fake_pynvml` (first on their PYTHONPATH), driven by a
JSON file this test rewrites; everything above NVML is production code: the hub's allocator hands out the
fake GPUs, each server's activity tracker samples them, the service reads `/tfdist/api/activity` with its
own token, warns through `/tfdist/api/notice` and stops servers through the hub's REST API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.hub_fixtures import DOUBLES, RunningHub, start_hub

PROFILES = """
gpu_models:
  h100: {display_name: "NVIDIA H100 80GB", nvml_name: "NVIDIA H100.*"}
profiles:
  - slug: cpu
    display_name: "CPU only"
    groups: ["*"]
    cpu: {min: 0.5, max: 2, default: 0.5}
    memory_gib: {min: 0.5, max: 4, default: 1}
    images: [local]
  - slug: gpu
    display_name: "GPU"
    groups: ["*"]
    cpu: {min: 0.5, max: 2, default: 0.5}
    memory_gib: {min: 0.5, max: 4, default: 1}
    gpus: {min: 0, max: 2, default: 1}
    gpu_models: [h100]
    images: [local]
gpu_admin:
  culling:
    check_interval_s: 1
    default: {idle_below_percent: 10, idle_minutes: 0.25, warn_minutes: 0.1}
"""
NAMES = ["NVIDIA H100 80GB HBM3"] * 3
GPU = {"profile": "gpu", "cpu": 0.5, "memory": 1, "gpus": 1, "gpu_model": "h100", "image": "local"}
CPU = {"profile": "cpu", "cpu": 0.5, "memory": 1, "image": "local"}
JOBS: list[subprocess.Popen[bytes]] = []  # fake supervisors, ended with the module's hub
ADMIN_PASSWORD = "admin-" + os.urandom(20).hex()


def write_nvml(path: Path, utils: dict[str, int]) -> None:
    gpus = [
        {
            "name": n,
            "uuid": f"GPU-fake-{i:04d}",
            "memory_total_mib": 81559,
            "util": utils.get(f"GPU-fake-{i:04d}", 0),
            "mem_used_mib": 1000.0 + 100 * i,
        }
        for i, n in enumerate(NAMES)
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


def hub_extra(nvml: Path) -> str:
    return f"""
from tests.hub_fixtures import free_port as _fp
from tfdist.hubadmin.hubconfig import enable_gpu_admin
c.Spawner.environment = {{
    "PYTHONPATH": {str(DOUBLES / "fake_pynvml")!r},
    "TFDIST_FAKE_NVML": {str(nvml)!r},
    "TFDIST_GPU_ACTIVITY_INTERVAL": "0.5",
}}
enable_gpu_admin(c, profiles=c.TfdistLocalSpawner.profiles_file,
                 public_url=f"http://127.0.0.1:{{c.JupyterHub.port}}", port=_fp(), period_s=1,
                 local_gpus=True)
c.JupyterHub.services[-1]["environment"].update(c.Spawner.environment)  # the service counts free GPUs
c.JupyterHub.load_roles[0]["scopes"].append("access:services")
c.SharedPasswordAuthenticator.admin_password = {ADMIN_PASSWORD!r}
c.Authenticator.admin_users = {{"boss"}}
"""


@pytest.fixture(scope="module")
def nvml(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("nvml") / "nvml.json"
    write_nvml(p, {})
    return p


@pytest.fixture(scope="module")
def hub(tmp_path_factory, nvml) -> Any:
    sys_path_extra = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (sys_path_extra, os.environ.get("PYTHONPATH")) if p)
    h = start_hub(
        tmp_path_factory.mktemp("hub"), profiles_yaml=PROFILES, fake_gpus=NAMES, extra=hub_extra(nvml)
    )
    try:
        yield h
    finally:
        h.stop()
        for p in JOBS:
            p.kill()
            p.wait()


def spawn(hub: RunningHub, user: str, options: dict[str, Any]) -> None:
    hub.api("POST", f"/users/{user}")
    r = hub.api("POST", f"/users/{user}/server", json=options)
    assert r.status_code in (201, 202), r.text
    hub.wait_ready(user)


def server_get(hub: RunningHub, user: str, path: str) -> dict[str, Any]:
    r = requests.get(
        f"{hub.url}/user/{user}/tfdist/api/{path}",
        headers={"Authorization": f"token {hub.token}"},
        timeout=10,
    )
    r.raise_for_status()
    return r.json()


def metrics(hub: RunningHub) -> str:
    r = requests.get(
        f"{hub.url}/services/tfdist-gpu-admin/metrics",
        headers={"Authorization": f"token {hub.token}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r.text


def fake_running_job(hub: RunningHub, user: str) -> subprocess.Popen[bytes]:
    """A running job on the user's server: its supervisor is the named double FakeSupervisor."""
    from tfdist.spawner.local import safe_dirname

    d = hub.state_dir / "users" / safe_dirname(user) / ".tfdist" / "jobs" / "train1"
    d.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(DOUBLES / "fake_supervisor.py"), str(d), user], stdout=subprocess.PIPE
    )
    JOBS.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def test_idle_gpu_server_is_warned_then_culled_and_others_are_not(hub: RunningHub, nvml: Path) -> None:
    # GPUs go out lowest index first: trainer GPU 0, worker GPU 1 (busy from the start), idler GPU 2
    write_nvml(nvml, {"GPU-fake-0001": 80})
    spawn(hub, "trainer", GPU)
    fake_running_job(hub, "trainer")
    spawn(hub, "worker", GPU)
    spawn(hub, "cpuuser", CPU)
    spawn(hub, "idler", GPU)  # last: it is warned 9 s after the service first sees it
    assert server_get(hub, "worker", "activity")["gpus"][0]["uuid"] == "GPU-fake-0001"

    notice = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and notice is None:
        notice = server_get(hub, "idler", "notice")["notice"]
        time.sleep(0.5)
    assert notice is not None, hub.log_tail()
    assert "will stop this server" in notice["message"] and notice["cull_at"] > time.time() - 1
    assert "" in hub.servers("idler")

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "" in hub.servers("idler"):
        time.sleep(0.5)
    assert "" not in hub.servers("idler"), hub.log_tail()
    culled_at = time.time()
    assert culled_at >= notice["cull_at"] - 1.5  # the user got the whole warning time

    assert server_get(hub, "cpuuser", "activity")["gpus"] == []
    [job] = server_get(hub, "trainer", "activity")["jobs_running"]
    assert job["name"] == "train1" and job["gpu_util"] == [70.0], job
    # the others: still there, never warned, for longer than the idle limit
    for user in ("worker", "trainer", "cpuuser"):
        assert hub.servers(user)[""]["ready"], user
        assert server_get(hub, user, "notice")["notice"] is None, user
    deadline = time.monotonic() + 15  # the metrics may be up to 5 s old
    text = metrics(hub)
    while 'hub_user="idler"' in text and time.monotonic() < deadline:
        time.sleep(1)
        text = metrics(hub)
    assert "tfdist_culler_culls_total 1" in text
    assert 'tfdist_gpus_free{modelName="NVIDIA H100 80GB HBM3"} 1' in text  # 3 GPUs, 2 held
    assert 'DCGM_FI_DEV_GPU_UTIL{gpu="' in text and 'hub_user="worker"' in text
    assert 'modelName="NVIDIA H100 80GB HBM3"' in text
    assert 'hub_user="cpuuser"' not in text  # CPU-only servers are not this service's business


def test_admin_page_shows_servers_live_and_refuses_non_admins(hub: RunningHub, nvml: Path) -> None:
    """Runs after the culling test: worker (busy GPU), trainer (job) and cpuuser are still up."""
    from playwright.sync_api import expect, sync_playwright

    from tests.test_lab_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS

    page_url = f"{hub.url}/services/tfdist-gpu-admin/"
    # a user who is not a hub admin: refused, whether through the hub's OAuth or the page's own check
    s = hub.login("worker")
    r = s.get(page_url, timeout=30)
    assert r.status_code == 403, (r.status_code, r.text[:300])
    assert s.get(page_url + "api/servers", timeout=30).status_code == 403
    r = requests.get(page_url + "metrics", timeout=10, allow_redirects=False)  # no token at all
    assert r.status_code in (302, 403) and "DCGM" not in r.text

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 700})
            page.goto(f"{hub.url}/hub/login")
            page.fill("#username_input", "boss")
            page.fill("#password_input", ADMIN_PASSWORD)
            page.click("#login_submit")
            page.wait_for_url("**/hub/**")
            page.goto(page_url)
            rows = page.locator("#servers tbody tr")
            expect(rows).to_have_count(3, timeout=20_000)
            worker = page.locator('#servers tr[data-server="worker/"]')
            expect(worker.locator("td.gpus")).to_have_text("1 \u00d7 NVIDIA H100 80GB HBM3")
            expect(worker.locator("td.util")).to_have_text("80%", timeout=10_000)
            trainer_jobs = page.locator('#servers tr[data-server="trainer/"] td.jobs')
            expect(trainer_jobs).to_have_text("train1 (running, GPUs 70%)")
            expect(page.locator('#servers tr[data-server="cpuuser/"] td.gpus')).to_have_text("none (CPU)")
            totals = page.locator("#totals tbody tr")
            expect(totals).to_have_count(1)
            expect(totals.locator("td")).to_have_text(["NVIDIA H100 80GB HBM3", "2", "1", "1", "1"])
            # a change on the server shows without a reload (the page polls every 2 s, the server samples
            # every 0.5 s here: at most about 2.5 s on a quiet machine). Printed, not asserted: a timed
            # assertion here measured the CI machine's load and failed under it.
            write_nvml(nvml, {"GPU-fake-0001": 35, "GPU-fake-0000": 60})
            t0 = time.monotonic()
            expect(worker.locator("td.util")).to_have_text("35%", timeout=20_000)
            print(f"\nGPU change -> admin page: {time.monotonic() - t0:.2f}s")
            expect(totals.locator("td")).to_have_text(
                ["NVIDIA H100 80GB HBM3", "2", "2", "0", "1"], timeout=5_000
            )
            page.wait_for_timeout(2500)  # a few more sparkline points
            page.screenshot(path=str(ARTIFACTS / "hub-gpu-admin.png"), full_page=True)
        finally:
            browser.close()
