"""The cluster scripts' own hardening (issue 22), attacked as a user of the machine or of the cluster would:

- a Service with ``externalIPs`` (CVE-2020-8554: it takes the address:port over on every node) is refused by
  the API server's DenyServiceExternalIPs admission plugin, for a user's notebook token and for an admin;
- etcd answers only TLS clients holding a certificate of etcd's own CA: plain HTTP, TLS without a
  certificate and a certificate of the cluster CA (a kubelet's) are all refused, for a local user who is
  not root (who cannot read the key files either);
- the plane's PKI, tokens and kubeconfigs are 0600 in 0700 directories whatever the umask, and
  ``scripts/cluster user NAME > FILE`` leaves FILE 0600 under umask 000.

All on the kwok plane (``k8s_plane``); the real node's plane is the same code (tests/realnode.py).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests import kube_plane, realnode
from tests.test_k8s_tenancy import _token
from tfdist.kube import tenancy
from tfdist.kube.apply import prepare_user_namespace

pytestmark = [pytest.mark.k8s]
REPO = Path(__file__).resolve().parent.parent
DENIED = "Use of external IPs is denied by admission control"


def _call(plane, token: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One API request with ``token`` (as kubectl with that token would send it): (status, body)."""
    req = urllib.request.Request(
        plane.server + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    ctx = ssl.create_default_context(cafile=plane.ca_file)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _service(name: str, external_ips: list[str] | None = None, port: int = 6443) -> dict:
    spec: dict = {"selector": {"app": name}, "ports": [{"port": port, "targetPort": 8080}]}
    if external_ips is not None:
        spec["externalIPs"] = external_ips
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


# ----------------------------------------------------------------------------------- 1: externalIPs
async def test_a_service_with_external_ips_is_refused_for_users_and_admins(k8s_plane, k8s_api):
    plane = k8s_plane
    user = f"eve-{uuid.uuid4().hex[:6]}"
    ns = f"tfdist-user-{user}"
    # the user's namespace exactly as the spawner prepares it: the notebook's Role may create Services
    await prepare_user_namespace(
        k8s_api, tenancy.TenantPolicy(user=user, namespace=ns, gpu_quota={"nvidia.com/gpu": 0})
    )
    try:
        eve = _token(plane, ns, tenancy.NOTEBOOK_SA)
        services = f"/api/v1/namespaces/{ns}/services"
        # the node's address and the API server's port: the Service would take them over on the node
        code, body = _call(plane, eve, "POST", services, _service("hijack", [realnode.NODE_IP]))
        assert code == 403, (code, body)
        assert body["message"] == f'services "hijack" is forbidden: {DENIED}', body
        # the refusal is about externalIPs, not the namespace: the same Service without them is made (by
        # the admin: where hub_config/admission-policy.yaml is applied, a user's own must also be owned by
        # one of their jobs and headless, tests/test_k8s_escapes.py)
        code, body = _call(plane, plane.token, "POST", services, _service("plain"))
        assert code == 201, (code, body)

        # an admin (system:masters) too: the plugin refuses every new externalIP, whoever asks
        code, body = _call(plane, plane.token, "POST", services, _service("admin-hijack", ["10.99.0.2"]))
        assert (code, body.get("message")) == (403, f'services "admin-hijack" is forbidden: {DENIED}')
        # and none can be added to an existing Service later (the notebook's Role cannot update one at all)
        live = plane.request("GET", f"{services}/plain")
        live["spec"]["externalIPs"] = [realnode.NODE_IP]
        code, body = _call(plane, plane.token, "PUT", f"{services}/plain", live)
        assert (code, body.get("message")) == (403, f'services "plain" is forbidden: {DENIED}'), body
        names = {s["metadata"]["name"] for s in plane.request("GET", services)["items"]}
        assert names == {"plain"}
        assert not plane.request("GET", f"{services}/plain")["spec"].get("externalIPs")
    finally:
        plane.request("DELETE", f"/api/v1/namespaces/{ns}")


# --------------------------------------------------------------------------------------------- 2: etcd
# Run as a local user who is not root, with the system's Python and the stdlib: what anyone logged in to
# the machine can do against etcd's client port.
ETCD_PROBE = r"""
import base64, json, socket, ssl, sys, urllib.request
port, key, cluster_cert, cluster_key, secret_key = sys.argv[1:6]
out = {}
def attempt(name, fn):
    try:
        out[name] = "ANSWERED " + fn()
    except Exception as e:
        out[name] = "refused: " + type(e).__name__ + ": " + str(e)[:160]
rng = json.dumps({"key": base64.b64encode(secret_key.encode()).decode()}).encode()
def http(scheme, path, ctx=None, data=None):
    def go():
        url = f"{scheme}://127.0.0.1:{port}{path}"
        req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            return f"{r.status} {r.read()[:600]!r}"
    return go
anyone = ssl.create_default_context(); anyone.check_hostname = False; anyone.verify_mode = ssl.CERT_NONE
attempt("http version", http("http", "/version"))
attempt("http range", http("http", "/v3/kv/range", data=rng))
attempt("https no cert version", http("https", "/version", anyone))
attempt("https no cert range", http("https", "/v3/kv/range", anyone, rng))
kubelet = ssl.create_default_context(); kubelet.check_hostname = False; kubelet.verify_mode = ssl.CERT_NONE
kubelet.load_cert_chain(cluster_cert, cluster_key)
attempt("https cluster-CA cert range", http("https", "/v3/kv/range", kubelet, rng))
def read_key():
    with open(key) as f:
        return f.read()[:20]
attempt("read the API server's etcd key", read_key)
print(json.dumps(out))
"""


def _as_local_user() -> dict:
    """subprocess arguments that run a command as `nobody` when this test runs as root."""
    if os.geteuid() != 0:
        return {}
    return {"user": 65534, "group": 65534, "extra_groups": []}


def test_etcd_refuses_every_client_but_the_api_server(k8s_plane, k8s_namespace):
    plane = k8s_plane
    value = f"s3cret-{uuid.uuid4().hex}"
    plane.request(
        "POST",
        f"/api/v1/namespaces/{k8s_namespace}/secrets",
        {"metadata": {"name": "loot"}, "stringData": {"k": value}},
    )
    secret_key = f"/registry/secrets/{k8s_namespace}/loot"
    # the probe's files where `nobody` reaches them (pytest's tmp_path is root's alone), with a certificate
    # of the cluster CA, as a kubelet or kube-proxy holds one, for the probe to try
    work = Path(tempfile.mkdtemp(prefix="tfdist-etcd-probe-"))
    try:
        for f in ("ca.crt", "ca.key"):
            (work / f).write_bytes((Path(plane.workdir) / "pki" / f).read_bytes())
        realnode.issue_client_cert(work, "node", "system:node:kwok-x", ["system:nodes"])
        (work / "probe.py").write_text(ETCD_PROBE)
        for f in (work / "node.crt", work / "node.key", work / "probe.py"):
            os.chmod(f, 0o644)
        os.chmod(work, 0o755)
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        r = subprocess.run(
            [
                python,
                str(work / "probe.py"),
                str(plane.ports["etcd"]),
                str(Path(plane.workdir) / "pki" / "apiserver-etcd-client.key"),
                str(work / "node.crt"),
                str(work / "node.key"),
                secret_key,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            **_as_local_user(),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    answered = {k: v for k, v in out.items() if not v.startswith("refused")}
    assert not answered, json.dumps(out, indent=1)
    assert value not in r.stdout
    if os.geteuid() == 0:
        assert "PermissionError" in out["read the API server's etcd key"], out

    # the API server's certificate does open it (so the refusals above are etcd's, and the plane works)
    rng = json.dumps({"key": base64.b64encode(secret_key.encode()).decode()}).encode()
    req = urllib.request.Request(f"https://127.0.0.1:{plane.ports['etcd']}/v3/kv/range", data=rng)
    with urllib.request.urlopen(req, context=plane.etcd_ssl(), timeout=5) as resp:
        kvs = json.loads(resp.read())["kvs"]
    assert base64.b64decode(kvs[0]["key"]).decode() == secret_key
    got = plane.request("GET", f"/api/v1/namespaces/{k8s_namespace}/secrets/loot")["data"]["k"]
    assert base64.b64decode(got).decode() == value


# ---------------------------------------------------------------------------------- 3: file modes
def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_the_planes_keys_tokens_and_kubeconfigs_are_private(k8s_plane):
    d = Path(k8s_plane.workdir)
    pki = d / "pki"
    assert _mode(d) == 0o700 and _mode(pki) == 0o700
    wide = {f.name: oct(_mode(f)) for f in pki.iterdir() if f.is_file() and _mode(f) != 0o600}
    assert not wide, wide
    for required in ("ca.key", "etcd-ca.key", "apiserver-etcd-client.key", "tokens.csv", "sa.key"):
        assert (pki / required).exists(), required
    kubeconfigs = list(d.glob("*.kubeconfig"))
    assert len(kubeconfigs) >= 4
    assert {k.name: oct(_mode(k)) for k in kubeconfigs} == {k.name: "0o600" for k in kubeconfigs}
    for sub in ("kcm-certs", "scheduler-certs"):
        assert _mode(d / sub) == 0o700, sub


def test_pki_is_private_under_umask_000(tmp_path):
    old = os.umask(0)
    try:
        kube_plane._write_pki(tmp_path / "pki", ("10.99.0.1",))
        kube_plane.write_private(tmp_path / "pki" / "tokens.csv", 't,admin,uid,"system:masters"\n')
        realnode.issue_client_cert(tmp_path / "pki", "kubelet", "system:node:n", ["system:nodes"])
        existing = tmp_path / "was-wide"
        existing.write_text("old")
        os.chmod(existing, 0o666)
        kube_plane.write_private(existing, "token")  # an existing file is narrowed, then written
    finally:
        os.umask(old)
    assert _mode(tmp_path / "pki") == 0o700
    assert {f.name: oct(_mode(f)) for f in (tmp_path / "pki").iterdir()} == {
        f.name: "0o600" for f in (tmp_path / "pki").iterdir()
    }
    assert (_mode(existing), existing.read_text()) == (0o600, "token")


# ------------------------------------------------------------------------- 4: scripts/cluster user
@pytest.mark.skipif(os.geteuid() != 0, reason="scripts/cluster user runs as root")
def test_cluster_user_kubeconfig_is_0600_under_umask_000(k8s_plane, tmp_path):
    """`umask 000; sudo scripts/cluster user NAME > NAME.kubeconfig` (what scripts/cluster runs after its venv
    check), against this plane through a cluster record of its own."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text(
        json.dumps(
            {
                "server": k8s_plane.server,
                "token": k8s_plane.token,
                "kubeconfig": k8s_plane.kubeconfig,
                "ca_file": k8s_plane.ca_file,
            }
        )
    )
    name = f"ann-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "ann.kubeconfig"
    try:
        r = subprocess.run(
            ["bash", "-c", f'umask 000 && exec "$0" -m tests.realnode user {name} > {out}', sys.executable],
            cwd=REPO,
            env={**os.environ, "TFDIST_CLUSTER_STATE": str(state)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        kc = yaml.safe_load(out.read_text())
        assert kc["users"][0]["user"]["token"]
        assert oct(_mode(out)) == "0o600"
    finally:
        k8s_plane.request("DELETE", f"/api/v1/namespaces/{realnode.user_namespace(name)}")
