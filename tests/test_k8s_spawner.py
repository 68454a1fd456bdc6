"""The Kubernetes spawner against the real local control plane (tests/kube_plane.py): issue 4, section 3.

- ClusterGpuView: free GPUs per model = nodes' allocatable minus GPU requests of bound, live pods, kept
  current by one list + one watch per kind; a form render never calls the API server.
- TfdistKubeSpawner (real KubeSpawner start/progress/stop): the real scheduler places a 2 x H100 spawn
  on an H100 kwok node (kwok makes it Running with a pod IP, which is all KubeSpawner.start waits for);
  with the H100s fragmented (more free in total than on any one node) a request above the per-node
  maximum is refused by validation (400 with the message; form re-rendered) instead of going Pending;
  a validated spawn whose node is taken by a racing pod stays Pending and its progress shows the
  scheduler's message.
- hub_config/rbac-notebook.yaml, exercised with the service account's own token: the %%tfdist
  Kubernetes backend's objects can be created, watched and deleted in its namespace, nothing elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import re
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from tornado import web

if "tests.k8s_fixtures" not in sys.modules:  # tests/conftest.py imports them; standalone runs need this
    from tests.k8s_fixtures import k8s_api, k8s_namespace, k8s_plane  # noqa: F401

sys.path.insert(0, str(Path(__file__).parent / "doubles"))
from hub_objects import FakeGroup, FakeHub, FakeHubUser

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "hub_config" / "profiles.yaml"
RBAC_NOTEBOOK = REPO / "hub_config" / "rbac-notebook.yaml"
H100 = "NVIDIA-H100-80GB-HBM3"
A100_80 = "NVIDIA-A100-SXM4-80GB"
PRODUCT = "nvidia.com/gpu.product"
GPU = "nvidia.com/gpu"
IMAGE = "quay.io/jupyter/tensorflow-notebook:cuda-2026-06-01"


async def no_foreign_gpu_pods(core: Any, ns: str) -> bool:
    pods = (await core.list_pod_for_all_namespaces()).items
    return not [
        p
        for p in pods
        if p.metadata.namespace != ns
        and any((c.resources.limits or {}).get(GPU) for c in p.spec.containers if c.resources)
    ]


async def wait_for(what: str, probe: Any, timeout: float = 30.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def gpu_pod(name: str, gpus: int, *, model: str | None = None, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {"name": "main", "image": "example.invalid/x:1", "resources": {"limits": {GPU: str(gpus)}}}
        ],
    }
    if model:
        spec["nodeSelector"] = {PRODUCT: model}
    if node:
        spec["nodeName"] = node  # bypasses the scheduler: kwok runs it there
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def free_per_node(core: Any, product: str) -> dict[str, int]:
    """Free GPUs per node of `product`, computed independently, straight from the API: allocatable minus
    requests (the plane's GPU nodes are all schedulable and carry no taints)."""
    nodes = [n for n in (await core.list_node()).items if (n.metadata.labels or {}).get(PRODUCT) == product]
    free = {n.metadata.name: int(n.status.allocatable.get(GPU, 0)) for n in nodes}
    for p in (await core.list_pod_for_all_namespaces()).items:
        if p.spec.node_name in free and p.status.phase not in ("Succeeded", "Failed"):
            for c in p.spec.containers:
                res = c.resources
                req = (res.requests or {}) if res else {}
                lim = (res.limits or {}) if res else {}
                free[p.spec.node_name] -= int(req.get(GPU, lim.get(GPU, 0)))
    return free


async def expected_gpus(core: Any, product: str) -> tuple[int, int]:
    """(free, total) computed independently, straight from the API: allocatable minus requests."""
    nodes = [n for n in (await core.list_node()).items if (n.metadata.labels or {}).get(PRODUCT) == product]
    total = sum(int(n.status.allocatable.get(GPU, 0)) for n in nodes)
    return sum(max(v, 0) for v in (await free_per_node(core, product)).values()), total


class CountingCoreV1:
    """A CoreV1Api whose list_* calls are counted, split into plain lists and watches (watch=True)."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.lists: Counter[str] = Counter()
        self.watches: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._core, name)
        if not name.startswith("list_"):
            return fn

        @functools.wraps(fn)  # kubernetes_asyncio's Watch reads the return type from the docstring
        async def call(*args: Any, **kwargs: Any) -> Any:
            (self.watches if kwargs.get("watch") else self.lists)[name] += 1
            return await fn(*args, **kwargs)

        return call


def models() -> dict[str, Any]:
    from tfdist.spawner.profiles import GpuModel, load_profiles

    out = dict(load_profiles(PROFILES).gpu_models)
    # hub_config's a100 is the 40 GB part; the plane's A100 nodes are 80 GB
    out["a100-80"] = GpuModel(display_name="A100 80GB", node_selector={PRODUCT: A100_80})
    return out


# ---------------------------------------------------------------------------------------------- 1. the view


async def test_gpu_view_is_watch_fed_allocatable_minus_requested(k8s_plane, k8s_api, k8s_namespace):
    from kubernetes_asyncio import client

    from tfdist.spawner.availability import ClusterGpuView

    core = client.CoreV1Api(k8s_api)
    counting = CountingCoreV1(core)
    # 1 s watches: the server ends each one quickly, and the view must resume it without listing again
    view = ClusterGpuView(counting, watch_timeout=1)
    ms = models()
    view.start()
    try:
        await wait_for("view loaded", lambda: view.loaded)
        h_free, h_total = await expected_gpus(core, H100)
        av = view.availability(ms)
        assert (av["h100"].free, av["h100"].total) == (h_free, h_total)
        assert h_total >= 16
        a_free, a_total = await expected_gpus(core, A100_80)
        assert (av["a100-80"].free, av["a100-80"].total) == (a_free, a_total) and a_total >= 8
        assert av["a100"].total == 0  # no A100 40GB nodes in this cluster

        await core.create_namespaced_pod(k8s_namespace, gpu_pod("three", 3, model=H100))
        await wait_for("view: 3 H100 GPUs fewer", lambda: view.availability(ms)["h100"].free == h_free - 3)
        assert (await expected_gpus(core, H100))[0] == h_free - 3
        pod = await core.read_namespaced_pod("three", k8s_namespace)
        assert (await core.read_node(pod.spec.node_name)).metadata.labels[PRODUCT] == H100
        # many form renders between two cluster changes: the same cached result, no API call
        first = view.availability(ms)
        assert all(view.availability(ms) is first for _ in range(100))

        await core.delete_namespaced_pod("three", k8s_namespace, grace_period_seconds=0)
        await wait_for("view: the 3 GPUs back", lambda: view.availability(ms)["h100"].free == h_free)
        await wait_for("resumed watches", lambda: min(counting.watches.values(), default=0) >= 3, timeout=10)
        # every change above came through the watches: exactly one list per kind, ever
        assert counting.lists == Counter({"list_node": 1, "list_pod_for_all_namespaces": 1}), counting.lists
        assert set(counting.watches) == {"list_node", "list_pod_for_all_namespaces"}
    finally:
        await view.stop()


# ------------------------------------------------------------------------------------------ 2. the spawner


@pytest.fixture
def plane_kubeconfig(k8s_plane, monkeypatch):
    """Point KubeSpawner's global client configuration at the plane; restore it afterwards."""
    import kubernetes_asyncio.config.kube_config as kc
    from kubernetes_asyncio.client import Configuration
    from kubespawner.clients import load_config

    saved = Configuration.get_default_copy()
    monkeypatch.setenv("KUBECONFIG", k8s_plane.kubeconfig)
    monkeypatch.setattr(kc, "KUBE_CONFIG_DEFAULT_LOCATION", k8s_plane.kubeconfig)
    load_config.cache_clear()  # lru_cached: another test may have loaded a different kubeconfig
    yield
    load_config.cache_clear()
    Configuration.set_default(saved)


def apply_notebook_rbac(k8s_plane, namespace: str) -> None:
    k8s_plane.kubectl("-n", namespace, "apply", "-f", str(RBAC_NOTEBOOK))


def make_spawner(name: str, namespace: str, **traits: Any) -> Any:
    from tfdist.spawner.kube import TfdistKubeSpawner

    user = FakeHubUser(name=name, groups=[FakeGroup("ml-team")])
    sp = TfdistKubeSpawner(
        user=user,
        hub=FakeHub(),
        profiles_file=str(PROFILES),
        namespace=namespace,
        **({"enable_user_namespaces": False} | traits),  # one shared test namespace unless asked
        service_account="tfdist-notebook",
        start_timeout=45,
        k8s_api_request_retry_timeout=20,
    )
    sp.api_token = "secret-token"
    user.spawners[""] = sp
    return sp


def gpu_options(gpus: int) -> dict[str, Any]:
    return {"profile": "gpu", "cpu": 2, "memory": 8, "gpus": gpus, "gpu_model": "h100", "image": IMAGE}


async def test_spawn_placed_refused_beyond_one_node_and_raced_spawn_pending(
    k8s_plane, k8s_api, k8s_namespace, plane_kubeconfig, monkeypatch
):
    from kubernetes_asyncio import client
    from kubespawner import KubeSpawner

    from tfdist.spawner import kube
    from tfdist.spawner.availability import ClusterGpuView

    ns = k8s_namespace
    core = client.CoreV1Api(k8s_api)
    apply_notebook_rbac(k8s_plane, ns)  # the pods run as tfdist-notebook: the SA must exist
    view = ClusterGpuView(core)
    view.start()
    monkeypatch.setattr(kube, "_view", view)  # the hub's shared view, on this test's event loop
    alice = make_spawner("alice", ns)
    bob = make_spawner("bob", ns)
    bob_start: asyncio.Future[Any] | None = None
    try:
        await wait_for("view loaded", lambda: view.loaded)
        # The plane is shared by the session: GPU pods of earlier tests may still be going away, and this test
        # counts free GPUs exactly. Start once no other namespace holds a GPU pod.
        await wait_for("no GPU pods of other tests", lambda: no_foreign_gpu_pods(core, ns), timeout=90)
        h_free, _ = await expected_gpus(core, H100)

        opts = gpu_options(2)
        alice.user_options = opts
        await alice._run_apply_user_options(opts)  # what JupyterHub's User.spawn calls: validated
        url = await asyncio.wait_for(alice.start(), 60)
        pod = await core.read_namespaced_pod(alice.pod_name, ns)
        assert pod.status.phase == "Running" and url == f"http://{pod.status.pod_ip}:8888"
        node = await core.read_node(pod.spec.node_name)
        assert node.metadata.labels[PRODUCT] == H100
        limits = pod.spec.containers[0].resources.limits
        assert limits[GPU] == "2" and pod.spec.service_account_name == "tfdist-notebook"
        ms = models()
        await wait_for("view: alice's 2 GPUs", lambda: view.availability(ms)["h100"].free == h_free - 2)

        # Fragment the H100s so that >= 8 are free in total but no node has 8 free.
        other = next(
            n.metadata.name
            for n in (await core.list_node(label_selector=f"{PRODUCT}={H100}")).items
            if n.metadata.name != pod.spec.node_name
        )
        await core.create_namespaced_pod(ns, gpu_pod("filler", 3, node=other))
        await wait_for("view: filler counted", lambda: view.availability(ms)["h100"].free == h_free - 5)
        per_node = await free_per_node(core, H100)
        free, most = sum(per_node.values()), max(per_node.values())
        assert free == h_free - 5 >= 8 > most
        av = view.availability(ms)["h100"]
        assert (av.free, av.max_on_node) == (free, most)

        # An 8-GPU request is refused up front with the per-node message (REST path: 400, no pod), and the
        # form path gives the same message and shows the per-node number on the re-rendered form.
        why = (
            f"at most {most} NVIDIA H100 80GB GPUs are free on one node now "
            f"({free} free in total across nodes)"
        )
        opts = gpu_options(8)
        bob.user_options = opts
        with pytest.raises(web.HTTPError) as refused:
            await bob._run_apply_user_options(opts)
        assert refused.value.status_code == 400 and why in refused.value.jupyterhub_message
        assert bob.tfdist_choice is None
        form = {k: [str(v)] for k, v in opts.items()}
        with pytest.raises(web.HTTPError) as refused:
            await bob._tfdist_options_from_form(form)
        assert refused.value.status_code == 400 and why in refused.value.jupyterhub_message
        html = await bob.tfdist_render_form()
        assert f"NVIDIA H100 80GB: {free} of {av.total} free (at most {most} on one node)" in html
        assert re.search(r'id="tfdist-gpu-gpus"[^>]*value="8"', html)  # what bob typed, back for fixing
        assert not (await core.list_namespaced_pod(ns, field_selector=f"metadata.name={bob.pod_name}")).items

        # Validation is a snapshot; the scheduler has the last word. Bob asks for exactly the most free on
        # one node, which validation accepts; before his pod is created another pod takes one GPU on every
        # node that had that many free (a race no check at validation time can close), so the pod cannot be
        # placed: it stays Pending and its progress shows the scheduler's message.
        opts = gpu_options(most)
        bob.user_options = opts
        await bob._run_apply_user_options(opts)
        assert bob.tfdist_choice is not None and bob.tfdist_choice.gpus == most
        racers = [n for n, f in per_node.items() if f == most]
        for i, n in enumerate(racers):
            await core.create_namespaced_pod(ns, gpu_pod(f"racer-{i}", 1, node=n))
        await wait_for(
            "view: racers counted", lambda: view.availability(ms)["h100"].free == free - len(racers)
        )
        assert view.availability(ms)["h100"].max_on_node == most - 1
        bob_start = bob.start()  # validated before the race: start() does not validate again
        seen: list[str] = []

        async def scheduler_message() -> str:
            async for ev in bob.progress():
                seen.append(ev.get("message", ""))
                if "Insufficient nvidia.com/gpu" in seen[-1]:
                    return seen[-1]
            return ""

        message = await asyncio.wait_for(scheduler_message(), 30)
        assert "FailedScheduling" in str(seen) or "Warning" in message, seen
        bob_pod = await core.read_namespaced_pod(bob.pod_name, ns)
        assert bob_pod.status.phase == "Pending" and not bob_pod.spec.node_name
        assert not bob_start.done()  # still waiting for the pod to run
    finally:
        if bob_start is not None and not bob_start.done():
            bob_start.cancel()
            with pytest.raises(asyncio.CancelledError):
                await bob_start
        for sp in (bob, alice):
            await asyncio.wait_for(sp.stop(now=True), 30)
        for name in (bob.pod_name, alice.pod_name):
            assert f"{ns}/{name}" not in alice.pod_reflector.pods
        await view.stop()
        await KubeSpawner._stop_all_reflectors()  # class-level singletons bound to this event loop


async def test_spawn_in_the_users_own_namespace_prepared_from_the_profile(
    k8s_plane, k8s_api, plane_kubeconfig
):
    """The default: each user in their own namespace, created and converged from the profile on every spawn
    (quota from max_gpus_per_user and the jobs block, Role, default deny, admission parameters)."""
    from kubernetes_asyncio import client
    from kubespawner import KubeSpawner

    from tfdist.kube import tenancy

    prefix = f"u-{uuid.uuid4().hex[:6]}"
    sp = make_spawner(
        "carol", "unused", enable_user_namespaces=True, user_namespace_template=prefix + "-{username}"
    )
    ns = f"{prefix}-carol"
    core = client.CoreV1Api(k8s_api)
    assert sp.namespace == ns
    try:
        opts = gpu_options(1)
        sp.user_options = opts
        await sp._run_apply_user_options(opts)
        await asyncio.wait_for(sp.start(), 60)
        pod = await core.read_namespaced_pod(sp.pod_name, ns)
        assert pod.spec.service_account_name == tenancy.NOTEBOOK_SA
        labels = (await core.read_namespace(ns)).metadata.labels
        assert labels[tenancy.L_TENANT] == "true"
        quota = await core.read_namespaced_resource_quota(tenancy.QUOTA, ns)
        # profiles.yaml "gpu": max_gpus_per_user 8 on each resource of its models (GPUs and MIG slices)
        assert quota.spec.hard["requests.nvidia.com/gpu"] == "8" and quota.spec.hard["pods"] == "32"
        assert quota.spec.hard["requests.nvidia.com/mig-1g.10gb"] == "8"
        params = (await core.read_namespaced_config_map(tenancy.POLICY_PARAMS, ns)).data
        assert params["queue"] == "ml-team" and params["nodeSelector"] == f"{PRODUCT}={H100}"
        roles = await client.RbacAuthorizationV1Api(k8s_api).read_namespaced_role(tenancy.NOTEBOOK_SA, ns)
        assert [r.verbs for r in roles.rules] == [r["verbs"] for r in tenancy.NOTEBOOK_RULES]
        await asyncio.wait_for(sp.stop(now=True), 30)
        # the next spawn (another choice) converges the same namespace: CPU-only now, so GPU parameters go
        opts = {
            "profile": "cpu",
            "cpu": 1,
            "memory": 2,
            "image": "quay.io/jupyter/tensorflow-notebook:2026-06-01",
        }
        sp.user_options = opts
        await sp._run_apply_user_options(opts)
        await asyncio.wait_for(sp.start(), 60)
        quota = await core.read_namespaced_resource_quota(tenancy.QUOTA, ns)
        assert quota.spec.hard["requests.nvidia.com/gpu"] == "0"
        params = (await core.read_namespaced_config_map(tenancy.POLICY_PARAMS, ns)).data
        assert params["gpuResource"] == "" and params["queue"] == ""
    finally:
        await asyncio.wait_for(sp.stop(now=True), 30)
        await KubeSpawner._stop_all_reflectors()
        try:
            k8s_plane.request("DELETE", f"/api/v1/namespaces/{ns}")
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------- 3. RBAC


async def test_notebook_rbac_with_its_own_token(k8s_plane, k8s_api, k8s_namespace):
    from kubernetes_asyncio import client, watch
    from kubernetes_asyncio.client.exceptions import ApiException

    from tfdist.jobspec import JobSpec
    from tfdist.kube import names as kn

    ns_a = k8s_namespace
    ns_b = k8s_plane.create_namespace(f"t-{uuid.uuid4().hex[:10]}")
    admin = client.CoreV1Api(k8s_api)
    try:
        apply_notebook_rbac(k8s_plane, ns_a)
        token = k8s_plane.request(
            "POST",
            f"/api/v1/namespaces/{ns_a}/serviceaccounts/tfdist-notebook/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 600},
            },
        )["status"]["token"]
        cfg = client.Configuration(host=k8s_plane.server)
        cfg.ssl_ca_cert = str(k8s_plane.ca_file)
        cfg.api_key = {"BearerToken": token}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
        # a pod in B for the read/delete/log checks there
        await admin.create_namespaced_pod(ns_b, gpu_pod("other", 0))

        async with client.ApiClient(cfg) as api:
            core = client.CoreV1Api(api)
            authz = client.AuthorizationV1Api(api)
            me = await client.AuthenticationV1Api(api).create_self_subject_review(
                {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
            )
            assert me.status.user_info.username == f"system:serviceaccount:{ns_a}:tfdist-notebook"

            async def status_of(coro: Any) -> int:
                try:
                    await coro
                except ApiException as e:
                    return int(e.status)
                return 200

            async def can(verb: str, resource: str, ns: str, sub: str = "", group: str = "") -> bool:
                attrs = {
                    "namespace": ns,
                    "verb": verb,
                    "resource": resource,
                    "subresource": sub,
                    "group": group,
                }
                body = {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": attrs},
                }
                return bool((await authz.create_self_subject_access_review(body)).status.allowed)

            # what the notebook may NOT do, in its own namespace
            assert not await can("create", "pods", ns_a)  # the Job controller creates the job's pods
            assert not await can("patch", "pods", ns_a) and not await can("update", "pods", ns_a)
            assert not await can("patch", "jobs", ns_a, group="batch")
            assert not await can("list", "secrets", ns_a) and not await can("get", "secrets", ns_a)
            assert not await can("deletecollection", "secrets", ns_a)
            # ---- namespace B: nothing
            for verb, res, group in (
                ("create", "jobs", "batch"),
                ("list", "jobs", "batch"),
                ("delete", "jobs", "batch"),
                ("create", "secrets", ""),
                ("create", "services", ""),
                ("list", "pods", ""),
            ):
                assert not await can(verb, res, ns_b, group=group), (verb, res)
            assert await status_of(core.read_namespaced_pod("other", ns_b)) == 403
            assert await status_of(core.read_namespaced_pod_log("other", ns_b)) == 403
            assert await status_of(core.delete_namespaced_pod("other", ns_b)) == 403
            w = watch.Watch()
            with pytest.raises(ApiException) as e:
                async with w.stream(core.list_namespaced_pod, ns_b, timeout_seconds=2) as s:
                    async for _ in s:
                        pass
            assert e.value.status == 403
            # nor cluster-wide
            assert await status_of(core.list_pod_for_all_namespaces()) == 403
            assert await status_of(core.list_node()) == 403

        # ---- namespace A: the %%tfdist backend itself, with this token: everything it does is allowed
        import yaml

        from tfdist.backends.base import Launch
        from tfdist.backends.kubernetes import KubernetesBackend
        from tfdist.errors import BackendUnavailable
        from tfdist.settings import from_environ

        kc = yaml.safe_load(open(k8s_plane.kubeconfig))
        kc["users"] = [{"name": "nb", "user": {"token": token}}]
        kc["contexts"][0]["context"]["user"] = "nb"
        kc_path = Path(k8s_plane.workdir) / f"nb-{ns_a}.kubeconfig"
        kc_path.touch(mode=0o600)  # a token: private as the plane's own (test_cluster_hardening.py checks)
        kc_path.write_text(yaml.safe_dump(kc))

        def nb_backend(ns: str) -> KubernetesBackend:
            env = {"TFDIST_NAMESPACE": ns, "TFDIST_WORKER_IMAGE": "busybox", "TFDIST_USER": "u"}
            return KubernetesBackend(from_environ(env), kubeconfig=str(kc_path))

        b = nb_backend(ns_a)
        b.lifeline_renew_s = 0.5  # renew (update the root Job) a few times during the test
        try:
            await b.submit(JobSpec(name="j1", user="u", backend="kubernetes"), b"payload", Launch())
            running = None
            async for ev in b.watch("j1"):
                if ev.type == "state" and ev.state in ("running", "failed"):
                    running = ev
                    break
            assert running is not None and running.state == "running", running
            assert [j.name for j in await b.list_jobs()] == ["j1"]
            assert (await b.status("j1")).state == "running"
            logs = await b.logs("j1")  # kwok serves no logs; the authorization is what counts
            assert set(logs) == {"chief-0", "worker-0", "worker-1", "ps-0"}
            assert not any("Forbidden" in v for v in logs.values()), logs
            await asyncio.sleep(2)
            root = (await client.BatchV1Api(k8s_api).read_namespaced_job("j1", ns_a)).spec
            assert root.active_deadline_seconds and root.active_deadline_seconds >= 60  # renewed
            assert await b.stop("j1")
        finally:
            await b.close()
        other = nb_backend(ns_b)
        with pytest.raises(BackendUnavailable, match="needs the tfdist Role"):
            await other.submit(JobSpec(name="j1", user="u", backend="kubernetes"), b"p", Launch())
        await other.close()
        sel = f"{kn.L_JOB}=j1"

        # nothing of the job left in A (pods may linger while kwok finishes their deletion)
        async def gone() -> bool:
            left = await admin.list_namespaced_pod(ns_a, label_selector=sel)
            secrets = await admin.list_namespaced_secret(ns_a, label_selector=sel)
            svcs = await admin.list_namespaced_service(ns_a, label_selector=sel)
            pols = await client.NetworkingV1Api(k8s_api).list_namespaced_network_policy(
                ns_a, label_selector=sel
            )
            jobs = await client.BatchV1Api(k8s_api).list_namespaced_job(ns_a, label_selector=sel)
            return not (left.items or secrets.items or svcs.items or pols.items or jobs.items)

        await wait_for("job objects deleted", gone, timeout=30)
        assert (await admin.read_namespaced_pod("other", ns_b)).metadata.name == "other"
    finally:
        try:
            k8s_plane.request("DELETE", f"/api/v1/namespaces/{ns_b}")
        except Exception:
            pass
