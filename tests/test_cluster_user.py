"""`scripts/cluster user NAME` (issue 9): NAME's namespace prepared by the spawner's own code and a kubeconfig
acting as NAME's notebook service account, so anyone can try the tenancy boundaries by hand. With that
kubeconfig: NAME's own pods can be listed; another namespace's Secret, a pod in the hub's namespace or in
NAME's own namespace are forbidden. Bad input and no cluster: one clear line, exit 2, nothing created.

The cluster tests run on the one-machine real-node cluster (``real_cluster``: reused when up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests import realnode
from tests.test_k8s_tenancy import DEFAULT_CAPS
from tfdist.kube import tenancy

REPO = Path(__file__).resolve().parent.parent
BAD_NAMES = ["Ann", "ann_b", "-ann", "ann-", "a.b", "", "a" * 52, "ann/../kube-system", "änn", "a b"]


def cluster_user(*args: str, state_dir: str | None = None) -> subprocess.CompletedProcess:
    """What scripts/cluster runs after its venv check (python -m tests.realnode), here with this venv."""
    env = dict(os.environ)
    if state_dir is not None:
        env["TFDIST_CLUSTER_STATE"] = state_dir
    return subprocess.run(
        [sys.executable, "-m", "tests.realnode", "user", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------------------------------- without a cluster
def test_a_bad_name_is_refused_before_any_cluster_is_asked(tmp_path, monkeypatch, capsys):
    r = cluster_user("Ann", state_dir=str(tmp_path / "no-cluster"))
    assert (r.returncode, r.stdout) == (2, ""), r
    assert "cluster: invalid user name 'Ann': 1 to 51 characters of a-z, 0-9 and '-'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    monkeypatch.setattr(realnode, "STATE", tmp_path / "no-cluster")  # the rest in this process: faster
    for name in BAD_NAMES[1:]:
        assert realnode.main(["user", name]) == 2, name
        err = capsys.readouterr()
        assert err.out == "" and f"invalid user name {name!r}" in err.err, (name, err)


def test_no_cluster_up_says_how_to_start_one(tmp_path):
    r = cluster_user("ann", state_dir=str(tmp_path / "no-cluster"))
    assert (r.returncode, r.stdout) == (2, ""), r
    assert 'no cluster is up: start one with  eval "$(sudo scripts/cluster up)"' in r.stderr, r.stderr
    # a state left behind by a cluster whose API server is gone: the same, with the address tried
    import certifi

    port = realnode.kube_plane.free_port()
    for ca, says in ((certifi.where(), f"127.0.0.1:{port} does not answer"), (__file__, "is unusable")):
        state = tmp_path / f"stale-{len(says)}"
        state.mkdir()
        (state / "state.json").write_text(
            json.dumps({"server": f"https://127.0.0.1:{port}", "token": "t", "kubeconfig": "", "ca_file": ca})
        )
        r = cluster_user("ann", state_dir=str(state))
        assert (r.returncode, r.stdout) == (2, ""), r
        assert "no cluster is up" in r.stderr and says in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["user"], ["user", "a", "b"]])
def test_the_script_wants_exactly_one_name(args):
    r = subprocess.run([str(REPO / "scripts" / "cluster"), *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "user takes one NAME" in r.stderr, r
    assert r.stdout == ""


# ---------------------------------------------------------------------------------- on the real cluster
def _status(kubeconfig: Path, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One request with the printed kubeconfig's own server, CA and token (as kubectl would send it)."""
    import base64
    import ssl
    import urllib.error
    import urllib.request

    kc = yaml.safe_load(kubeconfig.read_text())
    cluster, user = kc["clusters"][0]["cluster"], kc["users"][0]["user"]
    ctx = ssl.create_default_context(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    req = urllib.request.Request(
        cluster["server"] + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {user['token']}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _pod(name: str, secret: str | None = None) -> dict:
    c: dict = {"name": "c", "image": "example.org/x:1"}
    spec: dict = {"containers": [c]}
    if secret:
        c["volumeMounts"] = [{"name": "s", "mountPath": "/s"}]
        spec["volumes"] = [{"name": "s", "secret": {"secretName": secret}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.mark.k8s
@pytest.mark.realnode
def test_the_printed_kubeconfig_acts_as_the_users_notebook_and_no_more(real_cluster, tmp_path):
    c = real_cluster
    suffix = uuid.uuid4().hex[:6]
    name, other = f"ann-{suffix}", f"bob-{suffix}"
    hub = c.create_namespace(f"hub-{suffix}")  # stands in for the hub's namespace, with the hub's Secret
    c.request(
        "POST", f"/api/v1/namespaces/{hub}/secrets", {"metadata": {"name": "hub"}, "stringData": {"k": "v"}}
    )
    made = [hub]
    try:
        before = {n["metadata"]["name"] for n in c.get("/api/v1/namespaces")["items"]}
        for bad in ("Ann", "ann_b"):
            assert cluster_user(bad).returncode == 2
        assert {n["metadata"]["name"] for n in c.get("/api/v1/namespaces")["items"]} == before

        outs = {}
        made += [realnode.user_namespace(name), realnode.user_namespace(other)]
        # NAME and OTHER at once, as two tests on two workers do (a GET-then-PUT of the admission policy
        # lost that race with 409 Conflict in CI); then NAME again: the spawner's code is idempotent
        with ThreadPoolExecutor(2) as pool:
            runs = list(zip((name, other), pool.map(cluster_user, (name, other)), strict=True))
        runs.append((name, cluster_user(name)))
        for who, r in runs:
            assert r.returncode == 0, r.stderr
            assert f"namespace {realnode.user_namespace(who)} ready" in r.stderr
            outs[who] = r.stdout
        ns, other_ns = realnode.user_namespace(name), realnode.user_namespace(other)
        kc = tmp_path / "ann.kubeconfig"
        kc.write_text(outs[name])
        conf = yaml.safe_load(outs[name])
        assert conf["contexts"][0]["context"]["namespace"] == ns
        assert conf["clusters"][0]["cluster"]["server"] == c.state["server"]

        # the namespace is what the spawner makes: tenant label, quota, the notebook's Role
        labels = c.get(f"/api/v1/namespaces/{ns}")["metadata"]["labels"]
        assert labels[tenancy.L_TENANT] == "true"
        assert c.get(f"/api/v1/namespaces/{ns}/resourcequotas/{tenancy.QUOTA}")["spec"]["hard"] == {
            "requests.nvidia.com/gpu": "0",
            **DEFAULT_CAPS,  # counts and disks are capped by default
        }
        role = c.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{tenancy.NOTEBOOK_SA}")
        assert role["rules"] == tenancy.NOTEBOOK_RULES

        c.request("POST", f"/api/v1/namespaces/{other_ns}/secrets", {"metadata": {"name": "bobs"}})
        code, body = _status(kc, "GET", f"/api/v1/namespaces/{ns}/pods")
        assert (code, body.get("items")) == (200, [])
        code, body = _status(kc, "GET", f"/api/v1/namespaces/{other_ns}/secrets/bobs")
        assert code == 403 and f"system:serviceaccount:{ns}:{tenancy.NOTEBOOK_SA}" in body["message"], body
        for target in (hub, other_ns, ns):  # pods are the Job controller's, in any namespace
            code, body = _status(kc, "POST", f"/api/v1/namespaces/{target}/pods", _pod("steal", "hub"))
            assert code == 403, (target, body)
        assert _status(kc, "GET", f"/api/v1/namespaces/{hub}/secrets/hub")[0] == 403
        assert _status(kc, "GET", f"/api/v1/namespaces/{ns}/secrets")[0] == 403
        assert not c.get(f"/api/v1/namespaces/{hub}/pods")["items"]
        # the admission policy the parameters belong to is installed
        assert c.get(
            "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/tfdist-user-placement"
        )
    finally:
        for n in made:
            try:
                c.request("DELETE", f"/api/v1/namespaces/{n}")
            except Exception:
                pass


@pytest.mark.k8s
@pytest.mark.realnode
def test_the_admission_policy_applies_from_many_places_at_once(real_cluster):
    """Every `cluster user` and every real-node job test applies hub_config/admission-policy.yaml; eight at
    once, three rounds, all succeed and leave one policy and one binding as the file says."""
    c = real_cluster
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            list(pool.map(lambda _: realnode.apply_admission_policy(c), range(8)))
    docs = [d for d in yaml.safe_load_all(realnode.ADMISSION_POLICY.read_text()) if d]
    for d in docs:
        plural = (
            "validatingadmissionpolicies"
            if d["kind"] == "ValidatingAdmissionPolicy"
            else ("validatingadmissionpolicybindings")
        )
        live = c.request("GET", f"/apis/admissionregistration.k8s.io/v1/{plural}/{d['metadata']['name']}")
        assert holds(live["spec"], d["spec"]), d["metadata"]["name"]
        managers = {f["manager"]: f["operation"] for f in live["metadata"]["managedFields"]}
        assert managers.get("tfdist-cluster") == "Apply", managers  # server-side apply, no read-modify-write


def holds(live, want) -> bool:
    """Everything the file says is in the live object (the API server adds its defaults around it)."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(k in live and holds(live[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(map(holds, live, want))
    return live == want
