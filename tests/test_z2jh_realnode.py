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

Then the tenancy attacks of tests/test_k8s_tenancy.py and tests/test_k8s_realnode_egress.py, against this
deployment (issue 24): with the token the user's z2jh-spawned server mounts, from a kernel in that pod, the
user reads no Secret of the hub or pod of another user, creates no pod, gets no privileged, hostPath or
hostNetwork pod and nothing past the quota through a Job, no GPU and no Service with externalIPs, and cannot
rewrite an admitted Job's template; from that pod the hub's other ports, the proxy's API and a second user's
server and listening ports are out of reach while the hub's API and proxy-public answer.

The hub runs the JupyterHub of z2jh 4.4's hub image (5.5, docker/hub.lock); one module-wide deployment,
the tests in order (each needs the one before).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests
import yaml

from tests import realnode, realnode_z2jh
from tests.hub_fixtures import error_text
from tests.hub_user import CellResult, HubUser, form_defaults
from tests.realnode_fixtures import RESTRICTED, realnode_cli
from tests.realnode_jobs import EXAMPLE_CHECK, PodWatcher, all_job_objects, code_cells, job_pods, running
from tests.test_cluster_hardening import DENIED
from tfdist.kube import names as kn
from tfdist.podidentity import DEFAULT as NOTEBOOK_IDENTITY

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


# run in a kernel of the user's server: the API as `kubectl` in their terminal sees it (the pod's own token)
API_CLIENT = """
import json, ssl, urllib.error, urllib.request
_sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
_ctx = ssl.create_default_context(cafile=_sa + "ca.crt")
_token = open(_sa + "token").read()
def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": "Bearer " + _token, "Content-Type": "application/json"}
    req = urllib.request.Request("https://kubernetes.default.svc" + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, context=_ctx, timeout=20) as r:
            return r.status, "", json.load(r)
    except urllib.error.HTTPError as e:
        doc = json.loads(e.read() or b"{}")
        return e.code, doc.get("message", ""), doc
"""

# test 1: what the notebook's token may read (the tenancy boundary, from the pod)
PROBE = API_CLIENT + 'print("PROBE " + json.dumps({p: call("GET", p)[0] for p in PATHS}))\n'


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


# the attacks, in order: reads, a pod, Jobs, Services owned by the suspended Job, then that Job's template
ATTACKS = """
S = json.loads(SPEC)
out = {name: call("GET", path)[:2] for name, path in S["reads"].items()}
out["pod"] = call("POST", S["pods"], S["pod"])[:2]
for name, job in S["jobs"].items():
    out[name] = call("POST", S["jobs_path"], job)[:2]
_, _, job = call("GET", S["jobs_path"] + "/" + S["suspended"])
meta = job["metadata"]
owner = [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}]
for name, svc in S["services"].items():
    svc["metadata"]["ownerReferences"] = owner
    out[name] = call("POST", S["services_path"], svc)[:2]
def update(change):
    for _ in range(5):  # the Job controller writes the suspended Job's status meanwhile (409: read it again)
        _, _, job = call("GET", S["jobs_path"] + "/" + S["suspended"])
        change(job["spec"]["template"])
        got = call("PUT", S["jobs_path"] + "/" + S["suspended"], job)[:2]
        if got[0] != 409:
            return got
    return got
out["update"] = update(lambda t: t["spec"].update(tolerations=[{"operator": "Exists"}]))
out["update_labels"] = update(lambda t: t["metadata"].setdefault("labels", {}).update(S["forged_labels"]))
print("ATTACKS " + json.dumps(out))
"""

# a listener on every address of the second user's pod, as a kernel or a tool there may open one; it checks
# that it answers on its pod address (so a refusal from the first user's pod is the network's doing)
LISTENER = """
import socket, threading
_srv = socket.create_server(("0.0.0.0", 0))
def _serve():
    while True:
        c, _ = _srv.accept()
        c.sendall(b"victim\\n"); c.close()
threading.Thread(target=_serve, daemon=True).start()
_ip = socket.gethostbyname(socket.gethostname())
with socket.create_connection((_ip, _srv.getsockname()[1]), timeout=5) as _c:
    print("LISTEN", _ip, _srv.getsockname()[1], _c.recv(16).decode().strip())
"""

# from the user's server pod: each target tried for a few seconds at once (CONNECTED at the first success)
NET = """
import json, socket, threading, time
T = json.loads(TARGETS)
def connect(host, port, seconds=8):
    end, err = time.monotonic() + seconds, None
    while time.monotonic() < end:
        s = socket.socket(); s.settimeout(2)
        try:
            s.connect((host, port)); return "CONNECTED"
        except OSError as e:
            err = e; time.sleep(0.25)
        finally:
            s.close()
    return "BLOCKED %r" % (err,)
out = {}
ts = [threading.Thread(target=lambda k=k, t=t: out.__setitem__(k, connect(*t))) for k, t in T.items()]
[t.start() for t in ts]; [t.join() for t in ts]
print("NET " + json.dumps(out))
"""

# from the user's server pod, through proxy-public with the server's own hub token: its own server and the
# second user's (the proxy routes anyone; the server must refuse another user's token)
VIA_PROXY = """
import http.client, json, os
def status(path):
    c = http.client.HTTPConnection(PROXY, timeout=20)
    c.request("GET", path, headers={"Authorization": "token " + os.environ["JUPYTERHUB_API_TOKEN"]})
    return c.getresponse().status
print("PROXY " + json.dumps({k: status(path) for k, path in PATHS.items()}))
"""

# from the user's server pod, through proxy-public without a token: the GPU admin service's own answer
SERVICE_UP = """
import http.client, json
c = http.client.HTTPConnection(PROXY, timeout=20)
c.request("GET", "/services/tfdist-gpu-admin/")
r = c.getresponse()
print("SERVICE " + json.dumps({"status": r.status, "location": r.getheader("Location") or ""}))
"""


def attack_job(
    name: str, image: str, owner: dict, queue: str, pod: dict | None = None, **container: Any
) -> dict:
    """A batch Job the user's Role may create, owned by their server's pod (the admission policy asks for
    that) and otherwise what Pod Security "restricted" admits: `pod` and `container` add the attack."""
    labels = {"kueue.x-k8s.io/queue-name": queue} if queue else {}
    c = {"name": "c", "image": image, "imagePullPolicy": "Never", "command": ["python3", "-c", "pass"]}
    c["securityContext"] = dict(RESTRICTED)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels, "ownerReferences": [owner]},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    # the notebook's user and groups, as %%tfdist sets them (tfdist.kube.runas)
                    "securityContext": NOTEBOOK_IDENTITY.security_context(),
                    "containers": [c | container],
                    **(pod or {}),
                },
            },
        },
    }


def service(name: str, **spec: Any) -> dict:
    return {"metadata": {"name": name}, "spec": {"ports": [{"port": 8080}], **spec}}


def kernel_json(res: CellResult, prefix: str) -> dict:
    assert res.error is None, res.error
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith(prefix + " ")), None)
    assert line, res.stdout[-2000:]
    return json.loads(line[len(prefix) + 1 :])


def failed_creates(real_cluster, ns: str, jobs: list[str]) -> dict[str, str]:
    """The Job controller's refusals to create the jobs' pods: job -> the first refusal's message."""
    evs = real_cluster.get(f"/api/v1/namespaces/{ns}/events?fieldSelector=reason%3DFailedCreate")["items"]
    out: dict[str, str] = {}
    for e in evs:
        name = e["involvedObject"]["name"]
        if e["involvedObject"]["kind"] == "Job" and name in jobs:
            out.setdefault(name, e["message"])
    return out


def attack_objects(real_cluster, ns: str) -> list[str]:
    """The attack test's Jobs and Services (atk-*) still in the user's namespace."""
    out = []
    for path in (f"/apis/batch/v1/namespaces/{ns}/jobs", f"/api/v1/namespaces/{ns}/services"):
        out += [o["metadata"]["name"] for o in real_cluster.get(path)["items"]]
    return [name for name in out if name.startswith("atk-")]


def spawn_refusal(hu: HubUser, server: str, fields: list[tuple[str, str]], **changed: str) -> tuple[int, str]:
    """POST the spawn form of a named server with some fields changed: (status, the form's error)."""
    data = [(k, changed.pop(k, v)) for k, v in fields] + list(changed.items())
    r = hu.post_spawn(data, server)
    return r.status_code, error_text(r)


def test_tenancy_attacks_from_the_users_server_are_refused(real_cluster, deployed: Deployed) -> None:
    """Issue 24: the attacks of the plain spawner's path (tests/test_k8s_tenancy.py, the real node's egress
    tests) from inside the server z2jh spawned, as its user can make them; each with a control that works."""
    hub, user = deployed.hub, deployed.user
    ns = f"{NS}-{user}"
    t0 = time.monotonic()
    # a second user, their server spawned as the first one's was (from the form's defaults)
    victim = HubUser(hub.url, f"v{uuid.uuid4().hex[:6]}", hub.password)
    vns = f"{NS}-{victim.name}"
    victim.login()
    victim.spawn_with(form_defaults(victim.form()))
    nb = HubUser(hub.url, user, hub.password)
    nb.login()
    kernel = nb.open_kernel("attacks.ipynb")
    victim_kernel = None
    sfx = uuid.uuid4().hex[:5]
    jobs = {
        "suspended": f"atk-suspended-{sfx}",
        "gpu": f"atk-gpu-{sfx}",
        "privileged": f"atk-priv-{sfx}",
        "hostpath": f"atk-hostpath-{sfx}",
        "hostnetwork": f"atk-hostnet-{sfx}",
        "quota": f"atk-quota-{sfx}",
    }
    try:
        victim.wait_server(timeout=300)
        deployed.timings["second user's spawn"] = time.monotonic() - t0
        # z2jh's own Secret of the hub (proxy token, cookie secret, the hub's keys) is there to be stolen
        assert real_cluster.get(f"/api/v1/namespaces/{NS}/secrets/hub") is not None
        (server,) = real_cluster.get(
            f"/api/v1/namespaces/{ns}/pods?labelSelector=component%3Dsingleuser-server"
        )["items"]
        owner = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": server["metadata"]["name"],
            "uid": server["metadata"]["uid"],
        }
        params = real_cluster.get(f"/api/v1/namespaces/{ns}/configmaps/tfdist-policy")["data"]
        queue, image = params["queue"], deployed.images.notebook
        hostpath = {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}
        spec = {
            "reads": {
                "hub_secret": f"/api/v1/namespaces/{NS}/secrets/hub",
                "hub_secrets": f"/api/v1/namespaces/{NS}/secrets",
                "hub_pods": f"/api/v1/namespaces/{NS}/pods",
                "victim_pods": f"/api/v1/namespaces/{vns}/pods",
                "victim_secrets": f"/api/v1/namespaces/{vns}/secrets",
                "own_secrets": f"/api/v1/namespaces/{ns}/secrets",
            },
            "pods": f"/api/v1/namespaces/{ns}/pods",
            "pod": {
                "metadata": {"name": f"atk-pod-{sfx}"},
                "spec": {"containers": [{"name": "c", "image": image}], **hostpath},
            },
            "jobs_path": f"/apis/batch/v1/namespaces/{ns}/jobs",
            "suspended": jobs["suspended"],
            "jobs": {
                "suspended": attack_job(jobs["suspended"], image, owner, queue),
                "gpu": attack_job(
                    jobs["gpu"], image, owner, queue, resources={"limits": {"nvidia.com/gpu": 1}}
                ),
                "privileged": attack_job(
                    jobs["privileged"],
                    image,
                    owner,
                    queue,
                    securityContext={k: v for k, v in RESTRICTED.items() if k != "allowPrivilegeEscalation"}
                    | {"privileged": True},
                ),
                "hostpath": attack_job(
                    jobs["hostpath"],
                    image,
                    owner,
                    queue,
                    pod=hostpath,
                    volumeMounts=[{"name": "h", "mountPath": "/h"}],
                ),
                "hostnetwork": attack_job(
                    jobs["hostnetwork"], image, owner, queue, pod={"hostNetwork": True}
                ),
                "quota": attack_job(
                    jobs["quota"], image, owner, queue, resources={"limits": {"ephemeral-storage": "200Gi"}}
                ),
            },
            "services_path": f"/api/v1/namespaces/{ns}/services",
            "services": {
                "service": service(f"atk-svc-{sfx}", clusterIP="None"),  # a job's own is headless
                "service_external_ips": service(
                    f"atk-ext-{sfx}", externalIPs=[real_cluster.state["node_ip"]]
                ),
                "service_nodeport": service(f"atk-np-{sfx}", type="NodePort"),
            },
            # what the backend trusts to find a job's coordinator (test_k8s_tenancy's forged chief)
            "forged_labels": {kn.L_ROLE: "chief"},
        }
        spec["jobs"]["suspended"]["spec"]["suspend"] = True
        res = kernel.execute(f"SPEC = {json.dumps(spec)!r}\n{API_CLIENT}\n{ATTACKS}", timeout=120)
        got = kernel_json(res, "ATTACKS")
        print(f"\nz2jh tenancy attacks: {json.dumps(got)}")
        status = {k: v[0] for k, v in got.items()}
        assert status == {
            **dict.fromkeys(spec["reads"], 403),
            "pod": 403,
            "suspended": 201,  # the control: a Job as %%tfdist makes one is admitted
            "gpu": 403,
            "hostpath": 403,  # the policy's list of volume kinds (Pod Security's the second layer)
            **dict.fromkeys(("privileged", "hostnetwork", "quota"), 201),  # refused at pod creation
            "service": 201,  # the control: a Service as a job makes one
            "service_external_ips": 403,
            "service_nodeport": 403,
            "update": 403,
            "update_labels": 403,
        }, got
        msg = {k: v[1] for k, v in got.items()}
        assert 'cannot create resource "pods"' in msg["pod"], msg["pod"]
        assert "tfdist-user-placement" in msg["gpu"] and "your profile allows no GPUs" in msg["gpu"], msg[
            "gpu"
        ]
        # the cluster's DenyServiceExternalIPs refuses it first here; the admission policy where that is off
        ext = msg["service_external_ips"]
        assert DENIED in ext or "only ClusterIP or headless Services" in ext, ext
        # the admission policy alone (Kubernetes makes NodePort Services for anyone who may create Services)
        assert "only ClusterIP or headless Services" in msg["service_nodeport"], msg["service_nodeport"]
        # admission on UPDATE: what Kubernetes lets a suspended Job's template change (tolerations, labels;
        # tried without the policy), the policy does not: a forbidden toleration, a label the backend trusts
        for k in ("update", "update_labels"):
            assert "tfdist-user-placement" in msg[k] and "cannot change after it is created" in msg[k], msg[k]
        assert "volume h is not allowed" in msg["hostpath"], msg["hostpath"]
        live = real_cluster.get(f"/apis/batch/v1/namespaces/{ns}/jobs/{jobs['suspended']}")["spec"]
        live = live["template"]
        assert not live["spec"].get("tolerations") and kn.L_ROLE not in live["metadata"]["labels"], live
        # the Jobs Pod Security and the quota must stop: created, their pods never
        refused = ("privileged", "hostnetwork", "quota")
        names = [jobs[k] for k in refused]
        _wait(
            "the Job controller's refusals",
            lambda: len(failed_creates(real_cluster, ns, names)) == len(names),
            timeout=60,
        )
        why = failed_creates(real_cluster, ns, names)
        expected = {
            "privileged": ('violates PodSecurity "restricted:latest"', "securityContext.privileged=true"),
            "hostnetwork": ('violates PodSecurity "restricted:latest"', "hostNetwork=true"),
            "quota": ("exceeded quota: tfdist-quota", "limits.ephemeral-storage=200Gi"),
        }
        for k, parts in expected.items():
            assert all(p in why[jobs[k]] for p in parts), (k, why[jobs[k]])
        pods = real_cluster.get(f"/api/v1/namespaces/{ns}/pods")["items"]
        made = [p["metadata"]["name"] for p in pods if p["metadata"]["name"].startswith("atk-")]
        assert not made, made

        # the form, the hub's side of the quota: a profile of another group, GPUs, CPUs past the profile's
        # maximum, an image off its list; each refused with its sentence and no second server's pod
        fields = form_defaults(nb.form("greedy"))
        for changed, says in [
            ({"profile": "gpu"}, "is not available to you"),
            ({"gpus": "1"}, "offers no GPUs"),
            ({"cpu": "64"}, "CPU must be between"),
            ({"image": "docker.io/library/python:3"}, "is not on the list"),
        ]:
            code, text = spawn_refusal(nb, "greedy", fields, **changed)
            assert code == 400 and says in text, (changed, code, text)
        servers = "pods?labelSelector=component%3Dsingleuser-server"
        assert len(real_cluster.get(f"/api/v1/namespaces/{ns}/{servers}")["items"]) == 1

        # the network: the second user's server and a port its kernel opened, the hub's and proxy's others
        victim_kernel = victim.open_kernel("listen.ipynb")
        res = victim_kernel.execute(LISTENER, timeout=60)
        assert res.error is None, res.error
        _, vip, vport, greeting = next(
            ln for ln in res.stdout.splitlines() if ln.startswith("LISTEN ")
        ).split()
        (vpod,) = real_cluster.get(f"/api/v1/namespaces/{vns}/{servers}")["items"]
        assert greeting == "victim" and vip == vpod["status"]["podIP"], (res.stdout, vpod["status"])
        core = {
            p["metadata"]["labels"].get("component"): p["status"].get("podIP")
            for p in real_cluster.get(f"/api/v1/namespaces/{NS}/pods")["items"]
        }
        targets = {
            "hub_api": [core["hub"], 8081],  # the server's own hub API: it cannot run without it
            "proxy_public": [f"proxy-public.{NS}.svc", 80],
            "hub_gpu_admin": [core["hub"], 10101],  # only the proxy may
            "proxy_api": [core["proxy"], 8001],  # only the hub may
            "victim_server": [vip, 8888],
            "victim_listener": [vip, int(vport)],
        }
        # the control for hub_gpu_admin's "blocked": the service listens (the proxy reaches it, and only
        # the service itself answers with a redirect naming its own OAuth client)
        up = kernel_json(
            kernel.execute(f"PROXY = 'proxy-public.{NS}.svc'\n{SERVICE_UP}", timeout=60), "SERVICE"
        )
        assert up["status"] == 302 and "client_id=service-tfdist-gpu-admin" in up["location"], up
        res = kernel.execute(f"TARGETS = {json.dumps(targets)!r}\n{NET}", timeout=60)
        net = kernel_json(res, "NET")
        reached = {k: v == "CONNECTED" for k, v in net.items()}
        assert reached == {
            "hub_api": True,
            "proxy_public": True,
            "hub_gpu_admin": False,
            "proxy_api": False,
            "victim_server": False,
            "victim_listener": False,
        }, net
        paths = {"own": f"/user/{user}/api/status", "victim": f"/user/{victim.name}/api/status"}
        code = f"PROXY = 'proxy-public.{NS}.svc'\nPATHS = {json.dumps(paths)}\n{VIA_PROXY}"
        via = kernel_json(kernel.execute(code, timeout=60), "PROXY")
        assert via == {"own": 200, "victim": 403}, via
        deployed.timings["tenancy attacks"] = time.monotonic() - t0
    finally:
        kernel.close()
        if victim_kernel is not None:
            victim_kernel.close()
        for name in jobs.values():
            with contextlib.suppress(Exception):
                real_cluster.request(
                    "DELETE",
                    f"/apis/batch/v1/namespaces/{ns}/jobs/{name}",
                    {"propagationPolicy": "Background"},
                )
        requests.delete(
            f"{hub.url}/hub/api/users/{victim.name}/server",
            headers={"Authorization": f"token {victim.api_token()}"},
            timeout=60,
        )
    # nothing of the attacks stays to be counted by the uninstall test, and the second server frees its core
    _wait("the attack jobs and their Services gone", lambda: not attack_objects(real_cluster, ns), timeout=60)
    _wait(
        "the second user's server gone",
        lambda: not real_cluster.get(f"/api/v1/namespaces/{vns}/pods")["items"],
        120,
    )


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
