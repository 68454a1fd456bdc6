"""`%tfdist plan`'s predictions against measured `%%tfdist run` jobs on this machine (local backend).

Two models of very different compute-to-parameter ratios (a small dense model: ~5 k parameters; a wide
one: ~17 M parameters), each as PS with 1 and 2 PS and as all-reduce (2 workers), plus one worker. The
prediction is what `%tfdist plan` would show in the same kernel (same measurement, same hardware
defaults); the measurement is steps/s of the cell's batch over the epochs after the first (start-up and
tracing excluded). Run:  nice python benchmarks/bench_advisor.py  -> benchmarks/results/advisor.json
All-reduce runs with the dataset batched N x the cell's batch, as the plan's run line asks.
"""

from __future__ import annotations

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
x = np.random.RandomState(0).rand(4096, 64).astype("float32"); y = (np.arange(4096) % 10).astype("int64")
def data(batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
train_ds = data(64)
train_ds2 = data(128)
def build(width, depth):
    layers = [tf.keras.layers.Input((64,))]
    layers += [tf.keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    m = tf.keras.Sequential(layers + [tf.keras.layers.Dense(10)])
    m.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.01),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m
small = build(64, 1)
wide = build(4096, 2)
"""

# steps per epoch and epochs per model: about 10-20 s of training each on 2 cores
MODELS = {"small": (200, 3), "wide": (6, 3)}
LAYOUTS = [
    ("single", "--workers 1 --ps 1", "train_ds", 1),
    ("ps1", "--workers 2 --ps 1", "train_ds", 1),
    ("ps2", "--workers 2 --ps 2", "train_ds", 1),
    ("allreduce", "--strategy allreduce --workers 2", "train_ds2", 2),
]

CELL = """%%tfdist run {flags} --name bench-{tag}
class _T(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None): self.t = []
    def on_epoch_end(self, epoch, logs=None): self.t.append(time.time())
_cb = _T()
{model}.fit({data}, epochs={epochs}, steps_per_epoch={steps}, callbacks=[_cb], verbose=0)
epoch_ends = list(_cb.t)
del _cb, _T
"""


def predictions(kernel, model: str, steps: int) -> dict[str, float]:
    r = kernel.execute(f"%tfdist plan {model} train_ds --workers 2 --steps-per-epoch {steps}", timeout=300)
    assert r.error is None, r.error_text
    out = {}
    for line in r.text.splitlines():
        for label, key in (
            ("1 worker, 1 PS", "single"),
            ("2 workers, 1 PS", "ps1"),
            ("2 workers, 2 PS", "ps2"),
            ("all-reduce, 2 workers", "allreduce"),
        ):
            if line.startswith(label):
                out[key] = float(line[len(label) :].split()[0])
    return out | {"text": r.text.split("<IPython")[0]}


def measure(kernel, model: str, tag: str, flags: str, data: str, scale: int, steps: int, epochs: int):
    cell = CELL.format(flags=flags, tag=tag, model=model, data=data, epochs=epochs, steps=steps)
    r = kernel.execute(cell, timeout=900)
    assert r.error is None, r.error_text
    r = kernel.execute("print(json.dumps(epoch_ends))", timeout=30)
    ends = json.loads(r.text.strip())
    per_epoch = (ends[-1] - ends[0]) / (len(ends) - 1)
    return steps * scale / per_epoch  # steps of the cell's batch per second


def main() -> int:
    from tests.kernels import Kernel, kernel_env

    state = tempfile.mkdtemp(prefix="tfdist-bench-")
    k = Kernel(kernel_env(state), cwd=tempfile.mkdtemp())
    results: dict[str, dict] = {}
    try:
        r = k.execute(SETUP, timeout=300)
        assert r.error is None, r.error_text
        for model, (steps, epochs) in MODELS.items():
            pred = predictions(k, model, steps)
            plan_text = pred.pop("text")
            print(plan_text, flush=True)
            rows: dict = {"plan": plan_text}
            for key, flags, data, scale in LAYOUTS:
                t0 = time.time()
                got = measure(k, model, f"{model}-{key}", flags, data, scale, steps, epochs)
                rows[key] = {
                    "predicted_steps_s": round(pred[key], 3),
                    "measured_steps_s": round(got, 3),
                    "predicted_over_measured": round(pred[key] / got, 3),
                    "wall_s": round(time.time() - t0, 1),
                }
                print(model, key, rows[key], flush=True)
            results[model] = rows
    finally:
        k.shutdown()
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "advisor.json"), "w") as f:
        json.dump({"machine": machine(), "t": time.time(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
