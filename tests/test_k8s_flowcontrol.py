"""API Priority and Fairness (hub_config/flowcontrol.yaml) on a real API server: a user's requests, made with
their own notebook token, are classified in `tfdist-tenants` (one flow per account) and the hub's in
`tfdist-hub` (`workload-high`), read from the classification the API server puts on every answer. Before the
manifest both fell into the built-in `service-accounts` FlowSchema: one level, shared."""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import test_k8s_tenancy as tenancy_tests
from tests.test_k8s_tenancy import _token
from tfdist.kube import tenancy

pytestmark = [pytest.mark.k8s]
hub = tenancy_tests.hub
users = tenancy_tests.users
MANIFEST = Path(__file__).resolve().parents[1] / "hub_config" / "flowcontrol.yaml"
FC = "/apis/flowcontrol.apiserver.k8s.io/v1"


def classified(plane, token: str, path: str) -> tuple[str, str]:
    """(FlowSchema, PriorityLevelConfiguration) UIDs the API server classified a request of `token` in."""
    req = urllib.request.Request(plane.server + path)
    if token:  # none: an anonymous request (a job pod's curl without its token)
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, context=plane._ssl, timeout=10) as resp:
            headers = resp.headers
    except urllib.error.HTTPError as e:  # refused by RBAC: classified all the same (APF comes first)
        headers = e.headers
    return headers["X-Kubernetes-PF-FlowSchema-UID"], headers["X-Kubernetes-PF-PriorityLevel-UID"]


def uid(plane, kind: str, name: str) -> str:
    return plane.get(f"{FC}/{kind}/{name}")["metadata"]["uid"]


@contextlib.contextmanager
def flowcontrol_applied(plane, hub_ns: str) -> Iterator[None]:
    """The manifest applied as the admin's checklist says (NAMESPACE = the hub's); removed afterwards, so
    that the plane's other tests keep the built-in levels."""
    path = Path(plane.workdir) / f"flowcontrol-{hub_ns}.yaml"
    path.write_text(MANIFEST.read_text().replace("NAMESPACE", hub_ns))
    plane.kubectl("apply", "-f", str(path))
    try:
        yield
    finally:
        plane.kubectl("delete", "--ignore-not-found", "-f", str(path))


def until(what: str, ok, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (got := ok()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return got


def test_users_and_the_hub_are_in_levels_of_their_own(k8s_plane, users):
    ann, bob, hub_ns = users["ann"], users["bob"], users["hub"]
    ann_token = _token(k8s_plane, ann, tenancy.NOTEBOOK_SA)
    hub_token = _token(k8s_plane, hub_ns, "hub")
    pods = f"/api/v1/namespaces/{ann}/pods"
    # before: the user and the hub share the built-in service-accounts schema (workload-low)
    shared = uid(k8s_plane, "flowschemas", "service-accounts")
    assert classified(k8s_plane, ann_token, pods)[0] == shared
    assert classified(k8s_plane, hub_token, pods)[0] == shared
    anonymous = classified(k8s_plane, "", pods)  # the built-in global-default: beside admins' tools
    assert anonymous[0] != shared and anonymous[0] == uid(k8s_plane, "flowschemas", "global-default")

    with flowcontrol_applied(k8s_plane, hub_ns):
        tenants = (
            uid(k8s_plane, "flowschemas", "tfdist-tenants"),
            uid(k8s_plane, "prioritylevelconfigurations", "tfdist-tenants"),
        )
        hubs = (
            uid(k8s_plane, "flowschemas", "tfdist-hub"),
            uid(k8s_plane, "prioritylevelconfigurations", "workload-high"),
        )
        # the API server's configuration controller picks the new schemas up within moments
        until(
            "the user's requests in tfdist-tenants", lambda: classified(k8s_plane, ann_token, pods) == tenants
        )
        # every request of a user, whatever it asks for (refused ones too: another user's namespace, the
        # cluster's nodes), and every user
        assert classified(k8s_plane, ann_token, f"/api/v1/namespaces/{bob}/secrets") == tenants
        assert classified(k8s_plane, ann_token, "/api/v1/nodes") == tenants
        bob_token = _token(k8s_plane, bob, tenancy.NOTEBOOK_SA)
        assert classified(k8s_plane, bob_token, f"/api/v1/namespaces/{bob}/pods") == tenants
        # a request without a token (refused, but it took its seat first) in the tenants' level too, one
        # flow for all of them; the health endpoints stay in the built-in exempt `probes`
        assert classified(k8s_plane, "", pods) == tenants
        assert classified(k8s_plane, "", "/readyz")[0] == uid(k8s_plane, "flowschemas", "probes")
        # and the hub apart, in workload-high
        assert classified(k8s_plane, hub_token, pods) == hubs
        for name in ("tfdist-tenants", "tfdist-hub"):
            conds = {
                c["type"]: c["status"]
                for c in k8s_plane.get(f"{FC}/flowschemas/{name}")["status"]["conditions"]
            }
            assert conds.get("Dangling") == "False", (name, conds)
