"""How long a PS job's cell takes after its fit's last callback, with and without TensorFlow removing the
fit's functions from the cluster's eager contexts (runtime.coordinator._keep_functions_registered).

One kernel with the product's defaults (warm pool) runs the launch benchmark's model and data
(benchmarks/bench_launch.py: --workers 2 --ps 1, 4 epochs x 200 steps) in pairs, interleaved: "remove"
puts TensorFlow's own `Context.remove_function` back in the coordinator (the cell does it before its
fit), "keep" runs the product as it is. Reported per run and as medians: the cell's start to its end, and
the fit's `on_train_end` to the fit's return and to the cell's end.
Run: python benchmarks/bench_fit_end.py [--pairs N]  -> benchmarks/results/fit_end.json
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

from bench_launch import EPOCHS, KERNEL_SETUP, STEPS  # noqa: E402

CELL = (
    "%%tfdist run --workers 2 --ps 1 --name {name}\n"
    "import time as _t\n"
    "{restore}\n"
    "class Clock(tf.keras.callbacks.Callback):\n"
    "    def on_train_end(self, logs=None):\n"
    "        self.te = _t.time()\n"
    "clock = Clock()\n"
    f"hist = model.fit(ds, epochs={EPOCHS}, steps_per_epoch={STEPS}, verbose=0, callbacks=[clock])\n"
    "te = clock.te\n"
    "ret = _t.time()\n"
)
RESTORE = (
    "from tensorflow.python.eager import context as _ctx\n"
    "_ctx.Context.remove_function = _ctx.Context._tfdist_tf_remove_function"
)


def main() -> int:
    from tests.kernels import Kernel, product_kernel_env

    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fit_end.json"))
    args = ap.parse_args()
    state = tempfile.mkdtemp()
    k = Kernel(product_kernel_env(state), cwd=state)
    runs: dict[str, list[dict]] = {"remove": [], "keep": []}
    try:
        r = k.execute(KERNEL_SETUP, timeout=300)
        assert r.error is None, r.error_text
        for i in range(args.pairs):
            for variant in ("remove", "keep"):
                time.sleep(8)  # the pool that follows each job imports TensorFlow
                t0 = time.time()
                cell = CELL.format(name=f"{variant}{i}", restore=RESTORE if variant == "remove" else "")
                r = k.execute(cell, timeout=600)
                t_end = time.time()
                assert r.error is None, r.error_text
                r = k.execute("print(json.dumps({'te': te, 'ret': ret}))", timeout=30)
                d = json.loads(r.text.strip().splitlines()[-1])
                runs[variant].append(
                    {
                        "cell_s": round(t_end - t0, 2),
                        "train_end_to_fit_return_s": round(d["ret"] - d["te"], 3),
                        "train_end_to_cell_end_s": round(t_end - d["te"], 2),
                    }
                )
                print(variant, runs[variant][-1], flush=True)
    finally:
        k.shutdown()
    med = {v: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for v, rows in runs.items()}
    report = {
        "median": med,
        "ratio_cell_keep_over_remove": round(med["keep"]["cell_s"] / med["remove"]["cell_s"], 2),
        "pairs": args.pairs,
        "runs": runs,
        "machine": machine(),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["median"]), report["ratio_cell_keep_over_remove"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
