"""One kwok plane with Kueue for every Kueue module of a pytest process that uses it (test_kueue_plane.py,
test_kueue_visibility.py; test_kueue_preemption.py starts its own, its fixture says why): the first
module that asks starts it, the end of their group on this worker stops it (tests/groupend.py). Starting one
costs 13-35 s (60 s on a loaded machine), most of it the API server establishing Kueue's 11 CRDs.

Each module gets the plane bare of what an earlier module left: that module's namespaces (its Jobs, pods
and Workloads with them) and kwok nodes are deleted; Kueue's cluster objects (flavors, cohort,
ClusterQueues) go with the module's own converge, which deletes those its profiles do not name. Modules
share a worker (the ``k8s`` mark: tests/conftest.py), one after the other, so one never sees another's.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tests import kube_plane
from tests.groupend import at_group_end
from tests.kueue_proc import kueue_missing

# namespaces of the plane itself, kept between modules
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease", "kueue-system"})
_shared: dict[str, kube_plane.ControlPlane] = {}
# how long each module waited for the plane: its start, or clearing an earlier module's things
WAITS: list[tuple[str, float]] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def kueue_bin_dir() -> Path:
    """Where the plane's and Kueue's binaries are; skips where any is missing (an error in CI)."""
    bin_dir = kube_plane.find_bin_dir()
    why = ", ".join(kube_plane.missing_binaries(bin_dir)) or kueue_missing()
    if why:
        if _in_ci():
            pytest.fail(f"{why} [CI is set, so this is an error]", pytrace=False)
        pytest.skip(why)
    return bin_dir


def kueue_plane(config: pytest.Config, module: str) -> kube_plane.ControlPlane:
    """The process's plane with Kueue, bare (see above). Skips where the binaries are missing (an error
    in CI)."""
    bin_dir = kueue_bin_dir()
    t0 = time.monotonic()
    plane = _shared.get("plane")
    if plane is None:
        plane = kube_plane.ControlPlane(bin_dir, kueue=True)
        try:
            plane.start()
        except BaseException:
            plane.stop()
            raise
        _shared["plane"] = plane
        config.add_cleanup(_stop)
        at_group_end(_stop)
    else:
        clear(plane)
    WAITS.append((module, time.monotonic() - t0))
    return plane


def clear(plane: kube_plane.ControlPlane, timeout: float = 180.0) -> None:
    """Delete every namespace but the plane's own and wait until they are gone (so that no Job of an
    earlier module makes pods on the next module's nodes), then every node."""
    names = [
        ns["metadata"]["name"]
        for ns in plane.get("/api/v1/namespaces")["items"]
        if ns["metadata"]["name"] not in SYSTEM_NAMESPACES
    ]
    for name in names:
        plane.request("DELETE", f"/api/v1/namespaces/{name}")
    plane._wait(
        f"namespaces {', '.join(names)} deleted",
        time.monotonic() + timeout,
        lambda: not any(plane.get(f"/api/v1/namespaces/{n}") for n in names),
    )
    for node in plane.get("/api/v1/nodes")["items"]:
        plane.request("DELETE", f"/api/v1/nodes/{node['metadata']['name']}")


def _stop() -> None:
    plane = _shared.pop("plane", None)
    if plane is not None:
        print(f"\nthe Kueue plane, seconds each module waited for it: {WAITS}")
        plane.stop()


async def api_client(plane: kube_plane.ControlPlane):
    """An admin's kubernetes_asyncio client for the plane (use as `async with await api_client(plane)`)."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=plane.kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


async def until(what: str, check, timeout: float = 60, every: float = 0.2):
    """`check()`'s first truthy value, polled without blocking the test's event loop."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every)
