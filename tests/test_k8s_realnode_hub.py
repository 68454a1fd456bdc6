"""A real JupyterHub with TfdistKubeSpawner on the host, spawning notebook pods on the one-machine cluster's
real node (issue 8, 3a/3b).

The hub binds its API on the node address (tests/realnode.py's NODE_IP, the host address the pod network
reaches), so the notebook pod's jupyterhub-singleuser talks to it; the proxy serves chromium on 127.0.0.1
and reaches the pod's IP over the pod bridge. The user gets their own namespace (tfdist.kube.tenancy), the
notebook image is `scripts/build-images notebook --import`'s, the job image `job --import`'s (the spawner
passes it as TFDIST_WORKER_IMAGE). One test function: each spawn costs minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests import realnode, realnode_fixtures
from tests.hub_fixtures import RunningHub, start_hub
from tests.hub_user import HubUser
from tests.realnode_fixtures import realnode_images_current

# the session fixture, registered for this module whatever other modules imported first
real_cluster = realnode_fixtures.real_cluster

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


def _images() -> dict[str, str]:
    """The refs `scripts/build-images notebook job --import` recorded (imported into the cluster)."""
    path = realnode_images_current()
    cur = json.loads(path.read_text()) if path.exists() else {}
    miss = [n for n in ("notebook", "job") if n not in cur]
    if miss:
        need = " and ".join(miss)
        pytest.fail(f"no {need} image in {path}: run scripts/build-images notebook job --import")
    return {n: cur[n]["ref"] for n in ("notebook", "job")} | {
        "notebook_bytes": str(cur["notebook"]["layers_bytes"])
    }


@pytest.fixture(scope="module")
def kube_hub(real_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningHub, str]]:
    """The hub, its API on the node address; yields (hub, user-namespace prefix)."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test does this)")
    from tfdist.spawner.localhub import free_port

    images = _images()
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
        c.TfdistKubeSpawner.worker_image = {images["job"]!r}
        c.TfdistKubeSpawner.user_namespace_template = "{prefix}-{{username}}"
        c.KubeSpawner.start_timeout = 300
        c.KubeSpawner.http_timeout = 180
        c.KubeSpawner.default_url = "/lab"
        """
    tmp = tmp_path_factory.mktemp("realnodehub")
    extra = extra.replace("PROFILES_FILE", repr(str(tmp / "profiles.yaml")))
    hub = start_hub(tmp, profiles_yaml=PROFILES.format(image=images["notebook"]), extra=extra)
    try:
        yield hub, prefix
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
    real_cluster, kube_hub: tuple[RunningHub, str], tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    hub, prefix = kube_hub
    user = f"nb{uuid.uuid4().hex[:6]}"
    ns = f"{prefix}-{user}"
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
    assert container["image"] == _images()["notebook"]
    assert pod["status"]["containerStatuses"][0]["ready"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TFDIST_BACKEND"] == "kubernetes" and env["TFDIST_WORKER_IMAGE"] == _images()["job"]
    assert real_cluster.get(f"/api/v1/namespaces/{ns}/resourcequotas/tfdist-quota") is not None

    # through the hub's proxy with the user's own token: the server in the pod answers, as that user
    nb = HubUser(hub.url, user, hub.password)
    nb.login()
    r = nb.server_api("GET", "/me")
    assert r.status_code == 200 and r.json()["identity"]["username"] == user, r.text

    hub.stop_server(user, timeout=120)
    _wait(
        f"pod {ns}/{pod_name} gone",
        lambda: real_cluster.get(f"/api/v1/namespaces/{ns}/pods/{pod_name}") is None,
        timeout=90,
    )
    with pytest.raises(requests.RequestException):
        requests.get(f"http://{pod['status']['podIP']}:8888/api/status", timeout=3)
