"""A user's place in Kueue's line counts the other users' jobs: Kueue's visibility API on the kwok plane.

One plane for the module (``ControlPlane(kueue=True)``: its API server with aggregation, Kueue's visibility
server behind an APIService), one 8-GPU H100 node, one queue of 8 H100s shared by two users. Each user has
the spawner's queue Role (tfdist.kube.tenancy.QUEUE_RULES) bound to their notebook's service account, and
every read of the line here is made with that account's own token, as the user's kernel makes it.

A user may list only their own namespace's Workloads, so the place computed from them ignores the other
user's pending jobs: the test asserts that too-optimistic answer beside the visibility API's right one.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import ssl
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from tests.kueue_fixtures import api_client, kueue_plane, until
from tests.kueue_proc import APISERVICE, VISIBILITY_DIR
from tests.test_k8s_escapes import call
from tests.test_k8s_tenancy import _api_for_token, _token
from tfdist.backends.base import Launch
from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.jobspec import JobSpec
from tfdist.kube import names as kn
from tfdist.kube import queueing_apply as qa
from tfdist.kube import queueline as ql
from tfdist.kube import tenancy
from tfdist.settings import from_environ
from tfdist.spawner.profiles import parse_profiles

pytestmark = [pytest.mark.k8s]
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
QUEUE = "team"
ANN, BOB = "kv-ann", "kv-bob"
VIS = "/apis/visibility.kueue.x-k8s.io/v1beta2"
PROFILES = {
    "gpu_models": {"h100": {"display_name": "H100", "node_selector": H100}},
    "kueue": {"cohort": "pool", "queues": {QUEUE: {"cpu": 32, "gpus": {"h100": 8}}}},
    "profiles": [
        {
            "slug": "gpu",
            "display_name": "GPU",
            "groups": ["ml"],
            "cpu": {"min": 1, "max": 8, "default": 1},
            "memory_gib": {"min": 1, "max": 8, "default": 1},
            "gpus": {"max": 8},
            "gpu_models": ["h100"],
            "kueue_queue": QUEUE,
            "images": ["img"],
        }
    ],
}
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def kv(request):
    """The process's one plane with Kueue (tests/kueue_fixtures.py: its visibility server behind an
    APIService), with this module's node, two users of one queue and their Roles."""
    t0 = time.monotonic()
    plane = kueue_plane(request.config, __name__)
    try:
        TIMES["plane_with_kueue_s"] = time.monotonic() - t0
        TIMES["visibility_wait_s"] = plane.kueue.visibility_seconds or 0.0
        plane.add_gpu_nodes(1, 8, H100["nvidia.com/gpu.product"])
        for u in (ANN, BOB):
            plane.create_namespace(u)
            p = tenancy.TenantPolicy(user=u, namespace=u)
            for obj in (tenancy.service_account(p), tenancy.queue_role(p), tenancy.queue_role_binding(p)):
                kind = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}
                base = "/api/v1" if obj["kind"] == "ServiceAccount" else "/apis/rbac.authorization.k8s.io/v1"
                plane.request("POST", f"{base}/namespaces/{u}/{kind[obj['kind']]}", obj)

        async def setup():
            async with await api_client(plane) as api:
                cfg = parse_profiles(PROFILES)
                await qa.converge(api, cfg)
                for u in (ANN, BOB):
                    await qa.converge_user(api, cfg, u, ["ml"])

        asyncio.run(setup())
        # Kueue's visibility server answers from its queue cache, which learns a new LocalQueue a moment
        # after the API server has it (until then: 404 for that queue)
        deadline = time.monotonic() + 60
        for u in (ANN, BOB):
            while plane.get(f"{VIS}/namespaces/{u}/localqueues/{QUEUE}/pendingworkloads") is None:
                assert time.monotonic() < deadline, f"Kueue never served {u}'s LocalQueue {QUEUE}"
                time.sleep(0.2)
        yield plane
    finally:
        print(f"\nkueue visibility plane timings: {TIMES}")


def backend(plane, ns: str) -> KubernetesBackend:
    b = KubernetesBackend(
        from_environ(
            {
                "TFDIST_NAMESPACE": ns,
                "TFDIST_WORKER_IMAGE": "example.org/tfdist-job:1",
                "USER": ns,
                "TFDIST_KUEUE_QUEUE": QUEUE,
            }
        ),
        kubeconfig=plane.kubeconfig,
    )
    b.node_selector = H100
    return b


def eight_gpus(name: str, ns: str) -> JobSpec:
    """A job of the whole queue: 2 workers x 4 GPUs and a PS (one Workload of 4 pods)."""
    return JobSpec(
        name=name,
        user=ns,
        namespace=ns,
        backend="kubernetes",
        timeout_s=300,
        workers=2,
        ps=1,
        gpus_per_worker=4,
    )


def pods(plane, ns: str, job: str) -> list[dict]:
    return plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={kn.L_JOB}%3D{job}")["items"]


def workload(plane, ns: str, name: str) -> dict | None:
    return plane.get(f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/{name}")


def pending(plane, ns: str, name: str) -> bool:
    wl = workload(plane, ns, name)
    return wl is not None and not ql.is_admitted(wl)


def test_a_user_reads_their_own_local_queue_and_nothing_wider(kv):
    """With the user's own token: the ClusterQueue's pending list (every team's workload names) and
    another user's LocalQueue are refused; their own LocalQueue is read."""
    token = _token(kv, BOB, tenancy.NOTEBOOK_SA)
    own = call(kv, token, "GET", f"{VIS}/namespaces/{BOB}/localqueues/{QUEUE}/pendingworkloads")
    assert own[0] == 200, own
    for path in (
        f"{VIS}/clusterqueues/{QUEUE}/pendingworkloads",
        f"{VIS}/namespaces/{ANN}/localqueues/{QUEUE}/pendingworkloads",
        f"{VIS}/namespaces/{BOB}/localqueues",  # list: not granted either
    ):
        code, body = call(kv, token, "GET", path)
        assert code == 403, (path, code, body)
        assert "forbidden" in body.get("message", ""), body


def test_the_visibility_server_is_behind_a_verified_apiservice(kv):
    """The APIService trusts the serving certificate's CA (no insecureSkipTLSVerify) and routes to a
    non-loopback endpoint of this host; the certificate Kueue serves is the one in /visibility."""
    svc = kv.get(f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}")
    assert svc["spec"].get("caBundle") and not svc["spec"].get("insecureSkipTLSVerify")
    assert any(c["type"] == "Available" and c["status"] == "True" for c in svc["status"]["conditions"])
    address, port = kv.kueue.visibility
    assert not ipaddress.ip_address(address).is_loopback
    served = x509.load_pem_x509_certificate(ssl.get_server_certificate((address, port)).encode())
    leaf, ca = x509.load_pem_x509_certificates((VISIBILITY_DIR / "apiserver.crt").read_bytes())
    assert served == leaf and base64.b64decode(svc["spec"]["caBundle"]) == ca.public_bytes(Encoding.PEM)
    assert served.issuer == ca.subject


async def test_place_in_line_counts_the_other_users_pending_jobs(kv):
    """Ann's job holds the 8 GPUs; Ann's second job, then Bob's, wait. Bob reads his place with his own
    token: 2nd, one ahead (Ann's), from the visibility API; what his own Workloads alone say is 1st, and
    that is what read_position says once the APIService is gone. Runs last: it removes the APIService."""
    assert kv.kueue.visibility is not None, "Kueue's visibility server is off on this plane"
    a, b = backend(kv, ANN), backend(kv, BOB)
    try:
        await a.submit(eight_gpus("first", ANN), b"p", Launch())
        await until("ann's first job admitted", lambda: ql.is_admitted(workload(kv, ANN, "first") or {}), 90)
        await a.submit(eight_gpus("second", ANN), b"p", Launch())
        await until("ann's second job pending", lambda: pending(kv, ANN, "second"), 90)
        # Kueue orders a queue by the Workloads' creation time in whole seconds (the same second: any
        # order; CI on c2bf044 put Bob's first), so Bob submits in a later second than Ann's Workload
        await asyncio.sleep(1.1)
        await b.submit(eight_gpus("late", BOB), b"p", Launch())
        await until("bob's job pending", lambda: pending(kv, BOB, "late"), 90)

        bob_token = _token(kv, BOB, tenancy.NOTEBOOK_SA)
        async with _api_for_token(kv, bob_token) as bob_api:
            t0 = time.monotonic()
            pos = await until_position(bob_api, BOB, "late", lambda p: p.position == 2)
            TIMES["bob_position_read_s"] = time.monotonic() - t0
            assert (pos.position, pos.ahead, pos.source, pos.queue) == (2, 1, "visibility", QUEUE)
            assert pos.event().sentence() == f"queued: 2nd in {QUEUE}"
            # the old answer: Bob's own Workloads are all he may list, so Ann's pending job is not there
            code, mine = call(
                kv, bob_token, "GET", f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{BOB}/workloads"
            )
            assert code == 200 and [w["metadata"]["name"] for w in mine["items"]] == ["late"]
            fallback = ql.position_from_workloads(mine["items"], "late", BOB)
            assert (fallback.position, fallback.ahead, fallback.source) == (1, 0, "workloads")
            # what Bob reads of his LocalQueue: his job with its place in the whole ClusterQueue. Kueue
            # v0.17.0 also lists the pending jobs of every other namespace's LocalQueue of the same name
            # (pending_workloads_lq.go compares the queue name alone: kubernetes-sigs/kueue#10575, fixed
            # after v0.17.0), and every user's LocalQueue here is named after the queue: Ann's job's name
            # and namespace show (docs/security.md). An upgrade that fixes it fails here: update the docs.
            code, summary = call(
                kv, bob_token, "GET", f"{VIS}/namespaces/{BOB}/localqueues/{QUEUE}/pendingworkloads"
            )
            assert code == 200, summary
            listed = [
                (w["metadata"]["namespace"], w["metadata"]["name"], w["positionInClusterQueue"])
                for w in summary["items"]
            ]
            assert listed == [(ANN, "second", 0), (BOB, "late", 1)]

        ann_token = _token(kv, ANN, tenancy.NOTEBOOK_SA)
        async with _api_for_token(kv, ann_token) as ann_api:
            pos = await until_position(ann_api, ANN, "second", lambda p: p.source == "visibility")
            assert (pos.position, pos.ahead, pos.source) == (1, 0, "visibility")

        # the same line without the visibility API (as on a cluster without it; last, this plane keeps it
        # off): read_position falls back to Bob's own Workloads, 1st of them, and says that is all it is
        # (it said "queued: 1st in <queue>" with Ann's job ahead)
        kv.request("DELETE", f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}")
        async with _api_for_token(kv, bob_token) as bob_api:
            pos = await until_position(bob_api, BOB, "late", lambda p: p.source == "workloads")
            assert (pos.position, pos.ahead) == (1, 0)
            said = pos.event().sentence()
            assert said.startswith(f"queued: 1st of your jobs in {QUEUE} (other users' jobs"), said
    finally:
        for x, jobs in ((b, ("late",)), (a, ("second", "first"))):
            for job in jobs:
                await x.stop(job)
            await x.close()
    await until(
        "the jobs gone", lambda: not any(pods(kv, ns, j) for ns, j in [(ANN, "first"), (BOB, "late")])
    )


async def until_position(api, ns: str, job: str, ok, timeout: float = 30) -> ql.QueuePosition:
    """read_position until ``ok`` (Kueue's queue snapshot follows its informers by a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        pos = await qa.read_position(api, ns, job, QUEUE)
        if pos is not None and ok(pos):
            return pos
        assert time.monotonic() < deadline, f"{ns}/{job}: {pos}"
        await asyncio.sleep(0.3)
