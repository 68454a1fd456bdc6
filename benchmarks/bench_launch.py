"""%%tfdist run against the bare PS launch (shared/baseline/bare_ps), in the same run, as ratios.

(a) launch-to-end-of-first-epoch and (b) steps/s after the first epoch, same model, data, epochs and
steps as the baseline coordinator; plus the sampler's own CPU cost per tick. Run:
    scripts/bench   (or: python benchmarks/bench_launch.py [--repeats N])
The %%tfdist side is timed from the magic's start (argument parsing, shipping, launch) in a real kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import bare_pods
from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

BASELINE = os.environ.get(
    "TFDIST_BASELINE", os.path.join(ROOT, "..", "shared", "baseline", "bare_ps", "run.sh")
)
EPOCHS, STEPS = 4, 200

KERNEL_SETUP = """
import os, time, json
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import tensorflow as tf
keras = tf.keras
%load_ext tfdist
model = keras.Sequential(
    [keras.layers.Input((32,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)]
)
model.compile(optimizer="sgd", loss="mse", steps_per_execution=10)
x = tf.random.normal((4096, 32), seed=1)
y = tf.reduce_sum(x, axis=1, keepdims=True)
ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)
"""

# The cell records epoch ends with the same callback as the baseline coordinator.
CELL = f"""%%tfdist run --workers 2 --ps 1 --name {{name}}
import time as _t
class Clock(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__(); self.ends = []
    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(_t.time())
clock = Clock()
hist = model.fit(ds, epochs={EPOCHS}, steps_per_epoch={STEPS}, verbose=0, callbacks=[clock])
ends = clock.ends
"""


def bare() -> dict:
    """One run.sh launch: its coordinator's JSON line, and from bare_pods.WRAPPER's marks (run.sh's PYTHON
    is a shell that runs its two files through it) seconds from LAUNCH_T0 to every task's TensorFlow
    imported, the strategy made and the fit called, and the fit's own first epoch (fit called -> the
    line's end of the first epoch): what no launch can cut."""
    with tempfile.TemporaryDirectory(prefix="tfdist-bare-") as tmp:
        py = os.path.join(tmp, "python")
        with open(py, "w") as f:
            f.write(
                "#!/bin/sh\n"
                'case "$1" in *coordinator.py | *server.py)\n'
                '  exec "$BARE_PYTHON" -c "$BARE_WRAPPER" "$@";;\n'
                "esac\n"
                'exec "$BARE_PYTHON" "$@"\n'
            )
        os.chmod(py, 0o700)
        marks_file = os.path.join(tmp, "marks")
        env = dict(
            os.environ, BARE_PYTHON=sys.executable, BARE_WRAPPER=bare_pods.WRAPPER, BARE_MARKS=marks_file
        )
        out = subprocess.run(
            ["bash", BASELINE, py, "2", "1", str(EPOCHS), str(STEPS)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        with open(marks_file) as f:
            marks = [json.loads(line[5:]) for line in f if line.startswith("BARE ")]
    return got | bare_phases(marks, got)


def bare_phases(marks: list[dict], got: dict) -> dict:
    """Seconds from the launch (the coordinator's LAUNCH_T0) to the last task's TensorFlow imported, the
    strategy made and the fit called; the fit's first epoch (fit called -> end of the first epoch)."""
    at: dict[str, list[float]] = {}
    for m in marks:
        at.setdefault(m["mark"], []).append(m["t"])
    if not at.get("launch") or not at.get("fit_start"):
        return {}
    t0 = at["launch"][0]
    fit = at["fit_start"][0] - t0
    return {
        "tf_imported_s": round(max(at.get("tf_imported", [t0])) - t0, 3),
        "strategy_s": round(at["servers"][0] - t0, 3) if at.get("servers") else None,
        "fit_start_s": round(fit, 3),
        "fit_first_epoch_s": round(got["launch_to_first_epoch_s"] - fit, 3),
    }


def tfdist_runs(repeats: int) -> list[dict]:
    from tests.kernels import Kernel, kernel_env

    state = tempfile.mkdtemp(prefix="tfdist-bench-")
    k = Kernel(kernel_env(state), cwd=state)
    try:
        r = k.execute(KERNEL_SETUP, timeout=300)
        assert r.error is None, r.error_text
        res = []
        for i in range(repeats):
            r = k.execute("_t0 = time.time()", timeout=30)
            r = k.execute(CELL.format(name=f"bench-{i}"), timeout=600)
            assert r.error is None, r.error_text
            r = k.execute(
                "print(json.dumps({'first': ends[0] - _t0, 'later': ends[-1] - ends[0]}))", timeout=30
            )
            d = json.loads(r.text.strip().splitlines()[-1])
            res.append(
                {
                    "launch_to_first_epoch_s": d["first"],
                    "steps_per_s_after_first_epoch": STEPS * (EPOCHS - 1) / d["later"],
                }
            )
        return res
    finally:
        k.shutdown()


def sampler_cost(ticks: int = 200) -> dict:
    """CPU seconds per sample() for 4 tasks (this process and 3 children), measured in-process."""
    import psutil

    from tfdist.sampler import TaskProcess, TaskSampler

    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        s = TaskSampler()
        for i, p in enumerate([os.getpid()] + [k.pid for k in kids]):
            s.track(TaskProcess(f"task-{i}", p))
        me = psutil.Process()
        c0, t0 = sum(me.cpu_times()[:2]), time.perf_counter()
        for _ in range(ticks):
            s.sample()
        c1, t1 = sum(me.cpu_times()[:2]), time.perf_counter()
        return {
            "cpu_ms_per_tick": 1000 * (c1 - c0) / ticks,
            "wall_ms_per_tick": 1000 * (t1 - t0) / ticks,
            "share_of_one_core_at_1hz": (c1 - c0) / ticks,
        }
    finally:
        for k in kids:
            k.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    bares, ours = [], []
    for _ in range(a.repeats):  # interleaved so drift hits both sides alike
        bares.append(bare())
        ours += tfdist_runs(1)
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    report = {
        "bare": {k: med(bares, k) for k in ("launch_to_first_epoch_s", "steps_per_s_after_first_epoch")},
        "tfdist": {k: med(ours, k) for k in ("launch_to_first_epoch_s", "steps_per_s_after_first_epoch")},
        "sampler": sampler_cost(),
        "runs": {"bare": bares, "tfdist": ours},
    }
    report["ratios"] = {
        "launch_to_first_epoch (tfdist/bare, target <= 1.15)": report["tfdist"]["launch_to_first_epoch_s"]
        / report["bare"]["launch_to_first_epoch_s"],
        "steps_per_s (tfdist/bare, target >= 0.95)": report["tfdist"]["steps_per_s_after_first_epoch"]
        / report["bare"]["steps_per_s_after_first_epoch"],
    }
    report["machine"] = machine()
    print(json.dumps(report, indent=2, default=lambda o: round(o, 3)))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "launch.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
