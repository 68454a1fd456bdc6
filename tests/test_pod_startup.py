"""A job pod's start-up under its CPU limit (issue 26): the pod entry point's own imports stay light, and a
server pod's TensorFlow server is waited for before the sampler and the agent link take CPU beside it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.kube_plane import free_port
from tfdist.runtime import podmain


def test_the_pod_entry_point_imports_neither_pydantic_nor_aiohttp():
    """What every pod runs first (before its TF server or coordinator starts) loads no event records,
    pydantic or aiohttp: in a 0.45-core pod those cost ~0.7 s of the path to the first epoch."""
    code = (
        "import sys, tfdist.runtime.podmain\n"
        "print([m for m in ('pydantic', 'aiohttp', 'tfdist.job.events', 'psutil', 'tensorflow') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_wait_serving_returns_once_the_server_listens():
    port = free_port()
    server = (
        "import socket, time\ntime.sleep(1.0)\ns = socket.socket()\n"
        f"s.bind(('0.0.0.0', {port}))\ns.listen()\ntime.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", server])
    try:
        t0 = time.monotonic()
        assert podmain.wait_serving(proc, port, timeout=20)
        waited = time.monotonic() - t0
        assert 0.8 < waited < 10, waited  # it waited for the listen, and not for the timeout
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_wait_serving_gives_up_when_the_server_dies_or_never_listens():
    port = free_port()
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    t0 = time.monotonic()
    assert not podmain.wait_serving(dead, port, timeout=30)
    assert time.monotonic() - t0 < 10 and dead.returncode == 3
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        t0 = time.monotonic()
        assert not podmain.wait_serving(silent, port, timeout=1.0)
        assert 0.9 < time.monotonic() - t0 < 5
    finally:
        silent.kill()
        silent.wait()


def test_a_server_pod_knows_its_own_port_from_tf_config(monkeypatch):
    cluster = {"chief": ["c:1"], "worker": ["w0:2222", "w1:2223"], "ps": ["p:2224"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    assert podmain._own_port() == 2223
    monkeypatch.setenv("TF_CONFIG", "{}")
    assert podmain._own_port() is None


def test_the_collector_is_paused_for_the_import_and_restored_as_it_was():
    import gc

    from tfdist.runtime.importing import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
    try:
        with collector_paused():
            raise KeyError("an import that fails")
    except KeyError:
        pass
    assert gc.isenabled()
