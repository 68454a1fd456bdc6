"""A real JupyterHub with TfdistKubeSpawner on the host, spawning notebook pods on the one-machine cluster's
real node (issue 8, 3a/3b).

The hub binds its API on the node address (tests/realnode.py's NODE_IP, the host address the pod network
reaches), so the notebook pod's jupyterhub-singleuser talks to it; the proxy serves chromium on 127.0.0.1
and reaches the pod's IP over the pod bridge. The user gets their own namespace (tfdist.kube.tenancy), the
notebook image is `scripts/build-images notebook --import`'s, the job image `job --import`'s (the spawner
passes it as TFDIST_WORKER_IMAGE). The browser spawn (3a) against the venv's JupyterHub; the example trained
from a notebook pod (3b) is tests/test_z2jh_realnode.py's, through the chart's hub (one training of the
example on the real node in place of two).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests import realnode
from tests.hub_fixtures import RunningHub, start_hub
from tests.hub_user import HubUser

pytestmark = [pytest.mark.k8s, pytest.mark.realnode, pytest.mark.browser, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
PROFILES = """
profiles:
  - slug: cpu
    display_name: "CPU only"
    description: "Notebooks and small %%tfdist runs on the node's CPUs."
    groups: ["*"]
    cpu: {{min: 0.1, max: 2, default: 0.25, limit_factor: 4}}
    memory_gib: {{min: 1, max: 8, default: 3}}
    images:
      - {{image: "{image}", display_name: "tfdist notebook (local)"}}
    jobs: {{pods: 8}}
"""


def build_images() -> dict[str, dict]:
    """The notebook and job images of this checkout, imported into the node's containerd (cached by a hash
    of their inputs: seconds when nothing changed): {name: {ref, archive_bytes}}, from the command's own
    lines (current.json may already name another checkout's build)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "build-images"), "notebook", "job", "--import"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/build-images notebook job --import failed:\n{out.stderr[-3000:]}")
    images = {}
    for line in out.stdout.splitlines():  # name, ref, archive, size
        parts = line.split("\t")
        if len(parts) == 4 and parts[0] in ("notebook", "job"):
            images[parts[0]] = {"ref": parts[1], "archive_bytes": os.path.getsize(parts[2])}
    assert set(images) == {"notebook", "job"}, out.stdout
    return images


@dataclass
class KubeHub:
    hub: RunningHub
    prefix: str  # of user namespaces: <prefix>-<user>
    notebook_image: str
    job_image: str


@pytest.fixture(scope="module")
def kube_hub(real_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeHub]:
    """The hub, its API on the node address, spawning the checkout's notebook image."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test does this)")
    from tfdist.spawner.localhub import free_port

    real_cluster.ensure()  # an earlier module's teardown tests may have taken the cluster down
    images = build_images()
    print(f"\nnotebook image {images['notebook']['ref']}: {images['notebook']['archive_bytes'] / 1e6:.0f} MB")
    state = real_cluster.state
    node_ip = state["node_ip"]
    prefix = f"rnhub-{uuid.uuid4().hex[:6]}"
    extra = f"""
        import os
        os.environ["KUBECONFIG"] = {state["kubeconfig"]!r}
        c.JupyterHub.spawner_class = "tfdist.spawner.kube.TfdistKubeSpawner"
        # pods reach the host at the node address; the hub API listens there only (not on the uplink)
        c.JupyterHub.hub_bind_url = "http://{node_ip}:{free_port(node_ip)}"
        c.TfdistKubeSpawner.profiles_file = PROFILES_FILE
        c.TfdistKubeSpawner.worker_image = {images["job"]["ref"]!r}
        c.TfdistKubeSpawner.user_namespace_template = "{prefix}-{{username}}"
        c.KubeSpawner.start_timeout = 300
        c.KubeSpawner.http_timeout = 180
        c.KubeSpawner.default_url = "/lab"
        """
    tmp = tmp_path_factory.mktemp("realnodehub")
    extra = extra.replace("PROFILES_FILE", repr(str(tmp / "profiles.yaml")))
    hub = start_hub(tmp, profiles_yaml=PROFILES.format(image=images["notebook"]["ref"]), extra=extra)
    try:
        yield KubeHub(hub, prefix, images["notebook"]["ref"], images["job"]["ref"])
    finally:
        hub.stop()
        for ns in (real_cluster.get("/api/v1/namespaces") or {}).get("items", []):
            if ns["metadata"]["name"].startswith(prefix + "-"):
                real_cluster.request("DELETE", f"/api/v1/namespaces/{ns['metadata']['name']}")


def _wait(what: str, probe, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


def test_spawn_from_the_form_runs_jupyterlab_in_a_pod_on_the_real_node(
    real_cluster, kube_hub: KubeHub, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    hub = kube_hub.hub
    user = f"nb{uuid.uuid4().hex[:6]}"
    ns = f"{kube_hub.prefix}-{user}"
    shot = tmp_path / "jupyterlab-in-pod.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(f"{hub.url}/hub/login")
            page.fill("#username_input", user)
            page.fill("#password_input", hub.password)
            page.click("#login_submit")
            page.wait_for_url("**/hub/spawn**")
            expect(page.locator('input[name="profile"][value="cpu"]')).to_be_checked()  # the form's default
            t0 = time.monotonic()
            page.click('form#spawn_form input[type="submit"], form#spawn_form button[type="submit"]')
            page.wait_for_url(f"**/user/{user}/lab**", timeout=300_000)
            page.wait_for_selector(".jp-LabShell", state="visible", timeout=180_000)
            page.wait_for_selector(".jp-Launcher, .jp-NotebookPanel", state="visible", timeout=180_000)
            loaded_s = time.monotonic() - t0
            # the image's lab extension is loaded: the "Distributed jobs" panel's tab is in the side bar
            expect(page.locator('.jp-SideBar .lm-TabBar-tab[data-id="tfdist-jobs"]')).to_have_count(1)
            page.screenshot(path=str(shot))
        finally:
            browser.close()
    print(f"\nspawn click -> JupyterLab loaded: {loaded_s:.1f} s; screenshot {shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    server = hub.servers(user)[""]
    assert server["ready"], server
    pod_name, pod_ns = server["state"]["pod_name"], server["state"]["namespace"]
    assert pod_ns == ns  # the user's own namespace, made by the spawner (tenancy)
    pod = real_cluster.get(f"/api/v1/namespaces/{ns}/pods/{pod_name}")
    assert pod["spec"]["nodeName"] == realnode.NODE_NAME and pod["status"]["phase"] == "Running"
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "notebook"]
    assert container["image"] == kube_hub.notebook_image
    assert pod["status"]["containerStatuses"][0]["ready"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TFDIST_BACKEND"] == "kubernetes" and env["TFDIST_WORKER_IMAGE"] == kube_hub.job_image
    assert real_cluster.get(f"/api/v1/namespaces/{ns}/resourcequotas/tfdist-quota") is not None

    # through the hub's proxy with the user's own token: the server in the pod answers, as that user
    nb = HubUser(hub.url, user, hub.password)
    nb.login()
    r = nb.server_api("GET", "/me")
    assert r.status_code == 200 and r.json()["identity"]["username"] == user, r.text
    # the jobs panel's API in the pod lists the user's jobs through the in-cluster config: none yet
    r = requests.get(
        f"{hub.url}/user/{user}/tfdist/api/jobs",
        headers={"Authorization": f"token {nb.api_token()}"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json() == {"user": user, "jobs": []}, r.text

    hub.stop_server(user, timeout=120)
    _wait(
        f"pod {ns}/{pod_name} gone",
        lambda: real_cluster.get(f"/api/v1/namespaces/{ns}/pods/{pod_name}") is None,
        timeout=90,
    )
    with pytest.raises(requests.RequestException):
        requests.get(f"http://{pod['status']['podIP']}:8888/api/status", timeout=3)
