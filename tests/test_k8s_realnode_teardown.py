"""`scripts/cluster` takes the one-machine cluster down completely: after kill -9 of everything, after an
`up` that failed midway, and it refuses to start on a taken port. These tests leave the cluster DOWN, so
tests/conftest.py runs this module last among the cluster tests (after it, a test needing the cluster
would wait for a fresh `up`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import realnode
from tests.realnode_fixtures import realnode_cli

pytestmark = [pytest.mark.k8s, pytest.mark.realnode, pytest.mark.takes_cluster_down]
REPO = Path(__file__).resolve().parents[1]


NOTHING = {
    "processes": [],
    "mounts": [],
    "links": [],
    "chains": [],
    "ipsets": [],
    "log_links": [],
    "routes": [],
}


def _nothing_left(before: dict) -> None:
    left = realnode.leftovers()
    assert left == NOTHING, left
    assert not Path(realnode.STATE).exists()
    for k, v in before["sysctls"].items():
        assert realnode.read_sysctl(k) == v, k


def test_half_started_cluster_is_replaced_by_up(real_cluster):
    state = realnode.load_state()
    (kubelet,) = [p for p in state["procs"] if p["name"] == "kubelet"]
    os.kill(kubelet["pid"], signal.SIGKILL)
    time.sleep(0.5)
    r = realnode_cli("status", timeout=60)
    assert r.returncode == 3 and "half-started" in r.stdout, r.stdout
    r = realnode_cli("up", timeout=300)
    assert r.returncode == 0 and "half-started" in r.stderr, r.stderr
    assert realnode.status()["healthy"]
    real_cluster.ensure()


def test_down_after_kill_9_of_everything_leaves_nothing(real_cluster, real_ns):
    before = json.loads((realnode.STATE / "machine-before.json").read_text())
    real_cluster.pod(real_ns, "sleeper", "import time; time.sleep(600)")
    real_cluster.wait_pod(real_ns, "sleeper", ("Running",))
    victims = realnode.our_processes(realnode.load_state())
    assert any(p.name == "kubelet" for p in victims) and any("shim" in p.name for p in victims), victims
    # everything the shims run (every pod's pause sandbox and containers, this test's and earlier ones'):
    # none of it names the state directory, so only this list can tell that it is gone after `down`
    contained = [c for p in victims if "shim" in p.name for c in _descendants(p.pid)]
    shown = {c.pid: " ".join(c.info["cmdline"]) for c in contained}
    assert any("time.sleep(600)" in cmd for cmd in shown.values()), shown
    assert any("pause" in cmd for cmd in shown.values()), shown
    for p in victims:
        os.kill(p.pid, signal.SIGKILL)
    time.sleep(1)
    r = realnode_cli("down", timeout=300)
    assert r.returncode == 0, r.stderr
    _nothing_left(before)
    # a container whose shim died is gone too (runc killed it)
    alive = [c for c in contained if _alive(c)]
    assert alive == [], {c.pid: shown[c.pid] for c in alive}
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "time.sleep(600)" not in ps


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.info = {"cmdline": k.cmdline() or [k.name()]}
    return [k for k in kids if hasattr(k, "info")]


def _alive(p: psutil.Process) -> bool:
    """The same process (is_running compares its start time: a PID may be reused), not a zombie."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_up_refuses_a_taken_port_and_starts_nothing():
    if realnode.load_state():
        with realnode.locked():
            realnode.down()
    before = realnode.machine_record()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", realnode.API_PORT))
        s.listen()
        r = realnode_cli("up", timeout=300)
    assert r.returncode == 1 and f"port {realnode.API_PORT} (kube-apiserver) is taken" in r.stderr, r.stderr
    assert r.stdout == ""
    left = realnode.leftovers()
    assert left == NOTHING, left
    assert realnode.machine_record()["sysctls"] == before["sysctls"]


def test_build_images_rejects_unknown_images_and_import_without_a_cluster(tmp_path):
    script = str(REPO / "k8s" / "build_images.py")
    r = subprocess.run([sys.executable, script, "job", "gpu"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown image gpu (base, job, notebook, hub, proxy)" in r.stderr, r.stderr
    sock = str(tmp_path / "none.sock")
    r = subprocess.run(
        [sys.executable, script, "base", "--import", "--containerd", sock],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "start the cluster first (scripts/cluster up)" in r.stderr, r.stderr


def test_up_that_fails_midway_undoes_everything(tmp_path):
    """A component that dies during up (here a kubelet that exits at once): a clear message naming it,
    and nothing half-running or half-changed afterwards."""
    if realnode.load_state():
        with realnode.locked():
            realnode.down()
    if realnode.missing_node_binaries():
        pytest.skip("node binaries missing (scripts/build-k8s --node)")
    real = realnode.node_bin_dir()
    for b in realnode.NODE_BINARIES:
        (tmp_path / b).symlink_to(real / b)
    (tmp_path / "kubelet").unlink()
    (tmp_path / "kubelet").write_text("#!/bin/sh\necho 'kubelet: broken on purpose' >&2\nexit 1\n")
    (tmp_path / "kubelet").chmod(0o755)
    shutil.copy2(real.parent / "pause", tmp_path.parent / "pause")  # the sandbox binary lives beside bin/
    before = realnode.machine_record()
    r = realnode_cli("up", timeout=300, env={"TFDIST_K8S_NODE_BIN": str(tmp_path)})
    assert r.returncode == 1, r.stderr
    assert "kubelet exited while waiting for node Ready" in r.stderr and "broken on purpose" in r.stderr
    assert r.stdout == ""
    assert realnode.leftovers() == NOTHING
    assert realnode.machine_record()["sysctls"] == before["sysctls"]
