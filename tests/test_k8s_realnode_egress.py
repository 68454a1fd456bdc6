"""A user's pod attacks what lies beyond its namespace, on the real node, and the default egress policy
(tfdist.kube.egress, enforced by kube-router) refuses it (issue 22).

The namespace is prepared by the spawner's code: TfdistKubeSpawner's egress mapping with the hub's API on
the node address (as tests/test_k8s_realnode_hub.py runs it) and the hub's own kubeconfig, then
tfdist.kube.apply.setup_user. One restricted pod in it then tries, for several seconds each (kube-router
adds a new pod to its policies only once it runs): the kubelet (node:10250), a listener standing in for
the cloud metadata server (169.254.169.254:80, put on the node bridge for the test: without it the packet
would only be dropped by the node's forwarding guard, policy or not) and a listener on another port of the
node: all refused; DNS, the API server through the `kubernetes` Service, a listener at node:8081 (the hub
API's stand-in) and another pod of the namespace: all reached.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import realnode
from tests.realnode_jobs import drop_tenant, make_tenant

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]

HUB_PORT = 8081
METADATA_IP = "169.254.169.254"
SERVE = "import http.server as h; h.HTTPServer(('', 8080), h.SimpleHTTPRequestHandler).serve_forever()"

# Each target is tried in its own thread. The refused ones only after another pod of the namespace
# answered: that needs kube-router to have put this pod in the peer's ingress set, which it does in the
# same sync that gives this pod its egress chain (a connect before that would prove nothing).
PROBE = r"""
import json, os, socket, ssl, threading, time, urllib.request
T = json.loads('__TARGETS__')
out = {}

def connect(host, port, until, want_bytes=False):
    err = None
    while time.monotonic() < until:
        s = socket.socket(); s.settimeout(2)
        try:
            s.connect((host, port))
            got = s.recv(16).decode(errors="replace") if want_bytes else ""
            return "CONNECTED " + got.strip()
        except OSError as e:
            err = e; time.sleep(0.25)
        finally:
            s.close()
    return "BLOCKED %r" % (err,)

def retry(fn, until):
    err = None
    while time.monotonic() < until:
        try:
            return "OK " + fn()
        except Exception as e:
            err = e; time.sleep(0.5)
    return "FAILED %r" % (err,)

def api_version():
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
    req = urllib.request.Request("https://kubernetes.default.svc/version",
                                 headers={"Authorization": "Bearer " + open(sa + "/token").read()})
    with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
        return "%s %s" % (r.status, json.load(r)["gitVersion"])

out["peer"] = connect(T["peer"], 8080, time.monotonic() + 60) if T.get("peer") else "SKIPPED"
print("PEER", out["peer"], flush=True)
end = time.monotonic() + 10
jobs = {
    "dns": lambda: retry(lambda: socket.gethostbyname("kubernetes.default.svc.cluster.local"), end),
    "api": lambda: retry(api_version, end),
    "hub": lambda: connect(T["node"], T["hub_port"], end, want_bytes=True),
    "kubelet": lambda: connect(T["node"], 10250, end),
    "other_port": lambda: connect(T["node"], T["other_port"], end, want_bytes=True),
    "metadata": lambda: connect(T["metadata"], 80, end, want_bytes=True),
}
def run(k, f):
    out[k] = f()
ts = [threading.Thread(target=run, args=kv) for kv in jobs.items()]
[t.start() for t in ts]; [t.join() for t in ts]
print("RESULT " + json.dumps(out), flush=True)
"""


class Listener:
    """A TCP listener on the host that greets every connection with its name and closes it."""

    def __init__(self, host: str, port: int, name: str) -> None:
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        self.name = name
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.name.encode() + b"\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def host_listeners(real_cluster) -> Iterator[dict[str, Listener]]:
    """The hub API's stand-in at node:8081, another port of the node, and a fake metadata server."""
    node = real_cluster.state["node_ip"]
    made: list[Listener] = []
    realnode.run("ip", "addr", "replace", f"{METADATA_IP}/32", "dev", realnode.NODE_BRIDGE)
    try:
        try:
            made.append(Listener(node, HUB_PORT, "hub"))
        except OSError as e:
            pytest.fail(f"{node}:{HUB_PORT} is taken on this machine ({e}): the hub's stand-in needs it")
        made.append(Listener(node, 0, "other"))
        made.append(Listener(METADATA_IP, 80, "metadata"))
        yield {lst.name: lst for lst in made}
    finally:
        for lst in made:
            lst.close()
        realnode.run("ip", "addr", "del", f"{METADATA_IP}/32", "dev", realnode.NODE_BRIDGE, check=False)


def spawner_egress(kubeconfig: str, server: str, hub_api_url: str) -> dict[str, Any]:
    """The egress fields TfdistKubeSpawner.tenant_policy() maps for a hub with this kubeconfig, API server
    and URL."""
    sys.path.insert(0, str(Path(__file__).parent / "doubles"))
    from hub_objects import FakeHub, FakeHubUser

    async def fields() -> dict[str, Any]:
        from tfdist.spawner.kube import TfdistKubeSpawner

        hub = FakeHub()
        hub.api_url = hub_api_url
        # k8s_api_host: kubespawner loads one kubeconfig per process, maybe another test's
        sp = TfdistKubeSpawner(
            user=FakeHubUser(name="x"), hub=hub, gpu_availability_enabled=False, k8s_api_host=server
        )
        return sp._egress_fields()

    import kubernetes_asyncio.config.kube_config as kc
    from kubernetes_asyncio.client import Configuration

    old = kc.KUBE_CONFIG_DEFAULT_LOCATION, Configuration.get_default_copy()
    kc.KUBE_CONFIG_DEFAULT_LOCATION = kubeconfig  # read from $KUBECONFIG once, at import
    try:
        return asyncio.run(fields())
    finally:  # kubespawner's load_config changed the process-wide default client configuration
        kc.KUBE_CONFIG_DEFAULT_LOCATION = old[0]
        Configuration.set_default(old[1])


@pytest.fixture
def tenant_ns(real_cluster, tmp_path) -> Iterator[str]:
    """A user namespace prepared as the spawner prepares it (egress from the spawner's own mapping)."""
    state = real_cluster.state
    hub_url = f"http://{state['node_ip']}:{HUB_PORT}/hub/api"
    fields = spawner_egress(state["kubeconfig"], state["server"], hub_url)
    tenant = make_tenant(real_cluster, "egress", tmp_path, **fields)
    try:
        yield tenant.namespace
    finally:
        drop_tenant(real_cluster, tenant)


def _probe(real_cluster, ns: str, name: str, targets: dict[str, Any]) -> dict[str, str]:
    """PROBE's verdict per target, from a pod `name` of `ns`."""
    script = PROBE.replace("__TARGETS__", json.dumps(targets))
    phase, logs = real_cluster.run_to_end(ns, name, script, timeout=180)
    assert phase == "Succeeded", logs
    line = next((x for x in logs.splitlines() if x.startswith("RESULT ")), None)
    assert line, logs
    return json.loads(line[len("RESULT ") :])


def test_user_pod_reaches_only_dns_api_hub_and_its_namespace(real_cluster, tenant_ns, host_listeners):
    ns, node = tenant_ns, real_cluster.state["node_ip"]
    # another pod of the namespace, admitted by an ingress policy as a job's own policy would admit peers
    real_cluster.pod(ns, "peer", SERVE, labels={"app": "peer"})
    real_cluster.request(
        "POST",
        f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
        {
            "metadata": {"name": "peer-in"},
            "spec": {
                "podSelector": {"matchLabels": {"app": "peer"}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 8080}]}],
            },
        },
    )
    peer_ip = real_cluster.wait_pod(ns, "peer", ("Running",), timeout=120)["status"]["podIP"]
    targets = {
        "peer": peer_ip,
        "node": node,
        "hub_port": HUB_PORT,
        "other_port": host_listeners["other"].port,
        "metadata": METADATA_IP,
    }
    got = _probe(real_cluster, ns, "attacker", targets)
    why = f"{got}\nkube-router's log:\n{realnode.tail('kube-router', 20)}"
    # what a notebook and its jobs need
    assert got["peer"].startswith("CONNECTED"), why
    assert got["dns"] == "OK 10.0.0.1", why
    assert got["api"].startswith("OK 200 v1."), why
    assert got["hub"] == "CONNECTED hub", why
    # and nothing else of the node or its link-local range, for 10 s of tries each
    for target in ("kubelet", "other_port", "metadata"):
        assert got[target].startswith("BLOCKED"), (target, why)
    # the control: the same probe from a namespace without the tenant's policies reaches each of them, so
    # BLOCKED above is the policy's doing, not an address that nothing routes or answers
    plain = real_cluster.create_namespace(f"egress-control-{uuid.uuid4().hex[:6]}")
    try:
        control = _probe(real_cluster, plain, "control", {**targets, "peer": None})
    finally:
        real_cluster.request("DELETE", f"/api/v1/namespaces/{plain}")
    for target in ("kubelet", "other_port", "metadata"):
        assert control[target].startswith("CONNECTED"), (target, control)
    pols = real_cluster.get(f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies")["items"]
    assert "tfdist-default-egress" in [p["metadata"]["name"] for p in pols]
