"""pytest fixtures for the one-machine cluster with a real node (tests/realnode.py, scripts/cluster).

``real_cluster`` (session): the cluster, started with the same code as ``scripts/cluster up`` (an already
running one is reused and left running), with the small test image (Debian minbase + python3) imported.
Skips unless root and the node binaries exist (``scripts/build-k8s --node``); with TFDIST_REALNODE=1 a
missing prerequisite is an error instead. Tests that take the cluster down call ``real_cluster.ensure()``.
``real_ns`` (function): a fresh namespace whose default ServiceAccount exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests import realnode

REPO = Path(__file__).resolve().parents[1]

# what Pod Security "restricted" asks of a container (the job image's user is uid 1000)
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}


class RealCluster:
    """REST helpers for tests, on top of the state ``realnode.up()`` wrote."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.client = None
        self.base_image = ""

    def ensure(self) -> RealCluster:
        """Up (idempotent), the test image imported; a few seconds when already up."""
        with realnode.locked():
            self.state = realnode.up(build=False)
        self.client = realnode._client(self.state)
        out = subprocess.run(
            [str(REPO / "scripts" / "build-images"), "base", "--import"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if out.returncode != 0:
            raise RuntimeError(f"scripts/build-images base --import failed:\n{out.stderr[-3000:]}")
        self.base_image = json.loads((realnode_images_current()).read_text())["base"]["ref"]
        return self

    # ---- REST
    def request(self, method: str, path: str, body: dict | None = None, **kw):
        return self.client.request(method, path, body, **kw)

    def get(self, path: str):
        return self.client.get(path)

    def create_namespace(self, name: str) -> str:
        return kube_create_namespace(self.client, name)

    def pod(
        self,
        ns: str,
        name: str,
        script: str,
        *,
        labels: dict | None = None,
        restart: str = "Never",
        extra: dict | None = None,
        image: str | None = None,
        limits: dict | None = None,
        restricted: bool = True,
    ) -> dict:
        """Create a pod on the real node running ``python3 -c script`` in the test image; as Pod Security
        `restricted` (user namespaces' level) allows unless `restricted` is False."""
        spec = {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {"kubernetes.io/hostname": realnode.NODE_NAME},
            "containers": [
                {
                    "name": "main",
                    "image": image or self.base_image,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-u", "-c", script],
                    "resources": {"limits": limits or {"cpu": "200m", "memory": "128Mi"}},
                    **({"securityContext": RESTRICTED} if restricted else {}),
                }
            ],
            **(extra or {}),
        }
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}},
            "spec": spec,
        }
        return self.request("POST", f"/api/v1/namespaces/{ns}/pods", body)

    def wait_pod(self, ns: str, name: str, phases: tuple[str, ...], timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        pod = None
        while time.monotonic() < deadline:
            pod = self.get(f"/api/v1/namespaces/{ns}/pods/{name}")
            if pod and pod.get("status", {}).get("phase") in phases:
                return pod
            time.sleep(0.3)
        events = self.get(f"/api/v1/namespaces/{ns}/events") or {}
        msgs = [f"{e.get('reason')}: {e.get('message')}" for e in events.get("items", [])][-8:]
        raise AssertionError(
            f"pod {ns}/{name} not in {phases} after {timeout} s: {(pod or {}).get('status')}\nevents: {msgs}"
        )

    def logs(self, ns: str, name: str) -> str:
        return self.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}/log")

    def run_to_end(self, ns: str, name: str, script: str, timeout: float = 60, **kw) -> tuple[str, str]:
        """(phase, log) of a pod that runs ``script`` to its end."""
        self.pod(ns, name, script, **kw)
        pod = self.wait_pod(ns, name, ("Succeeded", "Failed"), timeout)
        return pod["status"]["phase"], self.logs(ns, name)


def realnode_cli(
    verb: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m tests.realnode VERB` (what scripts/cluster runs), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tests.realnode", verb],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


def realnode_images_current() -> Path:
    cache = Path(os.environ.get("TFDIST_CACHE", Path.home() / ".cache" / "tfdist"))
    return cache / "images" / "current.json"


def kube_create_namespace(client, name: str, timeout: float = 60) -> str:
    client.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    deadline = time.monotonic() + timeout
    while client.get(f"/api/v1/namespaces/{name}/serviceaccounts/default") is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no default ServiceAccount in {name}")
        time.sleep(0.2)
    return name


def _prerequisites() -> str | None:
    if os.geteuid() != 0:
        return "the real-node cluster needs root"
    try:
        miss = realnode.missing_node_binaries() + realnode.missing_packages()
    except Exception as e:  # build-k8s not runnable: report why
        return f"cannot locate the node binaries: {e}"
    if miss:
        return f"missing for the real node: {', '.join(miss)} (run scripts/cluster up once)"
    return None


@pytest.fixture(scope="session")
def real_cluster():
    why = _prerequisites()
    if why:
        if os.environ.get("TFDIST_REALNODE", "") not in ("", "0"):
            pytest.fail(why + " [TFDIST_REALNODE is set, so this is an error]", pytrace=False)
        pytest.skip(why)
    was_up = realnode.status()["healthy"] if realnode.load_state() else False
    cluster = RealCluster()
    try:
        cluster.ensure()
        yield cluster
    finally:
        if not was_up:
            with realnode.locked():
                realnode.down()


@pytest.fixture
def real_ns(real_cluster):
    name = f"rn-{uuid.uuid4().hex[:8]}"
    real_cluster.create_namespace(name)
    yield name
    try:
        real_cluster.request("DELETE", f"/api/v1/namespaces/{name}")
    except Exception:  # the cluster may be down already (teardown tests)
        pass


_JOB_IMAGES: dict[float, str] = {}  # the cluster's start time -> the job image imported into it


@pytest.fixture(scope="module")
def job_image(real_cluster) -> str:
    """The job image of this checkout, in the node's containerd (tests/realnode_jobs.build_job_image).
    Built once per cluster in a session (a wheel build each module cost several seconds on 2 cores); a
    cluster brought up again (a teardown test took it down) gets it imported again."""
    from tests.realnode_jobs import build_job_image

    real_cluster.ensure()  # up again if an earlier module's teardown test took it down
    started = real_cluster.state.get("started", 0.0)
    if started not in _JOB_IMAGES:
        _JOB_IMAGES[started] = build_job_image()
    return _JOB_IMAGES[started]


@pytest.fixture
def tenants(real_cluster, tmp_path):
    """make(prefix): a user namespace prepared as the spawner does (tests/realnode_jobs.make_tenant);
    every one made is dropped afterwards."""
    from tests.realnode_jobs import drop_tenant, make_tenant

    made = []

    def make(prefix: str):
        t = make_tenant(real_cluster, prefix, tmp_path)
        made.append(t)
        return t

    yield make
    for t in made:
        drop_tenant(real_cluster, t)
