"""The warm pool (tfdist.backends.pool, runtime.warmpool): a kernel's next local job's tasks are forked
from a fork server that imported TensorFlow beforehand, behave as the first job's did, and nothing of the
pool outlives its kernel or stays when the server's memory is short."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import psutil
import pytest

from tests.kernels import Kernel, job_processes, kernel_env, wait_gone
from tfdist.backends import pool as poolmod
from tfdist.backends.pool import PoolKeeper, may_start
from tfdist.runtime.forked import import_time_mismatch
from tfdist.runtime.forkserver import IDLE_NAME

pytestmark = pytest.mark.slow

SETUP = """
import os, json, sys
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np, tensorflow as tf
%load_ext tfdist
x = np.random.RandomState(0).rand(512, 8).astype("float32"); y = x.sum(axis=1, keepdims=True)
ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
model = tf.keras.Sequential([tf.keras.layers.Input((8,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.05), loss="mse")
"""

# The cell reports what a fresh task would have: its TF_CONFIG, its inter-op threads setting (as Python and
# TensorFlow's C++ getenv see it), working directory and import path, oom_score_adj, network namespace.
CELL = """%%tfdist run --workers {w} --ps 1 --name {name}
import os, sys, json, psutil, ctypes
history = model.fit(ds, epochs=1, steps_per_epoch=20, verbose=0)
_me = psutil.Process()
_getenv = ctypes.CDLL(None).getenv
_getenv.restype = ctypes.c_char_p
info = {{
    "pid": os.getpid(),
    "tf_config": json.loads(os.environ["TF_CONFIG"]),
    "env_inter": os.environ["TF_NUM_INTEROP_THREADS"],
    "c_inter": _getenv(b"TF_NUM_INTEROP_THREADS").decode(),  # what TensorFlow's C++ reads
    "cwd": os.getcwd(), "path0": sys.path[0],
    "oom": open("/proc/self/oom_score_adj").read().strip(),
    "netns": os.readlink("/proc/self/ns/net"),
    "stdin": os.readlink("/proc/self/fd/0"),
    "name": _me.name(),
}}
"""


def _run(k: Kernel, name: str, workers: int) -> dict:
    before = k.execute("w0 = [w.copy() for w in model.get_weights()]", timeout=30)
    assert before.error is None, before.error_text
    r = k.execute(CELL.format(name=name, w=workers), timeout=300)
    assert r.error is None, r.error_text
    r = k.execute(
        "print(json.dumps(info | {'changed': any(not np.allclose(a, b) "
        "for a, b in zip(w0, model.get_weights()))}))",
        timeout=30,
    )
    assert r.error is None, r.error_text
    return json.loads(r.text.strip().splitlines()[-1])


def _pool_state(state_dir: str, kernel_pid: int, timeout: float = 180) -> dict:
    """The kernel's pool record once its fork server has imported TensorFlow."""
    path = os.path.join(state_dir, f"{poolmod.STATE_PREFIX}{kernel_pid}.json")
    deadline = time.time() + timeout
    rec: dict = {}
    while time.time() < deadline:
        try:
            with open(path) as f:
                rec = json.load(f)
            if rec["forkserver"] and rec["ready"]:
                return rec
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no ready pool for kernel {kernel_pid}: {rec}")


def _forked(state_dir: str, name: str) -> dict[str, int]:
    """The tasks the job's supervisor forked, as its log says (PIDs)."""
    with open(os.path.join(state_dir, name, "supervisor.log")) as f:
        log = f.read()
    assert "starts fresh" not in log, log
    assert "Traceback" not in log, log  # a job that succeeded logs no error on its way out
    return {m[0]: int(m[1]) for m in re.findall(r"fork server: (\S+) is forked process (\d+)", log)}


def _ran_in_pool(state_dir: str, name: str, pool: dict) -> dict:
    """Job `name` succeeded, run by the supervisor of the pool whose record is `pool`; its state.json."""
    with open(os.path.join(state_dir, name, "state.json")) as f:
        st = json.load(f)
    assert st["state"] == "succeeded", st
    assert st["pid"] == pool["pid"], f"job {name} did not run in the pool's supervisor"
    return st


def _thread_names(p: psutil.Process) -> list[str]:
    out = []
    for t in p.threads():
        try:
            with open(f"/proc/{p.pid}/task/{t.id}/comm") as f:
                out.append(f.read().strip())
        except OSError:
            continue
    return out


def test_second_run_takes_the_pool_behaves_fresh_and_dies_with_the_kernel(tmp_path):
    state = str(tmp_path / "state")
    # the pool after a job: the first job fresh, to compare the pooled one with
    k = Kernel(kernel_env(state, TFDIST_POOL_SIZE="3", TFDIST_POOL_ON_LOAD="0"), cwd=str(tmp_path))
    try:
        # One core: TensorFlow's own inter-op pool would have 1 thread, the task env says 2 (taskenv):
        # a pooled process that ignored its env after import would show 1 (and deadlock PS training).
        os.sched_setaffinity(k.pid, {sorted(os.sched_getaffinity(0))[0]})
        assert k.execute(SETUP, timeout=180).error is None
        fresh = _run(k, "first", workers=2)  # 4 tasks, all fresh: no pool before the first job
        assert fresh["changed"]

        pool = _pool_state(state, k.pid)  # started after that job: one fork server
        assert not may_start(state, None, {"TFDIST_POOL_SIZE": "1"})[0]  # bounded: the server's pool is full
        assert may_start(state, None, {"TFDIST_POOL_SIZE": "2"})[0]
        server = psutil.Process(pool["forkserver"])
        assert server.ppid() == pool["pid"]
        # named as an idle pool while it waits (what tells it from a job), its own name back once a task
        assert {server.name(), psutil.Process(pool["pid"]).name()} == {IDLE_NAME}
        assert job_processes() == []  # no job runs: an idle pool is not one
        # no OpenMP runtime loaded at import: OMP_NUM_THREADS is read after the fork became the task
        maps = open(f"/proc/{server.pid}/maps").read()
        assert "libgomp" not in maps and "libiomp" not in maps
        # and no TensorFlow thread pool yet: every pool is made after the task's env is applied
        assert [t for t in _thread_names(server) if t.startswith("tf_")] == [], _thread_names(server)

        warm = _run(k, "second", workers=1)  # 3 tasks: every one forked from the pool's server
        assert warm["changed"], "the pooled job did not train"
        pids = _forked(state, "second")
        assert sorted(pids) == ["chief-0", "ps-0", "worker-0"], pids
        assert warm["pid"] == pids["chief-0"]
        assert warm["name"] != IDLE_NAME
        with open(os.path.join(state, "second", "state.json")) as f:
            assert json.load(f)["pid"] == pool["pid"]  # the pool's supervisor ran the job

        # exactly the task a fresh process is
        assert warm["tf_config"]["task"] == {"type": "chief", "index": 0}
        cluster = warm["tf_config"]["cluster"]
        assert len(cluster["worker"]) == 1 and len(cluster["ps"]) == 1
        # tf_Compute threads per task are not a pool's size: a task holds one inter-op pool per live context
        # (its server's, its eager context, remote contexts a chief opened) and names are inherited by
        # threads those start, so the counts vary with timing (4 to 13 in a FRESH job under load). What
        # the task env must decide is checked where it is exact: no pool exists in an idle fork server
        # (above), TensorFlow's getenv sees the task's value here, and test_a_forked_task_sizes_... below.
        assert warm["env_inter"] == fresh["env_inter"] == warm["c_inter"] == "2"
        for key in ("cwd", "path0", "oom", "stdin", "name"):
            assert warm[key] == fresh[key], key
        assert warm["cwd"] == str(tmp_path) and warm["oom"] == "800" and warm["stdin"] == "/dev/null"
        assert warm["netns"] != os.readlink("/proc/self/ns/net") != fresh["netns"] != warm["netns"]

        # the pool that follows dies with its kernel: nothing of it is left after a SIGKILL
        again = _pool_state(state, k.pid)
        owned = [again["pid"], again["forkserver"]]
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(owned, 15) == [], "pooled processes outlived their kernel"
        # and nothing else of it: once its kernel is gone, a pooled process left anywhere is a job process
        left = job_processes()
        assert wait_gone([p.pid for p in left], 5) == [], [p.info.get("cmdline") for p in left]
    finally:
        k.shutdown()


def _pool_record(state_dir: str, kernel_pid: int, timeout: float = 60) -> dict:
    """The kernel's pool record as soon as it exists (its fork server may still be importing TensorFlow)."""
    path = os.path.join(state_dir, f"{poolmod.STATE_PREFIX}{kernel_pid}.json")
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            time.sleep(0.05)
    raise TimeoutError(f"no pool for kernel {kernel_pid}")


# No fit, no model: the coordinator only runs the cell. Its stdout and stderr are the chief's log.
PLAIN = """%%tfdist run --workers 1 --ps 1 --name {name}
import sys, time
print("out of {name}")
print("err of {name}", file=sys.stderr)
time.sleep(2)
"""


def test_a_job_taken_while_the_pool_still_imports_runs_its_cell_and_logs_it(tmp_path):
    """The second job of a kernel, started at once after the first: its pool's fork server is still
    importing TensorFlow when the job comes. The tasks wait for it, run the cell and log it."""
    state = str(tmp_path / "state")
    k = Kernel(kernel_env(state, TFDIST_POOL_SIZE="3", TFDIST_POOL_ON_LOAD="0"), cwd=str(tmp_path))
    try:
        assert k.execute("%load_ext tfdist", timeout=60).error is None
        r = k.execute(PLAIN.format(name="first"), timeout=300)
        assert r.error is None, r.error_text
        rec = _pool_record(state, k.pid)  # started when the first job ended
        assert not rec["ready"], rec  # taken before TensorFlow is imported
        r = k.execute(PLAIN.format(name="second"), timeout=300)
        assert r.error is None, r.error_text
        st = _ran_in_pool(state, "second", rec)
        forked = _forked(state, "second")
        assert forked == {t: int(v["pid"]) for t, v in st["tasks"].items()}, (forked, st["tasks"])
        with open(os.path.join(state, "second", "logs", "chief-0.log")) as f:
            log = f.read()
        assert "out of second" in log and "err of second" in log, log

        # the "no job process left" checks: the idle pool of a living kernel is not a job, whether or not
        # its fork server finished importing (named tfdist-pool only then) ...
        again = _pool_record(state, k.pid)
        owned = {again["pid"], again["forkserver"]}
        assert {p.pid for p in job_processes()} & owned == set()
        # ... but once its kernel is gone, what is left of it is (a pool frozen so it cannot end itself)
        os.kill(again["pid"], signal.SIGSTOP)
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone([k.pid], 15) == []
        assert {p.pid for p in job_processes()} >= owned, "a kernel's orphaned pool was not seen"
        os.kill(again["pid"], signal.SIGKILL)  # its fork server follows (death signal)
        assert wait_gone(list(owned), 15) == []
    finally:
        k.shutdown()


SLOW_TAKE = """
import time
from tfdist.backends.pool import PoolKeeper
_take = PoolKeeper.take
def _slow_take(self, *args, **kwargs):
    proc = _take(self, *args, **kwargs)
    time.sleep(1.5)
    return proc
PoolKeeper.take = _slow_take
"""


def test_the_extension_load_starts_the_pool_for_the_first_job(tmp_path):
    """With the product's defaults, `%load_ext tfdist` starts the kernel's pool: its first job is forked
    from TensorFlow imported while the cell was written. Off with TFDIST_POOL_ON_LOAD=0, and where jobs
    run on Kubernetes (no local job would take it; the Kubernetes client's imports start instead)."""
    ks = []
    try:
        for name, extra in (
            ("off", {"TFDIST_POOL_ON_LOAD": "0"}),
            ("kube", {"TFDIST_BACKEND": "kubernetes"}),
        ):
            state = str(tmp_path / name)
            ks.append(k := Kernel(kernel_env(state, TFDIST_POOL_SIZE="3", **extra), cwd=str(tmp_path)))
            assert k.execute("%load_ext tfdist", timeout=60).error is None
            with pytest.raises(TimeoutError):
                _pool_record(state, k.pid, timeout=3)
            # where jobs run on Kubernetes, the load imports the client for the first job instead (in a
            # thread: the 3 s above were its time); a local kernel never loads it
            r = k.execute("import sys; print('kubernetes_asyncio.client' in sys.modules)", timeout=30)
            assert r.text.strip() == str(name == "kube"), (name, r.text)
        state = str(tmp_path / "state")
        ks.append(k := Kernel(kernel_env(state, TFDIST_POOL_SIZE="3"), cwd=str(tmp_path)))
        assert k.execute("%load_ext tfdist", timeout=60).error is None
        rec = _pool_record(state, k.pid, timeout=10)  # at once, before any job
        # what importing scikit-learn does to the kernel's environment meanwhile: read by no import here
        assert k.execute("import os; os.environ['KMP_INIT_AT_FORK'] = 'FALSE'", timeout=30).error is None
        r = k.execute(PLAIN.format(name="first"), timeout=300)
        assert r.error is None, r.error_text
        _ran_in_pool(state, "first", rec)  # the pool the load started
        assert sorted(_forked(state, "first")) == ["chief-0", "ps-0", "worker-0"]
        with open(os.path.join(state, "first", "supervisor.log")) as f:
            assert "a new fork server" not in f.read()

        # a variable TensorFlow's import reads, changed after the next pool started: that pool's
        # supervisor runs the job from a fork server of the job's environment, not a fresh process each
        again = _pool_record(state, k.pid)
        assert again["pid"] != rec["pid"]
        assert k.execute("os.environ['TF_ENABLE_ONEDNN_OPTS'] = '0'", timeout=30).error is None
        # the kernel held up right after it handed the pool the job, as a loaded machine may hold it: the
        # pool's first lines are in the job's log by then, and nothing the kernel does next may cut them
        assert k.execute(SLOW_TAKE, timeout=30).error is None
        r = k.execute(PLAIN.format(name="second"), timeout=300)
        assert r.error is None, r.error_text
        _ran_in_pool(state, "second", again)
        assert sorted(_forked(state, "second")) == ["chief-0", "ps-0", "worker-0"]
        with open(os.path.join(state, "second", "supervisor.log")) as f:
            log = f.read()
        assert "its import differs from the job's (TF_ENABLE_ONEDNN_OPTS): a new fork server" in log, log

        # and the pool it leaves for the next job dies with the kernel, as every pool does
        again = _pool_record(state, k.pid)
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone([again["pid"], again["forkserver"] or again["pid"]], 15) == []
    finally:
        for k in ks:
            k.shutdown()


PROBE = """
import json, os, sys
import tensorflow as tf
tf.constant(1.0) + 1  # the eager context and its inter-op pool are made now
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps({"inter": names.count("tf_Compute"), "argv": sys.argv, "main": __name__}), flush=True)
"""


# Run in its own process: the driver becomes a child subreaper, as a supervisor does.
THREADS_DRIVER = """
import asyncio, json, os, sys
from tfdist.runtime.forked import ForkServer, import_env

async def main():
    extras, core = json.loads(sys.argv[1]), int(sys.argv[2])
    env = import_env({k: v for k, v in os.environ.items() if k != "TF_NUM_INTEROP_THREADS"})
    fs = await ForkServer.start(env, lambda: os.sched_setaffinity(0, {core}))
    for extra in extras:  # one task at a time, each forked from the same server
        task = await fs.spawn("probe", "probe", ["a1"], env | extra, os.getcwd(), ())
        print((await task.stdout.read()).decode(), flush=True)
        print(json.dumps({"code": await task.wait()}), flush=True)
    fs.close()

asyncio.run(main())
"""


def test_a_forked_task_sizes_tensorflow_pools_from_its_task_env(tmp_path):
    """Exact: one process, one eager context, one inter-op pool of TF_NUM_INTEROP_THREADS threads (or
    TensorFlow's own size for its one core, 1, without it), though its fork server imported TensorFlow
    before it had any task environment. Both tasks are forked from one server (one TensorFlow import)."""
    import subprocess
    import sys

    (tmp_path / "probe.py").write_text(PROBE)
    cases = ["3", ""]  # TF_NUM_INTEROP_THREADS in the task's env; "": not set
    extras = [{"TF_NUM_INTEROP_THREADS": threads} if threads else {} for threads in cases]
    one_core = sorted(os.sched_getaffinity(0))[0]
    out = subprocess.run(
        [sys.executable, "-c", THREADS_DRIVER, json.dumps(extras), str(one_core)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 2 * len(cases), out
    # and it runs as `python -m probe a1` would: argv[0] the module's file, as __main__
    want_argv = [str(tmp_path / "probe.py"), "a1"]
    for i, threads in enumerate(cases):
        seen, end = lines[2 * i], lines[2 * i + 1]
        assert end == {"code": 0}, (threads, out)
        assert seen == {"inter": int(threads or 1), "argv": want_argv, "main": "__main__"}, (threads, out)


def test_memory_short_server_gets_no_pool_and_an_idle_pool_goes_first(tmp_path, monkeypatch):
    state = str(tmp_path)
    me = psutil.Process()
    before = {c.pid for c in me.children()}  # this worker's own (a control plane of other tests, say)
    used = memory_used(me.pid)  # what the keeper counts: this worker and every child it has now
    # no room for one pooled process under 70% of the limit: no pool, nothing started
    monkeypatch.setenv("MEM_LIMIT", str(used + poolmod.FORKSERVER_BYTES))
    keeper = PoolKeeper(state)
    launch = {"TFDIST_SERVER_PID": str(me.pid)}
    env = dict(os.environ) | {"TFDIST_POOL_SIZE": "1"}
    assert not keeper.start([], launch, env)
    assert "memory is short" in keeper.last_refusal and keeper.proc is None
    assert [c for c in me.children() if c.pid not in before] == []

    # room for one: it starts, and when the server's use grows past warmpool.DROP_SHARE it ends itself
    limit = int((used + 2 * poolmod.FORKSERVER_BYTES) / 0.75)
    monkeypatch.setenv("MEM_LIMIT", str(limit))
    env["MEM_LIMIT"] = str(limit)
    monkeypatch.setenv("TFDIST_POOL_SIZE", "1")
    try:
        assert keeper.start([], launch, env)
        rec = _pool_state(state, os.getpid())
        owned = [rec["pid"], rec["forkserver"]]
        ballast = bytearray(int(0.85 * limit) - memory_used(me.pid))  # the kernel grows
        ballast[::4096] = b"x" * len(ballast[::4096])  # touched: resident
        assert wait_gone(owned, 15) == [], "an idle pool stayed while the server's memory was short"
        with open(os.path.join(state, f"{poolmod.STATE_PREFIX}{os.getpid()}.log")) as f:
            assert "memory" in f.read()
        del ballast
    finally:
        keeper.drop()


def memory_used(pid: int) -> int:
    from tfdist.memfit import tree_rss

    return tree_rss(pid)


def test_tasks_whose_start_environment_differs_start_fresh():
    zyg = {"PATH": "/bin", "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1"}
    task = zyg | {"TF_CONFIG": "{}", "TF_NUM_INTEROP_THREADS": "2", "OMP_NUM_THREADS": "1"}
    assert import_time_mismatch(zyg, task) == []  # read after the fork became the task
    assert import_time_mismatch(zyg, task | {"TF_CPP_MIN_LOG_LEVEL": "2"}) == []  # the default both use
    assert import_time_mismatch(zyg, task | {"PYTHONPATH": "/x"}) == ["PYTHONPATH"]
    assert import_time_mismatch(zyg, task | {"TF_CPP_MIN_LOG_LEVEL": "0", "LD_PRELOAD": "a.so"}) == [
        "LD_PRELOAD",
        "TF_CPP_MIN_LOG_LEVEL",
    ]
    assert poolmod.configured({"TFDIST_POOL_SIZE": "2", "TFDIST_POOL_MEMORY": "1.5Gi"}) == (2, 3 * 2**29)
    assert poolmod.configured({"TFDIST_POOL_SIZE": "-1", "TFDIST_POOL_MEMORY": "lots"}) == (
        poolmod.DEFAULT_SIZE,
        poolmod.DEFAULT_MEMORY,
    )
    assert may_start("/nonexistent", None, {"TFDIST_POOL_SIZE": "0"}) == (
        False,
        "the server's pool is full (TFDIST_POOL_SIZE=0, TFDIST_POOL_MEMORY=3221225472, 0 pooled)",
    )
