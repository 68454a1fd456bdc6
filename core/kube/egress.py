"""The default egress NetworkPolicy of a user namespace, as a plain dict. Pure: no API calls.

Why: without one, a user's notebook or job pod reaches everything the node reaches: the kubelet's API
(node:10250), every other port of every node, the cloud's metadata server (169.254.169.254: node
credentials on most clouds), the hub's ports besides its API, and other users' pods. The policy selects
every pod of the namespace and allows only:

* pods of the same namespace, every port (TF gRPC between tasks, the notebook to the coordinator's
  agent; ingress there is still the jobs' own policies);
* DNS, port 53 UDP/TCP only: to the cluster's DNS pods (kube-system, ``k8s-app: kube-dns``, CoreDNS's
  label too), to any address in the private ranges (the ClusterIP is rewritten to a pod or node address
  before the policy sees it; a CoreDNS on the host answers at the node address) and to NodeLocal
  DNSCache's 169.254.20.10. Exception: a pod can query any DNS server in private ranges;
* the Kubernetes API server (``%%tfdist`` creates its Jobs through the ``kubernetes`` Service): its
  endpoints, the address and port kube-proxy rewrites the ClusterIP to (``kubectl get endpointslices -n
  default -l kubernetes.io/service-name=kubernetes``), never the ClusterIP, which the policy never sees;
* the hub: its API and the GPU admin service's reports, by address when the hub runs outside pods (the
  one-machine cluster: on the host at the node address), else by label in the hub's namespace (z2jh:
  ``component: hub`` on the API port, ``component: proxy`` on 8000 and ``component: autohttps`` on
  8080/8443, where proxy-public sends notebooks' GPU reports);
* whatever the admin adds (``TfdistKubeSpawner.egress_allow``, NetworkPolicy egress rules as written);
* the internet: every IPv4 address except the private ranges, CGNAT, link-local, the clouds' platform
  addresses that are public ones (Azure's 168.63.129.16: the host's WireServer, which has handed AKS pods
  the node's bootstrap credentials) and what the admin denies (``TfdistKubeSpawner.egress_deny``: the
  nodes' public addresses, pod or Service ranges outside the private ones), so ``pip install`` works (off
  with ``internet=False``). IPv6 destinations are refused unless the admin adds them.

Everything else in private ranges is refused: the kubelet and other node ports, 169.254.169.254, the
hub's other ports, other namespaces' pods. A node's address outside them (a node with a public address)
would be the internet to this policy: the spawner leaves out every address of the nodes it watches (for
the form's free GPUs) at each spawn, and the admin lists others in ``egress_deny``. Users cannot widen
it: policies are additive, and the admission policy (hub_config/admission-policy.yaml) refuses any
NetworkPolicy of theirs with egress.
Enforcement is the CNI's (kube-router on the one-machine cluster; Calico, Cilium elsewhere): a cluster
without a NetworkPolicy implementation enforces nothing. kube-router also lets every pod reach the
NodePort range (30000-32767) on its node's own addresses, whatever the policy says.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from .tenancy import TenantPolicy

EGRESS_POLICY = "tfdist-default-egress"
#: RFC 1918, CGNAT (some clouds' pod and service ranges) and link-local (metadata servers)
PRIVATE_V4 = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16")
#: public addresses that are a cloud's platform, not the internet: Azure's host endpoint (WireServer, its
#: DHCP and DNS)
PLATFORM_V4 = ("168.63.129.16/32",)
#: private ranges pods may query DNS in (link-local only at NodeLocal DNSCache's address)
DNS_RANGES = (*PRIVATE_V4[:4], "169.254.20.10/32")
#: z2jh's pods in the hub's namespace a notebook talks to, and their container ports; "hub" gets the API
#: port of the hub's URL
HUB_PODS: dict[str, tuple[int, ...]] = {"hub": (), "proxy": (8000,), "autohttps": (8080, 8443)}
DEFAULT_HUB_PORT = 8081


@dataclass(frozen=True)
class Endpoint:
    """One address (or CIDR) and port outside the namespace's pods that its pods may connect to."""

    cidr: str
    port: int
    protocol: str = "TCP"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """``ADDRESS[/BITS]:PORT`` (IPv6 in brackets: ``[fd00::1]:6443``); ValueError says why not."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r}: expected ADDRESS:PORT, e.g. 10.0.0.5:6443")
        try:
            net = ipaddress.ip_network(host.strip("[]"), strict=False)
        except ValueError:
            raise ValueError(f"{text!r}: expected ADDRESS:PORT with an IP address, not a name") from None
        return cls(str(net), int(port))

    @classmethod
    def from_url(cls, url: str) -> Endpoint | None:
        """The endpoint of a URL whose host is an IP address; None for a name (a Service, resolved to a
        ClusterIP the policy never sees) or no URL."""
        parts = urlsplit(url)
        try:
            ip = ipaddress.ip_address(parts.hostname or "")
        except ValueError:
            return None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(str(ipaddress.ip_network(ip)), port)


def url_port(url: str, default: int = DEFAULT_HUB_PORT) -> int:
    """The port of a URL (`default` when it names none or cannot be read)."""
    try:
        return urlsplit(url).port or default
    except ValueError:
        return default


def _ports(*ports: int, protocols: tuple[str, ...] = ("TCP",)) -> list[dict[str, Any]]:
    return [{"protocol": proto, "port": port} for port in ports for proto in protocols]


def _to_endpoints(endpoints: tuple[Endpoint, ...]) -> list[dict[str, Any]]:
    return [
        {"to": [{"ipBlock": {"cidr": e.cidr}}], "ports": _ports(e.port, protocols=(e.protocol,))}
        for e in endpoints
    ]


def egress_rules(
    *,
    api_server: tuple[Endpoint, ...] = (),
    hub: tuple[Endpoint, ...] = (),
    hub_namespace: str = "",
    hub_port: int = DEFAULT_HUB_PORT,
    allow: tuple[dict[str, Any], ...] = (),
    internet: bool = True,
    deny: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The egress rules of the namespace's default policy, in the order of the module docstring."""
    rules: list[dict[str, Any]] = [
        {"to": [{"podSelector": {}}]},
        {
            "to": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                },
                *({"ipBlock": {"cidr": c}} for c in DNS_RANGES),
            ],
            "ports": _ports(53, protocols=("UDP", "TCP")),
        },
        *_to_endpoints(api_server),
        *_to_endpoints(hub),
    ]
    if hub_namespace:
        in_hub_ns = {"matchLabels": {"kubernetes.io/metadata.name": hub_namespace}}
        for component, ports in HUB_PODS.items():
            rules.append(
                {
                    "to": [
                        {
                            "namespaceSelector": in_hub_ns,
                            "podSelector": {"matchLabels": {"component": component}},
                        }
                    ],
                    "ports": _ports(*(ports or (hub_port,))),
                }
            )
    rules += [dict(r) for r in allow]
    if internet:
        refused = list(dict.fromkeys((*PRIVATE_V4, *PLATFORM_V4, *deny)))
        rules.append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": refused}}]})
    return rules


def egress_policy(namespace: str, labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, Any]:
    """The NetworkPolicy that selects every pod of `namespace` and lets them connect only by `rules`."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": EGRESS_POLICY, "namespace": namespace, "labels": dict(labels)},
        "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": rules},
    }


def default_egress(p: TenantPolicy) -> dict[str, Any]:
    """The user namespace's default egress policy, from the profile's TenantPolicy."""
    rules = egress_rules(
        api_server=p.egress_api_server,
        hub=p.egress_hub,
        hub_namespace=p.hub_namespace,
        hub_port=p.hub_port,
        allow=p.egress_allow,
        internet=p.egress_internet,
        deny=p.egress_deny,
    )
    labels = {"app.kubernetes.io/part-of": "jupyter-tfdist"}  # tenancy.PART_OF
    return egress_policy(p.namespace, labels, rules)


def public_addresses(addresses: tuple[str, ...]) -> tuple[str, ...]:
    """The IPv4 addresses (as /32) the internet rule would let through: nodes' addresses outside the
    private ranges, which are the nodes' own (their kubelet, their host services), not the internet."""
    private = [ipaddress.ip_network(c) for c in (*PRIVATE_V4, *PLATFORM_V4)]
    out: list[str] = []
    for text in addresses:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            continue
        if ip.version == 4 and not any(ip in net for net in private):
            out.append(f"{ip}/32")
    return tuple(dict.fromkeys(out))


def check_deny(text: str) -> str:
    """An IPv4 address or CIDR the internet rule leaves out, as the policy writes it; ValueError otherwise
    (an ipBlock's `except` must lie inside its 0.0.0.0/0)."""
    try:
        net = ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ValueError(
            f"{text!r}: expected an IPv4 address or CIDR, e.g. 203.0.113.7 or 198.18.0.0/15"
        ) from None
    if net.version != 4:
        raise ValueError(f"{text!r}: IPv6 is refused already (no IPv6 internet rule); list IPv4 here")
    return str(net)


def check_rule(rule: Any) -> dict[str, Any]:
    """An admin's extra egress rule as NetworkPolicy writes it (``to`` and/or ``ports``); ValueError
    otherwise, so a typo stops the hub instead of being dropped by the API server at the first spawn."""
    if not isinstance(rule, dict) or not rule or set(rule) - {"to", "ports"}:
        raise ValueError(f"{rule!r}: an egress rule is a mapping of 'to' (peers) and/or 'ports'")
    for key in ("to", "ports"):
        if key in rule and not (isinstance(rule[key], list) and all(isinstance(x, dict) for x in rule[key])):
            raise ValueError(f"{rule!r}: {key!r} must be a list of mappings")
    return rule
