"""The warm pool (tfdist.backends.pool, runtime.warmpool, runtime.zygote): a kernel's next local job starts
in processes that imported TensorFlow beforehand, behaves as fresh processes would, and nothing of the pool
outlives its kernel or stays when the server's memory is short."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from tests.kernels import Kernel, job_processes, kernel_env, wait_gone
from tfdist.backends import pool as poolmod
from tfdist.backends.pool import PoolKeeper, plan_size
from tfdist.runtime.warmpool import import_time_mismatch
from tfdist.runtime.zygote import IDLE_NAME

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

# The cell reports what a fresh task would have: its TF_CONFIG, inter-op pools (threads named tf_Compute)
# of itself and of its sibling tasks, working directory and import path, oom_score_adj, network namespace.
CELL = """%%tfdist run --workers {w} --ps 1 --name {name}
import os, sys, json, psutil
history = model.fit(ds, epochs=1, steps_per_epoch=20, verbose=0)
def _pools(p):
    names = [open(f"/proc/{{p.pid}}/task/{{t.id}}/comm").read().strip() for t in p.threads()]
    return names.count("tf_Compute")
_me = psutil.Process()
info = {{
    "pid": os.getpid(),
    "tf_config": json.loads(os.environ["TF_CONFIG"]),
    "inter": {{str(p.pid): _pools(p) for p in [_me, *_me.parent().children()]}},
    "env_inter": os.environ["TF_NUM_INTEROP_THREADS"],
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
    """The kernel's pool record once every zygote has imported TensorFlow."""
    path = os.path.join(state_dir, f"{poolmod.STATE_PREFIX}{kernel_pid}.json")
    deadline = time.time() + timeout
    rec: dict = {}
    while time.time() < deadline:
        try:
            with open(path) as f:
                rec = json.load(f)
            if rec["zygotes"] and rec["ready"] == len(rec["zygotes"]):
                return rec
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no ready pool for kernel {kernel_pid}: {rec}")


def _task_pids(state_dir: str, name: str) -> dict[str, int]:
    with open(os.path.join(state_dir, name, "state.json")) as f:
        return {t: int(v["pid"]) for t, v in json.load(f)["tasks"].items()}


def _pools_by_role(info: dict, pids: dict[str, int]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for task, pid in pids.items():
        out.setdefault(task.split("-")[0], set()).add(info["inter"][str(pid)])
    return out


def test_second_run_takes_the_pool_behaves_fresh_and_dies_with_the_kernel(tmp_path):
    state = str(tmp_path / "state")
    k = Kernel(kernel_env(state, TFDIST_POOL_SIZE="3"), cwd=str(tmp_path))
    try:
        # One core: TensorFlow's own inter-op pool would have 1 thread, the task env says 2 (taskenv):
        # a pooled process that ignored its env after import would show 1 (and deadlock PS training).
        os.sched_setaffinity(k.pid, {sorted(os.sched_getaffinity(0))[0]})
        assert k.execute(SETUP, timeout=180).error is None
        fresh = _run(k, "first", workers=2)  # 4 tasks, all fresh: no pool before the first job
        assert fresh["changed"]

        pool = _pool_state(state, k.pid)  # started after that job, bounded by TFDIST_POOL_SIZE=3
        assert len(pool["zygotes"]) == 3
        assert plan_size(4, state, None, {"TFDIST_POOL_SIZE": "3"})[0] == 0  # the server's pool is full
        zygotes = [psutil.Process(p) for p in pool["zygotes"]]
        assert all(z.ppid() == pool["pid"] for z in zygotes)
        # named as an idle pool while it waits (what tells it from a job), its own name back once a task
        assert {z.name() for z in zygotes} | {psutil.Process(pool["pid"]).name()} == {IDLE_NAME}
        assert job_processes() == []  # no job runs: an idle pool is not one
        for z in zygotes:  # no OpenMP runtime loaded at import: OMP_NUM_THREADS is read after becoming
            maps = open(f"/proc/{z.pid}/maps").read()
            assert "libgomp" not in maps and "libiomp" not in maps

        warm = _run(k, "second", workers=1)  # 3 tasks: every one a pooled process
        assert warm["changed"], "the pooled job did not train"
        pids = _task_pids(state, "second")
        assert sorted(pids.values()) == sorted(pool["zygotes"]), (pids, pool)
        assert warm["pid"] == pids["chief-0"]
        with open(os.path.join(state, "second", "state.json")) as f:
            assert json.load(f)["pid"] == pool["pid"]  # the pool's supervisor ran the job

        # exactly the task a fresh process is
        assert warm["tf_config"]["task"] == {"type": "chief", "index": 0}
        cluster = warm["tf_config"]["cluster"]
        assert len(cluster["worker"]) == 1 and len(cluster["ps"]) == 1
        # TensorFlow's inter-op pools (tf_Compute threads) per role are those of the fresh job: sized by
        # TF_NUM_INTEROP_THREADS=2 from the task env, set after the zygote's import
        roles = {
            "fresh": _pools_by_role(fresh, _task_pids(state, "first")),
            "warm": _pools_by_role(warm, pids),
        }
        assert roles["warm"] == roles["fresh"] and len(roles["warm"]) == 3, roles
        assert warm["env_inter"] == fresh["env_inter"] == "2"
        for key in ("cwd", "path0", "oom", "stdin", "name"):
            assert warm[key] == fresh[key], key
        assert warm["cwd"] == str(tmp_path) and warm["oom"] == "800" and warm["stdin"] == "/dev/null"
        assert warm["netns"] != os.readlink("/proc/self/ns/net") != fresh["netns"] != warm["netns"]

        # the pool that follows dies with its kernel: nothing of it is left after a SIGKILL
        again = _pool_state(state, k.pid)
        owned = [again["pid"], *again["zygotes"]]
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(owned, 15) == [], "pooled processes outlived their kernel"
    finally:
        k.shutdown()


def _pool_record(state_dir: str, kernel_pid: int, timeout: float = 60) -> dict:
    """The kernel's pool record as soon as it exists (its zygotes may still be importing TensorFlow)."""
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
    """The second job of a kernel, started at once after the first: its pool's zygotes are still importing
    TensorFlow when they are handed the tasks (the pool has closed its end of their sockets by the time
    they say they are ready). They must run the cell, not exit 0 with empty logs."""
    state = str(tmp_path / "state")
    k = Kernel(kernel_env(state, TFDIST_POOL_SIZE="3"), cwd=str(tmp_path))
    try:
        assert k.execute("%load_ext tfdist", timeout=60).error is None
        r = k.execute(PLAIN.format(name="first"), timeout=300)
        assert r.error is None, r.error_text
        rec = _pool_record(state, k.pid)  # started when the first job ended
        assert rec["ready"] < len(rec["zygotes"]), rec  # handed out before TensorFlow is imported
        r = k.execute(PLAIN.format(name="second"), timeout=300)
        assert r.error is None, r.error_text
        with open(os.path.join(state, "second", "state.json")) as f:
            st = json.load(f)
        assert st["state"] == "succeeded", st
        assert st["pid"] == rec["pid"], "the job did not run in the pool's supervisor"
        assert sorted(int(t["pid"]) for t in st["tasks"].values()) == sorted(rec["zygotes"])
        with open(os.path.join(state, "second", "supervisor.log")) as f:
            assert f.read().count(" is pooled process ") == 3
        with open(os.path.join(state, "second", "logs", "chief-0.log")) as f:
            log = f.read()
        assert "out of second" in log and "err of second" in log, log
    finally:
        k.shutdown()


def test_memory_short_server_gets_no_pool_and_an_idle_pool_goes_first(tmp_path, monkeypatch):
    state = str(tmp_path)
    me = psutil.Process()
    used = me.memory_info().rss
    # no room for one pooled process under 70% of the limit: no pool, nothing started
    monkeypatch.setenv("MEM_LIMIT", str(used + poolmod.ZYGOTE_BYTES))
    keeper = PoolKeeper(state)
    launch = {"TFDIST_SERVER_PID": str(me.pid)}
    env = dict(os.environ) | {"TFDIST_POOL_SIZE": "1"}
    assert not keeper.start([], 4, launch, env)
    assert "memory is short" in keeper.last_refusal and keeper.proc is None and me.children() == []

    # room for one: it starts, and when the server's use grows past warmpool.DROP_SHARE it ends itself
    limit = int((used + 2 * poolmod.ZYGOTE_BYTES) / 0.75)
    monkeypatch.setenv("MEM_LIMIT", str(limit))
    env["MEM_LIMIT"] = str(limit)
    monkeypatch.setenv("TFDIST_POOL_SIZE", "1")
    try:
        assert keeper.start([], 4, launch, env)
        rec = _pool_state(state, os.getpid())
        assert len(rec["zygotes"]) == 1
        owned = [rec["pid"], *rec["zygotes"]]
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
    assert import_time_mismatch(zyg, task) == []  # read after the zygote became the task
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
    assert plan_size(3, "/nonexistent", None, {"TFDIST_POOL_SIZE": "0"})[0] == 0
