"""A local job's fork server (runtime.forkserver, runtime.forked): tasks forked from one TensorFlow import
are the supervisor's own children, end, report and die as fresh ones do, and a forked job's tasks are
what a fresh job's are (checked against the same job with TFDIST_FORK_TASKS=0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.kernels import Kernel, kernel_env, wait_gone
from tests.test_warm_pool import SETUP, _run
from tfdist.runtime import forkserver
from tfdist.runtime.forked import fresh_start_reason

pytestmark = pytest.mark.slow

# Run in its own process: the driver becomes a child subreaper, as the supervisor does.
DRIVER = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys
    from tfdist.runtime.deathsig import die_with_parent
    from tfdist.runtime.forked import ForkServer, import_env

    async def main():
        env = import_env(dict(os.environ))
        fs = await ForkServer.start(env, die_with_parent(b"800"))
        out = {"server": fs.proc.pid}
        r, w = os.pipe()
        probe = await fs.spawn("probe", "probe", ["a", "b"], env | {"PROBE": "1", "X_FD": str(w)},
                               os.getcwd(), (w,))
        os.close(w)
        out["pid"] = probe.pid
        out["stdout"] = (await probe.stdout.read()).decode()
        out["code"] = await probe.wait()
        out["passed"] = os.read(r, 100).decode()
        sleeper = await fs.spawn("sleeper", "sleeper", [], env, os.getcwd(), ())
        out["sleeper"] = sleeper.pid
        print(json.dumps(out), flush=True)
        if sys.argv[1] == "kill":
            sleeper.kill()
            out["killed"] = await sleeper.wait()
            gpu = await fs.spawn("gpu", "probe", [], env | {"CUDA_VISIBLE_DEVICES": "0"}, os.getcwd(), ())
            out["gpu"] = gpu is None
            fs.close()
            out["server_code"] = await fs.proc.wait()
            print(json.dumps(out), flush=True)
        else:
            await asyncio.sleep(600)  # SIGKILLed by the test

    asyncio.run(main())
    """
)

PROBE = textwrap.dedent(
    """
    import json, os, sys
    os.write(int(os.environ["X_FD"]), b"through the passed fd")
    print(json.dumps({"ppid": os.getppid(), "argv": sys.argv[1:], "probe": os.environ.get("PROBE"),
                      "cwd": os.getcwd(), "path0": sys.path[0], "stdin": os.readlink("/proc/self/fd/0"),
                      "oom": open("/proc/self/oom_score_adj").read().strip(),
                      "tf": "tensorflow" in sys.modules, "name": __name__,
                      "keras_api": "tf_keras.api._v2.keras" in sys.modules,
                      "coordinator": "tfdist.runtime.coordinator" in sys.modules}))
    print("to stderr", file=sys.stderr)
    sys.exit(7)
    """
)


def _driver(tmp_path, mode: str) -> subprocess.Popen:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, mode], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )


def test_a_forked_task_is_the_supervisors_child_and_reports_like_a_fresh_one(tmp_path):
    d = _driver(tmp_path, "kill")
    try:
        out, _ = d.communicate(timeout=120)
    finally:
        d.kill()
    assert d.returncode == 0, out
    assert "tfdist fork server: gpu starts fresh: it has GPUs" in out
    assert "tfdist fork server: probe is forked process" in out
    first, final = (json.loads(line) for line in out.splitlines() if line.startswith("{"))
    lines = first["stdout"].splitlines()
    seen = json.loads(lines[0])
    assert seen["ppid"] == d.pid  # the driver's child, not the fork server's
    assert seen["argv"] == ["a", "b"] and seen["probe"] == "1" and seen["name"] == "__main__"
    assert seen["cwd"] == str(tmp_path) == seen["path0"]
    assert seen["stdin"] == "/dev/null" and seen["oom"] == "800"
    assert seen["tf"]  # forked after the import: TensorFlow is there already
    # and what a coordinator loads before its fit: tf.keras's API (loaded on first use) and its own modules
    assert seen["keras_api"] and seen["coordinator"]
    assert lines[1] == "to stderr"  # stdout and stderr both reach the task's log pipe
    assert first["code"] == 7 and first["passed"] == "through the passed fd"
    assert final["killed"] == -signal.SIGKILL
    assert final["gpu"] is True  # a task with GPUs starts fresh
    assert final["server_code"] == 0  # closed: it exits
    assert wait_gone([first["sleeper"], first["server"]], 5) == []


def test_forked_tasks_die_with_a_sigkilled_supervisor(tmp_path):
    d = _driver(tmp_path, "hold")
    try:
        first = json.loads(next(line for line in d.stdout if line.startswith("{")))
        assert psutil.Process(first["sleeper"]).ppid() == d.pid
        d.send_signal(signal.SIGKILL)
        d.wait(10)
        assert wait_gone([first["sleeper"], first["server"]], 10) == [], "a forked task outlived its owner"
    finally:
        d.kill()


def test_tasks_start_fresh_where_a_fork_would_differ():
    base = {"TF_USE_LEGACY_KERAS": "1", "PATH": "/usr/bin"}
    assert fresh_start_reason(base, base | {"TF_CONFIG": "{}", "TFDIST_TASK": "ps-0"}) is None
    assert "GPUs" in (fresh_start_reason(base, base | {"CUDA_VISIBLE_DEVICES": "0"}) or "")
    assert "MALLOC_ARENA_MAX" in (fresh_start_reason(base, base | {"MALLOC_ARENA_MAX": "2"}) or "")
    # Intel OpenMP's variables are read when its runtime loads, which TensorFlow's import does not do
    kmp = {"KMP_INIT_AT_FORK": "FALSE", "KMP_DUPLICATE_LIB_OK": "True"}
    assert fresh_start_reason(base, base | kmp) is None
    assert "TF_ENABLE_ONEDNN_OPTS" in (fresh_start_reason(base, base | {"TF_ENABLE_ONEDNN_OPTS": "0"}) or "")


def test_both_clients_messages_and_the_servers_answers_say_what_went_wrong():
    """The one protocol both clients speak (runtime.forked, runtime.probehelpers): the descriptors go out
    in the order the server takes them, an oversized task is refused before it is sent, and every answer
    is a PID or a reason."""
    data, passed = forkserver.request("m", ["a"], {"K": "v"}, "/w", 5, (7, 8), stdin=6)
    assert passed == [5, 6, 7, 8]
    assert json.loads(data) == {
        "module": "m",
        "argv": ["a"],
        "env": {"K": "v"},
        "cwd": "/w",
        "fds": [7, 8],
        "stdin": True,
    }
    data, passed = forkserver.request("m", [], {}, "/w", 5)
    assert passed == [5] and json.loads(data)["stdin"] is False
    with pytest.raises(ValueError, match="over the fork server's"):
        forkserver.request("m", [], {"K": "x" * forkserver.MAX_MESSAGE}, "/w", 5)
    assert forkserver.answer(b'{"pid": 12}') == 12
    assert forkserver.answer(b'{"error": "Resource temporarily unavailable"}') == (
        "Resource temporarily unavailable"
    )
    assert forkserver.answer(b"") == "the fork server is gone"
    assert forkserver.answer(b"{").startswith("the fork server's answer is unreadable")


def test_a_forked_job_trains_and_its_tasks_are_what_fresh_ones_are(tmp_path):
    """One kernel for the two jobs: its TensorFlow import is the slow part. A running forked job's tasks
    being the supervisor's children, its fork server gone and a SIGKILLed kernel ending them all is
    test_lifecycle's kernel-killed test (forked tasks are the default), not a third job here."""
    state = str(tmp_path / "state")
    k = Kernel(kernel_env(state, TFDIST_POOL_SIZE="0"), cwd=str(tmp_path))
    try:
        assert k.execute(SETUP, timeout=180).error is None
        assert k.execute("os.environ['TFDIST_FORK_TASKS'] = '0'").error is None
        fresh = _run(k, "fresh", workers=1)
        assert k.execute("del os.environ['TFDIST_FORK_TASKS']").error is None
        forked = _run(k, "forked", workers=1)
        assert fresh["changed"] and forked["changed"], "a job did not train"
        for key in ("cwd", "path0", "oom", "stdin", "name", "env_inter", "c_inter"):
            assert forked[key] == fresh[key], (key, forked, fresh)
        assert forked["tf_config"]["task"] == fresh["tf_config"]["task"] == {"type": "chief", "index": 0}
        # each job in a network namespace of its own (not the host's); the two ran one after the other, so
        # the kernel may give the second the first's freed inode number: that is no shared namespace
        host = os.readlink("/proc/self/ns/net")
        assert forked["netns"] != host and fresh["netns"] != host, (host, forked["netns"], fresh["netns"])
        with open(os.path.join(state, "forked", "supervisor.log")) as f:
            log = f.read()
        assert "starts fresh" not in log and log.count(" is forked process ") == 3, log  # all forked

    finally:
        k.shutdown()
