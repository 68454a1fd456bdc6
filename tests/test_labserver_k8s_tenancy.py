"""Issue 9, the lab panel side: two users' jobs of the same name, each in the user's own namespace, seen
through each user's own Jupyter server (the panel's REST routes, a real `jupyter server` process with the
installed extension and the Kubernetes backend, each with its user's notebook token). Each panel lists only
its user's job, stops only it, and after that cannot reach the other user's job of that name.

On the kwok test plane (tests/k8s_fixtures.py) with hub_config/'s admission policy and hub RBAC applied
(the fixtures of tests/test_k8s_tenancy.py)."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest

from tests import test_k8s_tenancy
from tests.kernels import kernel_env
from tests.test_k8s_backend import private_agent_port  # noqa: F401
from tests.test_k8s_tenancy import GPU_ENV, IMAGE, _backend, _left, _user_kubeconfig
from tests.test_lab_browser import Lab, free_port
from tfdist.backends.base import Launch
from tfdist.jobspec import JobSpec
from tfdist.kube import names as kn

hub, users = test_k8s_tenancy.hub, test_k8s_tenancy.users  # the fixtures, shared
pytestmark = [pytest.mark.k8s, pytest.mark.usefixtures("private_agent_port")]


def start_server(tmp: Path, user: str, **env: str) -> Lab:
    """`jupyter server` for `user` (the panel's routes come from the installed jupyter-config file)."""
    root, state, runtime = tmp / "root", tmp / "state", tmp / "runtime"
    for d in (root, runtime):
        d.mkdir(parents=True, exist_ok=True)
    state.mkdir(mode=0o700, exist_ok=True)
    port, token = free_port(), secrets.token_hex(16)
    full_env = kernel_env(
        str(state),
        TFDIST_USER=user,
        TFDIST_BACKEND="kubernetes",
        TFDIST_WORKER_IMAGE=IMAGE,
        TFDIST_AGENT_PORT=str(kn.AGENT_PORT),  # the private port of this test (nothing serves it)
        JUPYTER_RUNTIME_DIR=str(runtime),
        **env,
    )
    with open(tmp / "jupyter.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter",
                "server",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={port}",
                "--ServerApp.port_retries=0",
                f"--ServerApp.token={token}",
                f"--ServerApp.root_dir={root}",
                "--allow-root",
            ],
            env=full_env,
            cwd=str(root),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    lab = Lab(f"http://127.0.0.1:{port}", token, root, state, runtime, proc)
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"jupyter server exited ({proc.returncode}):\n{(tmp / 'jupyter.log').read_text()}"
            )
        try:
            lab.api("api/status")
            return lab
        except OSError:
            if time.time() > deadline:
                lab.stop()
                raise RuntimeError(
                    f"jupyter server did not answer:\n{(tmp / 'jupyter.log').read_text()}"
                ) from None
            time.sleep(0.3)


def status_of(lab: Lab, path: str, method: str = "GET") -> int:
    try:
        lab.api(path, method, {} if method == "POST" else None)
    except urllib.error.HTTPError as e:
        return e.code
    return 200


async def test_each_users_panel_lists_and_stops_only_that_users_job_of_a_shared_name(
    k8s_plane,
    users,
    tmp_path,
):
    ann_ns, bob_ns = users["ann"], users["bob"]
    ann_kc = _user_kubeconfig(k8s_plane, ann_ns, tmp_path, "ann")
    bob_kc = _user_kubeconfig(k8s_plane, bob_ns, tmp_path, "bob")
    ann = _backend(k8s_plane, ann_kc, ann_ns, "ann", **GPU_ENV)  # the users' kernels
    bob = _backend(k8s_plane, bob_kc, bob_ns, "bob")
    labs: list[Lab] = []
    try:
        await ann.submit(JobSpec(name="same", user="ann", backend="kubernetes"), b"p", Launch())
        await bob.submit(JobSpec(name="same", user="bob", backend="kubernetes"), b"p", Launch())
        # Everything blocking runs off the event loop: the two backends are the users' kernels, and their
        # lifelines are renewed on it (blocked past the grace, the cluster would end both jobs).
        ann_lab = await asyncio.to_thread(
            start_server, tmp_path / "ann", "ann", KUBECONFIG=ann_kc, TFDIST_NAMESPACE=ann_ns, **GPU_ENV
        )
        labs.append(ann_lab)
        bob_lab = await asyncio.to_thread(
            start_server, tmp_path / "bob", "bob", KUBECONFIG=bob_kc, TFDIST_NAMESPACE=bob_ns
        )
        labs.append(bob_lab)

        for lab, who in ((ann_lab, "ann"), (bob_lab, "bob")):
            listed = await asyncio.to_thread(lab.api, "tfdist/api/jobs")
            assert listed["user"] == who
            assert [(j["name"], j["user"]) for j in listed["jobs"]] == [("same", who)], listed
            view = await asyncio.to_thread(lab.api, "tfdist/api/jobs/same")
            assert view["user"] == who and view["state"] not in ("stopped", "failed", "succeeded"), view

        bob_before = len(_left(k8s_plane, bob_ns, "same"))
        assert bob_before >= 4
        stopped = await asyncio.to_thread(ann_lab.api, "tfdist/api/jobs/same/stop", "POST", {})
        assert stopped["stopped"] is True and stopped["state"] == "stopped", stopped
        # ann's objects go (the garbage collector takes the children); bob's stay, untouched
        deadline = time.time() + 60
        while _left(k8s_plane, ann_ns, "same") and time.time() < deadline:
            await asyncio.sleep(0.5)
        assert _left(k8s_plane, ann_ns, "same") == []
        assert len(_left(k8s_plane, bob_ns, "same")) == bob_before
        bob_view = await asyncio.to_thread(bob_lab.api, "tfdist/api/jobs/same")
        assert bob_view["user"] == "bob" and bob_view["state"] not in ("stopped", "failed"), bob_view
        assert [j["name"] for j in (await asyncio.to_thread(bob_lab.api, "tfdist/api/jobs"))["jobs"]] == [
            "same"
        ]
        # ann's panel no longer has a job of that name, and cannot reach bob's through it
        assert (await asyncio.to_thread(ann_lab.api, "tfdist/api/jobs"))["jobs"] == []
        assert await asyncio.to_thread(status_of, ann_lab, "tfdist/api/jobs/same") == 404
        assert await asyncio.to_thread(status_of, ann_lab, "tfdist/api/jobs/same/stop", "POST") == 404
        assert len(_left(k8s_plane, bob_ns, "same")) == bob_before
    finally:
        for lab in labs:
            await asyncio.to_thread(lab.stop)
        await ann.close()
        await bob.stop("same")
        await bob.close()
