"""`%tfdist plan`'s predictions against measured `%%tfdist run` jobs on this machine (local backend).

Four model shapes (tiny dense: ~5 k parameters; wide dense: ~17 M; a small conv net; an embedding-heavy
model: one 12.8 MB table), each planned with `%%tfdist plan` over the very cell that is then run with
every layout the plan offers (one worker; 2 workers with 1 and 2 PS; all-reduce with 2 workers), all in
the same kernel and run. The cell runs as written under every layout: PS workers each take its batch,
all-reduce splits it over the replicas (the dataset's batch is the global one), as the plan assumes.
Measured: examples/s over the epochs after the first (start-up and tracing excluded), each layout in four
passes in mirrored order (A B C D, D C B A, D C B A, A B C D: a layout's place after the plan, or after a
heavier layout, weighs the same on every one, and so does a drift of the machine's pace over the minutes),
the passes' epochs pooled. Per model the file says predicted/measured per
layout, each pass's figure, and whether the recommended layout's measured examples/s is within 10 % of the
best measured one.

Run on a quiet machine:  nice python benchmarks/bench_advisor.py  -> benchmarks/results/advisor.json
A quick check that it works (not figures to publish):  python benchmarks/bench_advisor.py --small --out X
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

SETUP = """
import os, time, json
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np, tensorflow as tf
%load_ext tfdist
rs = np.random.RandomState(0)
y = (np.arange(4096) % 10).astype("int64")
inputs = {
    "dense": rs.rand(4096, 64).astype("float32"),
    "conv": rs.rand(4096, 32, 32, 3).astype("float32"),
    "ids": rs.randint(0, 50000, size=(4096, 16)).astype("int64"),
}
def data(kind, batch=64):
    return tf.data.Dataset.from_tensor_slices((inputs[kind], y)).repeat().batch(batch)
def compiled(layers):
    m = tf.keras.Sequential(layers)
    m.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.01),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m
L = tf.keras.layers
tiny = compiled([L.Input((64,)), L.Dense(64, activation="relu"), L.Dense(10)])
wide = compiled([L.Input((64,)), L.Dense(4096, activation="relu"), L.Dense(4096, activation="relu"),
                 L.Dense(10)])
conv = compiled([L.Input((32, 32, 3)), L.Conv2D(16, 3, activation="relu"), L.MaxPool2D(),
                 L.Conv2D(32, 3, activation="relu"), L.GlobalAveragePooling2D(), L.Dense(10)])
embed = compiled([L.Input((16,), dtype="int64"), L.Embedding(50000, 64), L.GlobalAveragePooling1D(),
                  L.Dense(64, activation="relu"), L.Dense(10)])
"""

# model -> (input kind, steps per epoch, epochs): 3-5 s of timed epochs a job on 2 quiet cores (the runs of
# 2026-12-04 timed 0.7-2.4 s a job, and one layout's two passes differed by up to 1.9x)
MODELS = {
    "tiny": ("dense", 200, 5),
    "wide": ("dense", 12, 4),
    "conv": ("conv", 60, 5),
    "embed": ("ids", 120, 5),
}
PASSES = 4  # A B C D, D C B A, D C B A, A B C D: every layout at the same mean place, linear drift or not
SMALL = {"tiny": ("dense", 40, 2), "wide": ("dense", 2, 2), "conv": ("conv", 6, 2), "embed": ("ids", 12, 2)}
LAYOUTS = {
    "1 worker, 1 PS": "--workers 1 --ps 1",
    "2 workers, 1 PS": "--workers 2 --ps 1",
    "2 workers, 2 PS": "--workers 2 --ps 2",
    "all-reduce, 2 workers": "--strategy allreduce --workers 2",
}
KEYS = dict(zip(LAYOUTS, ("single", "ps1", "ps2", "allreduce"), strict=True))  # job names

FIT = """class _T(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None): self.t = []
    def on_epoch_end(self, epoch, logs=None): self.t.append(time.time())
_cb = _T()
{model}.fit(data("{kind}"), epochs={epochs}, steps_per_epoch={steps}, callbacks=[_cb], verbose=0)
epoch_ends = list(_cb.t)
del _cb, _T
"""


def plan_rows(text: str) -> tuple[dict[str, float], str]:
    """Predicted examples/s per layout label, and the recommended layout's label, from the plan's table."""
    rows: dict[str, float] = {}
    for line in text.splitlines():
        for label in LAYOUTS:
            if line.startswith(label + " "):
                cols = line[len(label) :].split()
                rows[label] = float(cols[3] if len(cols) > 1 and cols[1] == "x" else cols[1])
    line = text.split("recommended: ")[1].split("\n")[0]
    best = next(label for label, flags in LAYOUTS.items() if line.endswith(flags))
    return rows, best


def measure(kernel, cell: str, tag: str, flags: str) -> tuple[float, int]:
    """Seconds of the epochs after the first, and how many there were."""
    r = kernel.execute(f"%%tfdist run {flags} --name bench-{tag}\n{cell}", timeout=900)
    assert r.error is None, r.error_text
    r = kernel.execute("print(json.dumps(epoch_ends))", timeout=30)
    ends = json.loads(r.text.strip())
    return ends[-1] - ends[0], len(ends) - 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="few steps: checks the script, not the advisor")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "advisor.json"))
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    ap.add_argument("--passes", type=int, default=PASSES, choices=range(1, 5), help="passes over the layouts")
    args = ap.parse_args()
    from tests.kernels import Kernel, kernel_env

    table = SMALL if args.small else MODELS
    state = tempfile.mkdtemp(prefix="tfdist-bench-")
    k = Kernel(kernel_env(state), cwd=tempfile.mkdtemp())
    results: dict[str, dict] = {}
    try:
        r = k.execute(SETUP, timeout=300)
        assert r.error is None, r.error_text
        for model in args.models.split(","):
            kind, steps, epochs = table[model]
            cell = FIT.format(model=model, kind=kind, epochs=epochs, steps=steps)
            r = k.execute(f"%%tfdist plan --workers 2\n{cell}", timeout=600)
            assert r.error is None, r.error_text
            text = r.text.split("<IPython")[0]
            print(text, flush=True)
            predicted, best = plan_rows(text)
            rows: dict = {"plan": text, "recommended": best, "layouts": {}}
            passes: dict[str, list[tuple[float, int, float]]] = {label: [] for label in LAYOUTS}
            order = list(LAYOUTS)
            for n, labels in enumerate((order, order[::-1], order[::-1], order)[: args.passes]):
                for label in labels:
                    t0 = time.time()
                    secs, epochs_timed = measure(k, cell, f"{model}-{KEYS[label]}-{n}", LAYOUTS[label])
                    passes[label].append((secs, epochs_timed, time.time() - t0))
                    print(model, label, n, round(steps * 64 * epochs_timed / secs, 1), flush=True)
            for label in LAYOUTS:
                # every layout's epoch is steps x the cell's batch examples
                got = steps * 64 * sum(e for _, e, _ in passes[label]) / sum(s for s, _, _ in passes[label])
                rows["layouts"][label] = {
                    "predicted_examples_s": predicted[label],
                    "measured_examples_s": round(got, 1),
                    "predicted_over_measured": round(predicted[label] / got, 3),
                    "passes_examples_s": [round(steps * 64 * e / s, 1) for s, e, _ in passes[label]],
                    "wall_s": [round(w, 1) for _, _, w in passes[label]],
                }
            measured = {label: row["measured_examples_s"] for label, row in rows["layouts"].items()}
            rows["recommended_within_10pct_of_best"] = measured[best] >= 0.9 * max(measured.values())
            results[model] = rows
    finally:
        k.shutdown()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"machine": machine(), "small": args.small, "t": time.time(), "results": results}, f, indent=1
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
