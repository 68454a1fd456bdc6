"""The user namespace's default egress policy (tfdist.kube.egress), pure: what it allows and what the
spawner feeds it. Enforcement on a real node: tests/test_k8s_realnode_egress.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tfdist.kube import egress, tenancy
from tfdist.kube.egress import Endpoint

sys.path.insert(0, str(Path(__file__).parent / "doubles"))

TCP, UDP = "TCP", "UDP"


def _policy(**kw: Any) -> dict[str, Any]:
    p = tenancy.TenantPolicy(user="ann", namespace="jhub-ann", **kw)
    (pol,) = [o for o in tenancy.tenant_objects(p) if o["metadata"]["name"] == egress.EGRESS_POLICY]
    return pol


def test_default_egress_selects_every_pod_and_allows_only_the_listed_peers():
    pol = _policy(
        hub_namespace="jhub",
        hub_port=8081,
        egress_api_server=(Endpoint("10.1.2.3/32", 6443),),
        egress_hub=(Endpoint("10.99.0.1/32", 8081),),
    )
    assert pol["metadata"]["namespace"] == "jhub-ann"
    spec = pol["spec"]
    assert spec["podSelector"] == {} and spec["policyTypes"] == ["Egress"]
    own, dns, api, hub, hub_pod, proxy, autohttps, internet = spec["egress"]
    assert own == {"to": [{"podSelector": {}}]}  # every port, own namespace only
    # DNS: port 53 only, to kube-dns pods and private addresses (a ClusterIP's DNAT target, the host)
    assert dns["ports"] == [{"protocol": UDP, "port": 53}, {"protocol": TCP, "port": 53}]
    assert dns["to"][0] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
    cidrs = [t["ipBlock"]["cidr"] for t in dns["to"][1:]]
    assert "169.254.20.10/32" in cidrs and "169.254.0.0/16" not in cidrs and "0.0.0.0/0" not in cidrs
    assert api == {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"protocol": TCP, "port": 6443}]}
    assert hub == {"to": [{"ipBlock": {"cidr": "10.99.0.1/32"}}], "ports": [{"protocol": TCP, "port": 8081}]}
    in_hub = {"matchLabels": {"kubernetes.io/metadata.name": "jhub"}}
    assert hub_pod == {
        "to": [{"namespaceSelector": in_hub, "podSelector": {"matchLabels": {"component": "hub"}}}],
        "ports": [{"protocol": TCP, "port": 8081}],
    }
    assert proxy["ports"] == [{"protocol": TCP, "port": 8000}]
    assert [p["port"] for p in autohttps["ports"]] == [8080, 8443]
    # the internet: everything but private ranges and link-local (the kubelet, 169.254.169.254, pods)
    assert internet == {
        "to": [
            {
                "ipBlock": {
                    "cidr": "0.0.0.0/0",
                    "except": [
                        "10.0.0.0/8",
                        "172.16.0.0/12",
                        "192.168.0.0/16",
                        "100.64.0.0/10",
                        "169.254.0.0/16",
                        "168.63.129.16/32",  # Azure's host endpoint: a public address
                    ],
                }
            }
        ]
    }
    # no rule opens a port-less path into private ranges besides the own namespace's pods
    for rule in spec["egress"][1:]:
        for peer in rule["to"]:
            if "ipBlock" in peer and peer["ipBlock"]["cidr"] != "0.0.0.0/0":
                assert rule.get("ports"), rule


def test_defaults_allow_namespace_dns_and_internet_only():
    rules = _policy()["spec"]["egress"]
    assert len(rules) == 3 and rules[0] == {"to": [{"podSelector": {}}]}
    assert _policy(egress_internet=False)["spec"]["egress"] == rules[:2]


def allowed_by_internet_rule(pol: dict[str, Any], address: str) -> bool:
    """Whether the internet rule lets a pod connect to `address` (an ipBlock with its excepts)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    for rule in pol["spec"]["egress"]:
        for peer in rule.get("to", []):
            block = peer.get("ipBlock")
            if block and block["cidr"] == "0.0.0.0/0":
                return not any(ip in ipaddress.ip_network(c) for c in block.get("except", []))
    return False


def test_the_clouds_platform_endpoint_and_the_admins_denied_ranges_are_not_the_internet():
    """Azure's 168.63.129.16 is a public address on the node's own channel to the platform (its
    WireServer has handed AKS pods the node's bootstrap credentials); a node with a public address is the
    internet to the default policy, its kubelet with it, unless the admin lists it (egress_deny)."""
    pol = _policy()
    assert allowed_by_internet_rule(pol, "151.101.0.223")  # the control: pypi.org
    assert not allowed_by_internet_rule(pol, "169.254.169.254")
    assert not allowed_by_internet_rule(pol, "168.63.129.16")
    node = "203.0.113.7"
    assert allowed_by_internet_rule(pol, node)
    pol = _policy(egress_deny=("203.0.113.7/32", "198.18.0.0/15"))
    assert not allowed_by_internet_rule(pol, node) and not allowed_by_internet_rule(pol, "198.19.1.2")
    assert allowed_by_internet_rule(pol, "151.101.0.223")
    assert egress.check_deny(" 203.0.113.7 ") == "203.0.113.7/32"
    for bad in ("node-1", "fd00::1", "203.0.113.0/33"):
        with pytest.raises(ValueError):
            egress.check_deny(bad)


async def test_the_nodes_public_addresses_are_left_out_of_the_internet_at_each_spawn(spawner, monkeypatch):
    """A node with a public address is reached through the internet rule (its kubelet, node-exporter,
    any host service on 0.0.0.0): the spawner leaves out every address of the nodes the hub watches."""
    from tfdist.spawner.availability import ClusterGpuView
    from tfdist.spawner.kube import TfdistKubeSpawner

    view = ClusterGpuView(api=None)
    assert view.node_addresses() is None  # not loaded: nothing known, nothing added
    view.apply_node(
        "ADDED",
        {
            "metadata": {"name": "n1"},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": "10.0.0.5"},
                    {"type": "ExternalIP", "address": "203.0.113.9"},
                    {"type": "InternalIP", "address": "fd00::5"},
                    {"type": "Hostname", "address": "n1"},
                ]
            },
        },
    )
    view._loaded["nodes"] = True
    assert view.node_addresses() == ("10.0.0.5", "203.0.113.9", "fd00::5")
    assert egress.public_addresses(view.node_addresses()) == ("203.0.113.9/32",)
    monkeypatch.setattr(TfdistKubeSpawner, "_node_view", lambda self: view)
    p = spawner(egress_deny=["198.18.0.0/15"]).tenant_policy()
    assert p.egress_deny == ("198.18.0.0/15", "203.0.113.9/32")
    pol = _policy(egress_deny=p.egress_deny)
    assert not allowed_by_internet_rule(pol, "203.0.113.9") and allowed_by_internet_rule(pol, "203.0.113.10")
    monkeypatch.setattr(TfdistKubeSpawner, "_node_view", lambda self: None)  # no node watch (no RBAC)
    assert spawner().tenant_policy().egress_deny == ()


def test_admin_rules_are_added_as_written():
    extra = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": TCP, "port": 443}]}
    rules = _policy(egress_allow=(extra,))["spec"]["egress"]
    assert rules[-2] == extra and "except" in rules[-1]["to"][0]["ipBlock"]
    for bad in ({}, {"from": []}, {"to": {"ipBlock": {}}}, "10.0.0.0/8", {"to": ["10.0.0.0/8"]}):
        with pytest.raises(ValueError):
            egress.check_rule(bad)


def test_endpoints_from_text_and_urls():
    assert Endpoint.parse("10.0.0.5:6443") == Endpoint("10.0.0.5/32", 6443)
    assert Endpoint.parse("10.0.0.0/28:6443") == Endpoint("10.0.0.0/28", 6443)
    assert Endpoint.parse("[fd00::1]:443") == Endpoint("fd00::1/128", 443)
    for bad in ("10.0.0.5", "api.example:6443", "10.0.0.5:0", "10.0.0.5:http"):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)
    assert Endpoint.from_url("https://10.99.0.1:6443") == Endpoint("10.99.0.1/32", 6443)
    assert Endpoint.from_url("http://10.99.0.1/hub/api") == Endpoint("10.99.0.1/32", 80)
    assert Endpoint.from_url("http://hub:8081/hub/api") is None and Endpoint.from_url("") is None
    assert egress.url_port("http://hub:8081/hub/api") == 8081 and egress.url_port("http://hub/") == 8081


# ------------------------------------------------------------------------------------------ the spawner
@pytest.fixture
def spawner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import kubernetes_asyncio.config.kube_config as kc
    from hub_objects import FakeHub, FakeHubUser

    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        'clusters: [{name: c, cluster: {server: "https://10.99.0.1:6443"}}]\n'
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u, namespace: jhub}}]\ncurrent-context: c\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kc, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    repo = Path(__file__).resolve().parent.parent

    def make(hub_url: str = "http://10.99.0.1:8081/hub/api", **traits: Any) -> Any:
        from tfdist.spawner.kube import TfdistKubeSpawner

        hub = FakeHub()
        hub.api_url = hub_url
        return TfdistKubeSpawner(
            user=FakeHubUser(name="alice"),
            hub=hub,
            profiles_file=str(repo / "hub_config" / "profiles.yaml"),
            gpu_availability_enabled=False,
            **traits,
        )

    return make


async def test_spawner_derives_api_server_and_hub_from_its_own_urls(spawner, monkeypatch):
    from tfdist.spawner.kube import TfdistKubeSpawner

    # kubespawner loads one kubeconfig per process (lru_cache): whichever test came first; the hub's own
    # client URL is what the mapping reads
    assert spawner()._kube_api_url().startswith("https://")
    monkeypatch.setattr(TfdistKubeSpawner, "_kube_api_url", lambda self: "https://10.99.0.1:6443")
    p = spawner().tenant_policy()
    assert p.egress_api_server == (Endpoint("10.99.0.1/32", 6443),)  # its kubeconfig's address
    assert p.egress_hub == (Endpoint("10.99.0.1/32", 8081),) and p.hub_port == 8081
    assert p.egress_internet and p.egress_allow == ()
    # z2jh: the hub is a Service name (reached by label in its namespace); the admin names the API server
    extra = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]}
    p = spawner(
        "http://hub:8082/hub/api",
        egress_api_server=["10.0.0.5:6443", "10.0.0.6:6443"],
        egress_allow=[extra],
        egress_internet=False,
        egress_deny=["203.0.113.7"],
    ).tenant_policy()
    assert p.egress_api_server == (Endpoint("10.0.0.5/32", 6443), Endpoint("10.0.0.6/32", 6443))
    assert p.egress_hub == () and p.hub_port == 8082
    assert p.egress_allow == (extra,) and not p.egress_internet
    assert p.egress_deny == ("203.0.113.7/32",)


async def test_spawner_refuses_bad_egress_config(spawner):
    from traitlets import TraitError

    with pytest.raises(TraitError, match="ADDRESS:PORT"):
        spawner(egress_api_server=["kubernetes.default:443"])
    with pytest.raises(TraitError, match="egress_allow"):
        spawner(egress_allow=[{"to": [], "from": []}])
    with pytest.raises(TraitError, match="egress_deny"):
        spawner(egress_deny=["node-1.example"])
