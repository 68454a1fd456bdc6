"""The hub admin's path with the zero-to-jupyterhub chart, end to end on the one-machine cluster's real node
(issue 24): what `scripts/cluster hub` runs (tests/realnode_z2jh.py: hub_config/values.yaml + this machine's
images and address), then, as users and the admin do it through proxy-public:

log in; the tfdist form shows the profiles of hub_config/profiles.yaml; spawn with the form's defaults into
the user's own namespace; examples/digits.ipynb trains in that pod with the Kubernetes backend (its job's
chief, PS and worker pods on the node, nothing left when the cell ends) and a detached job is started; the
GPU page answers the admin and refuses a user; `helm upgrade` with an edited profiles file changes the form
and keeps the running server; stopping the server takes the detached job with the notebook pod (garbage
collector); `helm uninstall` then the documented cleanup (docs/admins.md) leave no tenant object. (The
example trains on the real node here only: tests/test_k8s_realnode_hub.py keeps the browser spawn.)

The hub runs the JupyterHub of z2jh 4.4's hub image (5.5, docker/hub.lock); one module-wide deployment,
the tests in order (each needs the one before).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests
import yaml

from tests import realnode, realnode_z2jh
from tests.hub_user import HubUser, form_defaults
from tests.realnode_fixtures import realnode_cli
from tests.realnode_jobs import EXAMPLE_CHECK, PodWatcher, all_job_objects, code_cells, job_pods, running

pytestmark = [pytest.mark.k8s, pytest.mark.realnode, pytest.mark.timeout(2400)]

NS = realnode_z2jh.NAMESPACE
# Two cores: the hub, the proxy, the profile's smallest notebook (0.5 core) and four job pods at 0.3 core
JOB_FLAGS = "--cpu 0.3 --memory 1536Mi"
GPU_PAGE = "/services/tfdist-gpu-admin/"
TENANT = "tfdist.io/tenant"
# what the spawner converges in a user namespace and docs/admins.md says stays after `helm uninstall`
# (until `kubectl delete namespace -l tfdist.io/tenant=true`)
TENANT_KINDS = {
    "pods": "/api/v1/namespaces/{ns}/pods",
    "services": "/api/v1/namespaces/{ns}/services",
    "secrets": "/api/v1/namespaces/{ns}/secrets",
    "pvcs": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "jobs": "/apis/batch/v1/namespaces/{ns}/jobs",
}
DETACHED = "keep"  # the job test 1 leaves running for the uninstall test


# run in the notebook's kernel: what its service account's token may do (the tenancy boundary, from the pod)
PROBE = """
import json, ssl, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
ctx = ssl.create_default_context(cafile=sa + "ca.crt")
token = open(sa + "token").read()
def status(path):
    auth = {"Authorization": "Bearer " + token}
    req = urllib.request.Request("https://kubernetes.default.svc" + path, headers=auth)
    try:
        return urllib.request.urlopen(req, context=ctx, timeout=20).status
    except urllib.error.HTTPError as e:
        return e.code
print("PROBE " + json.dumps({p: status(p) for p in PATHS}))
"""


@dataclass
class Deployed:
    state: dict
    hub: realnode_z2jh.Hub
    images: realnode_z2jh.Images
    user: str
    timings: dict


def _wait(what: str, probe, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


def tenant_namespaces(real_cluster) -> list[str]:
    items = (real_cluster.get(f"/api/v1/namespaces?labelSelector={TENANT}%3Dtrue") or {}).get("items", [])
    return [n["metadata"]["name"] for n in items if n["metadata"]["name"].startswith(NS + "-")]


def parse_exports(out: str) -> dict[str, str]:
    return dict(ln[len("export ") :].split("=", 1) for ln in out.splitlines() if ln.startswith("export "))


@pytest.fixture(scope="module")
def deployed(real_cluster) -> Iterator[Deployed]:
    """What an admin runs on this machine: `scripts/cluster hub` (its printed lines are the hub's address)."""
    real_cluster.ensure()
    state = real_cluster.state
    t0 = time.monotonic()
    out = realnode_cli("hub", timeout=1800)  # builds (cached) and imports the images, then installs
    assert out.returncode == 0, out.stderr[-3000:]
    env = parse_exports(out.stdout)
    hub = realnode_z2jh.Hub(
        env["TFDIST_HUB_URL"], env["TFDIST_HUB_PASSWORD"], env["TFDIST_HUB_ADMIN_PASSWORD"], ""
    )
    images = realnode_z2jh.release_images(state)
    d = Deployed(state, hub, images, f"u{uuid.uuid4().hex[:6]}", {"images+install": time.monotonic() - t0})
    try:
        yield d
    finally:
        print(f"\nz2jh timings: {json.dumps({k: round(v, 1) for k, v in d.timings.items()})}")
        try:
            realnode_z2jh.uninstall(state)
        except realnode.ClusterError:
            pass  # the test uninstalled it already
        for ns in [*tenant_namespaces(real_cluster), NS]:
            real_cluster.request("DELETE", f"/api/v1/namespaces/{ns}")


def profile_slugs(form: str) -> list[str]:
    """The profiles the form offers (one radio input each)."""
    return re.findall(r'name="profile"[^>]*value="([^"]+)"', form)


def visible_profiles(profiles_yaml: str) -> dict[str, str]:
    """slug -> display_name of the profiles every user may choose (groups ["*"])."""
    doc = yaml.safe_load(profiles_yaml)
    return {p["slug"]: p["display_name"] for p in doc["profiles"] if "*" in p.get("groups", [])}


def test_user_logs_in_spawns_from_the_form_and_the_example_trains(real_cluster, deployed: Deployed) -> None:
    hub, user = deployed.hub, deployed.user
    ns = f"{NS}-{user}"
    # the hub, proxy and nothing else of the chart run in jhub, from this machine's images
    pods = real_cluster.get(f"/api/v1/namespaces/{NS}/pods")["items"]
    images = {c["image"] for p in pods for c in p["spec"]["containers"]}
    assert images == {deployed.images.hub, deployed.images.proxy}, images
    hub_pod = next(p for p in pods if p["metadata"]["labels"].get("component") == "hub")
    assert hub_pod["spec"]["serviceAccountName"] == "hub"
    # the JupyterHub of z2jh 4.4's hub image (docker/hub.lock), not the venv's
    lock = (realnode.REPO / "docker" / "hub.lock").read_text()
    (pinned,) = re.findall(r"^jupyterhub==(\S+)$", lock, re.M)
    assert requests.get(f"{hub.url}/hub/api/", timeout=30).json()["version"] == pinned == "5.5.0"

    nb = HubUser(hub.url, user, hub.password)
    nb.login()
    form = nb.form()
    offered = profile_slugs(form)
    expected = visible_profiles(realnode_z2jh.PROFILES.read_text())
    assert offered == list(expected), (offered, expected)
    for name in expected.values():
        assert name in form
    t0 = time.monotonic()
    nb.spawn_with(form_defaults(form))
    nb.wait_server(timeout=600)
    deployed.timings["spawn"] = time.monotonic() - t0

    # the user's own namespace, converged by the spawner (tenancy), the pod on the real node
    ns_obj = real_cluster.get(f"/api/v1/namespaces/{ns}")
    assert ns_obj["metadata"]["labels"][TENANT] == "true"
    assert real_cluster.get(f"/api/v1/namespaces/{ns}/resourcequotas/tfdist-quota") is not None
    assert real_cluster.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles")["items"]
    (pod,) = [
        p
        for p in real_cluster.get(f"/api/v1/namespaces/{ns}/pods")["items"]
        if p["metadata"]["labels"].get("component") == "singleuser-server"
    ]
    assert (
        pod["spec"]["nodeName"] == realnode.NODE_NAME
        and pod["spec"]["serviceAccountName"] == "tfdist-notebook"
    )
    assert not real_cluster.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=component%3Dsingleuser-server")[
        "items"
    ], "a notebook pod in the hub's namespace"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["TFDIST_BACKEND"] == "kubernetes" and env["TFDIST_WORKER_IMAGE"] == deployed.images.job
    r = nb.server_api("GET", "/me")
    assert r.status_code == 200 and r.json()["identity"]["username"] == user, r.text

    # the example, in the pod's kernel, its %%tfdist job as pods of the user's namespace
    example = json.loads((realnode.REPO / "examples" / "digits.ipynb").read_text())
    r = nb.server_api(
        "PUT", "/contents/digits.ipynb", json={"type": "notebook", "format": "json", "content": example}
    )
    assert r.status_code in (200, 201), r.text
    kernel = nb.open_kernel("digits.ipynb")
    watcher = PodWatcher(real_cluster, ns)
    t0 = time.monotonic()
    try:
        # the notebook's token: its own namespace's pods, nothing of the hub's namespace
        paths = {
            f"/api/v1/namespaces/{ns}/pods": 200,
            f"/api/v1/namespaces/{NS}/secrets": 403,
            f"/api/v1/namespaces/{NS}/pods": 403,
            f"/api/v1/namespaces/{NS}/configmaps": 403,
        }
        res = kernel.execute(f"PATHS = {list(paths)!r}\n{PROBE}", timeout=120)
        assert res.error is None, res.error
        seen = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("PROBE "))[6:])
        assert seen == paths, seen
        for code in code_cells(example):
            if code.startswith("%%tfdist run"):
                first, rest = code.split("\n", 1)
                code = f"{first} {JOB_FLAGS}\n{rest}"
            res = kernel.execute(code, timeout=900)
            assert res.error is None, f"cell failed:\n{code}\n{res.error}\nstdout:\n{res.stdout[-3000:]}"
            if "import tensorflow" in code:  # the image's kernels hold TensorFlow to the spawner's level
                assert not res.stderr.strip(), res.stderr
            if code.startswith("%%tfdist run"):
                assert "succeeded" in res.stdout, res.stdout[-3000:]
        out = kernel.execute(EXAMPLE_CHECK, timeout=120)
        assert out.error is None, out.error
        result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        assert result["changed"] and result["epochs"] == 8 and result["acc"] > 0.85, result
        seen = watcher.stop()
        assert len({job for job, _, _ in seen}) == 1, seen
        roles = {role for _, role, node in seen if node == realnode.NODE_NAME}
        assert roles >= {"chief", "ps", "worker"}, seen  # the coordinator, PS and workers ran on the node
        deployed.timings["example"] = time.monotonic() - t0
        # the job ended with the cell: nothing of it is left (the kernel deleted the root, the GC the rest)
        _wait("no object of the finished job", lambda: not all_job_objects(real_cluster, ns), timeout=60)

        # a detached job lives on without the kernel (the uninstall test sees it go with the notebook pod)
        res = kernel.execute(
            f"%%tfdist run --detach --workers 1 --ps 1 {JOB_FLAGS} --name {DETACHED}\n"
            "model.fit(train_ds, epochs=500, steps_per_epoch=40)\n",
            timeout=300,
        )
        assert res.error is None, res.error
    finally:
        watcher.stop()
        kernel.close()
    _wait("the detached job's three pods running", lambda: len(detached_running(real_cluster, ns)) == 3, 180)


def detached_running(real_cluster, ns: str) -> list[dict]:
    return running(job_pods(real_cluster, ns, DETACHED))


def test_gpu_page_answers_the_admin_and_refuses_a_user(deployed: Deployed) -> None:
    hub = deployed.hub
    admin = HubUser(hub.url, realnode_z2jh.ADMIN, hub.admin_password)
    admin.login()
    r = admin.session.get(f"{hub.url}{GPU_PAGE}", timeout=60)
    assert r.status_code == 200 and "GPU servers" in r.text, (r.status_code, r.text[:500])
    # the page's data (admin.js renders it): the user's running server, as the hub in its pod sees it
    r = admin.session.get(f"{hub.url}{GPU_PAGE}api/servers", timeout=60)
    assert r.status_code == 200 and deployed.user in r.text, (r.status_code, r.text[:500])
    user = HubUser(hub.url, deployed.user, hub.password)
    user.login()
    for path in ("", "api/servers"):
        r = user.session.get(f"{hub.url}{GPU_PAGE}{path}", timeout=60)
        assert r.status_code == 403, (path, r.status_code, r.text[:300])


def test_helm_upgrade_with_edited_profiles_changes_the_form_and_keeps_the_server(
    real_cluster, deployed: Deployed
) -> None:
    hub, user = deployed.hub, deployed.user
    ns = f"{NS}-{user}"
    before = real_cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=component%3Dsingleuser-server")
    (pod,) = before["items"]
    doc = yaml.safe_load(realnode_z2jh.PROFILES.read_text())
    cpu = next(p for p in doc["profiles"] if "*" in p.get("groups", []))
    cpu["display_name"] = "CPU only (edited)"
    t0 = time.monotonic()
    with realnode.locked():
        realnode_z2jh.deploy(
            deployed.state, profiles=yaml.safe_dump(doc, sort_keys=False), images=deployed.images
        )
    deployed.timings["upgrade"] = time.monotonic() - t0

    nb = HubUser(hub.url, user, hub.password)
    nb.login()
    form = nb.form("second")  # a named server's form: the default one runs
    assert "CPU only (edited)" in form
    # the server spawned before the upgrade still runs, the same pod, and the new hub knows it
    after = real_cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=component%3Dsingleuser-server")
    assert [p["metadata"]["uid"] for p in after["items"]] == [pod["metadata"]["uid"]]
    nb.wait_server(timeout=60)
    r = requests.get(
        f"{hub.url}/hub/api/users/{user}", headers={"Authorization": f"token {nb.api_token()}"}, timeout=30
    )
    assert r.status_code == 200 and r.json()["servers"][""]["ready"], r.text


def test_helm_uninstall_then_the_documented_cleanup_leaves_no_tenant_object(
    real_cluster, deployed: Deployed
) -> None:
    hub, user = deployed.hub, deployed.user
    ns = f"{NS}-{user}"
    admin = HubUser(hub.url, realnode_z2jh.ADMIN, hub.admin_password)
    admin.login()
    # test 1's detached job still runs, its kernel long closed (and the hub restarted by the upgrade)
    assert len(detached_running(real_cluster, ns)) == 3, all_job_objects(real_cluster, ns)
    # docs/admins.md: stop the servers, then uninstall, then remove the user namespaces
    r = requests.delete(
        f"{hub.url}/hub/api/users/{user}/server",
        headers={"Authorization": f"token {admin.api_token()}"},
        timeout=60,
    )
    assert r.status_code in (202, 204), r.text
    t0 = time.monotonic()
    # the job's root is owned by the notebook pod: the garbage collector removes the job with the pod
    _wait(
        "the garbage collector to remove the detached job with its notebook pod",
        lambda: not all_job_objects(real_cluster, ns),
        timeout=120,
    )
    deployed.timings["detached job gone"] = time.monotonic() - t0
    _wait(
        "the notebook pod gone",
        lambda: not real_cluster.get(f"/api/v1/namespaces/{ns}/pods")["items"],
        timeout=120,
    )
    t0 = time.monotonic()
    realnode_z2jh.uninstall(deployed.state)
    deployed.timings["uninstall"] = time.monotonic() - t0
    left = [
        f"{p['kind'] if 'kind' in p else 'obj'}/{p['metadata']['name']}"
        for p in realnode_z2jh_objects(real_cluster)
    ]
    assert not left, left
    # what stays (docs/admins.md): the user namespaces with what the spawner converged there, no workload
    assert ns in tenant_namespaces(real_cluster)
    for kind, path in TENANT_KINDS.items():
        items = (real_cluster.get(path.format(ns=ns)) or {"items": []})["items"]
        names = [o["metadata"]["name"] for o in items]
        assert not names, (kind, names)
    realnode_z2jh.kubectl(deployed.state, "delete", "namespace", "-l", f"{TENANT}=true", "--wait=false")
    _wait("no tenant namespace", lambda: not tenant_namespaces(real_cluster), timeout=180, interval=1)


def realnode_z2jh_objects(real_cluster) -> list[dict]:
    """The chart's workloads and services left in jhub (helm uninstall removes them)."""
    out = []
    for path in (
        f"/apis/apps/v1/namespaces/{NS}/deployments",
        f"/api/v1/namespaces/{NS}/services",
        f"/api/v1/namespaces/{NS}/pods",
        f"/api/v1/namespaces/{NS}/persistentvolumeclaims",
    ):
        out += (real_cluster.get(path) or {"items": []})["items"]
    return out
