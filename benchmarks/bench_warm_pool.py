"""A repeated %%tfdist run (warm pool) against the bare PS launch (shared/baseline/bare_ps), same run, ratios.

A kernel with no pool at load (TFDIST_POOL_ON_LOAD=0) runs the cell once: its supervisor's own fork
server imports TensorFlow (the first run, fresh). A kernel with the product's defaults runs it once right
after `%load_ext tfdist` (the first run, its pool started at the load), waits until the pool that follows
has imported TensorFlow, then each repeat times the bare launch and a pooled run, interleaved. Reported:
cell start -> fit start and -> end of the first epoch (the baseline's own measure: 200 steps of the same
model and data) for each run, the bare launch's launch -> end of the first epoch, their ratios, and what
the pool costs while it waits: RSS, PSS and USS of its idle fork server. The bare launch's phases come
from bare_pods.WRAPPER's marks (bench_launch.bare); its fit's own first epoch (called -> ended, on servers
already up) is what no launch can cut: the floor of every ratio here.
Run: python benchmarks/bench_warm_pool.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_launch import EPOCHS, KERNEL_SETUP, STEPS, bare  # noqa: E402

CELL = f"""%%tfdist run --workers 2 --ps 1 --name {{name}}
import time as _t
class Clock(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__(); self.ends = []; self.begin = None
    def on_train_begin(self, logs=None):
        self.begin = _t.time()
    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(_t.time())
clock = Clock()
hist = model.fit(ds, epochs={EPOCHS}, steps_per_epoch={STEPS}, verbose=0, callbacks=[clock])
ends, begin = clock.ends, clock.begin
"""


def _run(k, name: str) -> dict:
    r = k.execute("_t0 = time.time()", timeout=30)
    r = k.execute(CELL.format(name=name), timeout=600)
    assert r.error is None, r.error_text
    r = k.execute(
        "print(json.dumps({'begin': begin - _t0, 'first': ends[0] - _t0, 'later': ends[-1] - ends[0]}))",
        timeout=30,
    )
    d = json.loads(r.text.strip().splitlines()[-1])
    return {
        "cell_to_fit_start_s": d["begin"],
        "launch_to_first_epoch_s": d["first"],
        "steps_per_s_after_first_epoch": STEPS * (EPOCHS - 1) / d["later"],
    }


def _ready_pool(state: str, kernel_pid: int, timeout: float = 300) -> dict:
    from tfdist.backends.pool import STATE_PREFIX

    path = os.path.join(state, f"{STATE_PREFIX}{kernel_pid}.json")
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            with open(path) as f:
                rec = json.load(f)
            if rec["forkserver"] and rec["ready"]:
                return rec | {"waited_s": time.time() - t0}
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError("the pool did not become ready")


def _idle_memory(rec: dict) -> dict:
    import psutil

    time.sleep(2)  # settled after the last import
    mib = 2**20
    server = psutil.Process(rec["forkserver"]).memory_full_info()
    sup = psutil.Process(rec["pid"]).memory_full_info()
    return {
        "forkserver_rss_mib": round(server.rss / mib),
        "forkserver_pss_mib": round(server.pss / mib),
        "forkserver_uss_mib": round(server.uss / mib),
        "warm_supervisor_rss_mib": round(sup.rss / mib),
        "pool_rss_total_mib": round((server.rss + sup.rss) / mib),
        "pool_pss_total_mib": round((server.pss + sup.pss) / mib),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    from tests.kernels import Kernel, kernel_env

    # A kernel's first run with no pool (TFDIST_POOL_ON_LOAD=0: the supervisor imports TensorFlow then)
    fresh_state = tempfile.mkdtemp(prefix="tfdist-bench-fresh-")
    k = Kernel(kernel_env(fresh_state, TFDIST_POOL_SIZE="4", TFDIST_POOL_ON_LOAD="0"), cwd=fresh_state)
    try:
        r = k.execute(KERNEL_SETUP, timeout=300)
        assert r.error is None, r.error_text
        first = _run(k, "fresh-0")
    finally:
        k.shutdown()
    # The product's default: the pool starts at `%load_ext tfdist`, here at once before the first cell
    # (KERNEL_SETUP loads it after its own TensorFlow import): the least head start a user can give it
    state = tempfile.mkdtemp(prefix="tfdist-bench-pool-")
    k = Kernel(kernel_env(state, TFDIST_POOL_SIZE="4"), cwd=state)
    bares, warm, pools = [], [], []
    try:
        r = k.execute(KERNEL_SETUP, timeout=300)
        assert r.error is None, r.error_text
        first_loaded = _run(k, "first-0") | {"pooled_tasks": _pooled_any(state, "first-0")}
        for i in range(a.repeats):
            pool = _ready_pool(state, k.pid)
            if i == 0:
                memory = _idle_memory(pool)
            pools.append(pool["waited_s"])
            bares.append(bare())
            warm.append(_run(k, f"warm-{i}") | {"pooled_tasks": _pooled(state, f"warm-{i}", pool)})
    finally:
        k.shutdown()
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    report = {
        "bare": {
            k: med(bares, k)
            for k in (
                "launch_to_first_epoch_s",
                "steps_per_s_after_first_epoch",
                "tf_imported_s",
                "fit_start_s",
                "fit_first_epoch_s",
            )
        },
        "warm": {
            k: med(warm, k)
            for k in ("cell_to_fit_start_s", "launch_to_first_epoch_s", "steps_per_s_after_first_epoch")
        },
        "first_run_fresh": first,
        "first_run_pool_from_load": first_loaded,
        "pool_idle_memory": memory,
        "pool_ready_wait_s": pools,
        "runs": {"bare": bares, "warm": warm},
    }
    report["ratios"] = {
        "repeated run first epoch (warm/bare, target <= 0.5)": report["warm"]["launch_to_first_epoch_s"]
        / report["bare"]["launch_to_first_epoch_s"],
        "repeated run fit start (warm cell->fit start / bare launch->first epoch)": report["warm"][
            "cell_to_fit_start_s"
        ]
        / report["bare"]["launch_to_first_epoch_s"],
        "steps_per_s (warm/bare)": report["warm"]["steps_per_s_after_first_epoch"]
        / report["bare"]["steps_per_s_after_first_epoch"],
        "first run, no pool (fresh/bare, goal <= 0.35)": first["launch_to_first_epoch_s"]
        / report["bare"]["launch_to_first_epoch_s"],
        "first run, pool from the extension's load (/bare)": first_loaded["launch_to_first_epoch_s"]
        / report["bare"]["launch_to_first_epoch_s"],
        # what no launch cuts: the bare coordinator's own fit, called -> end of its first epoch, on servers
        # already up (tracing the train function, the per-worker datasets, 200 steps)
        "floor: the bare fit's own first epoch (/bare launch)": report["bare"]["fit_first_epoch_s"]
        / report["bare"]["launch_to_first_epoch_s"],
        "warm fit's first epoch (fit start -> epoch end, /bare launch)": (
            report["warm"]["launch_to_first_epoch_s"] - report["warm"]["cell_to_fit_start_s"]
        )
        / report["bare"]["launch_to_first_epoch_s"],
    }
    report["machine"] = machine()
    print(json.dumps(report, indent=2, default=lambda o: round(o, 3)))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "warm_pool.json"), "w") as f:
        json.dump(report, f, indent=2)


def _pooled_any(state: str, name: str) -> int:
    """How many of the job's tasks were forked from a fork server (its supervisor's own or a pool's)."""
    with open(os.path.join(state, name, "supervisor.log")) as f:
        return f.read().count(" is forked process ")


def _pooled(state: str, name: str, pool: dict) -> int:
    """How many of the job's tasks were forked from the pool's server (its supervisor ran the job)."""
    with open(os.path.join(state, name, "state.json")) as f:
        if json.load(f).get("pid") != pool["pid"]:
            return 0
    with open(os.path.join(state, name, "supervisor.log")) as f:
        return f.read().count(" is forked process ")


if __name__ == "__main__":
    main()
