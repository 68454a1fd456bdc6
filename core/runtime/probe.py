"""Measure a model on one device for `%tfdist plan`: a short-lived process, never the kernel (the kernel's
own TensorFlow stays untouched, and nothing connects to a cluster).

Usage: python -m tfdist.runtime.probe BUNDLE OUT_JSON MODEL_NAME DATA_NAME

Loads the named model and dataset from a `tfdist.payload` bundle, trains a few steps (the first ones
trace the graph and are not counted), and writes JSON: step time, batch, each variable's bytes in creation
order, trainable bytes. On failure it writes {"error": ...}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from tfdist.settings import KernelSettings

WARMUP_STEPS = 3
MAX_STEPS = 30
MAX_MEASURE_S = KernelSettings().probe_seconds


def _batch_size(batch: Any) -> int:
    import tensorflow as tf

    first = tf.nest.flatten(batch)[0]
    return int(first.shape[0])


def measure(model: Any, dataset: Any) -> dict[str, Any]:
    """Median step time of the model's own train step on batches of the dataset."""
    it = iter(dataset)  # a tf.data iterator, as fit passes it (input time included, as in fit)
    fn = model.make_train_function()
    batch = _batch_size(next(iter(dataset.take(1))))
    for _ in range(WARMUP_STEPS):  # the first traces the step function
        fn(it)
    times: list[float] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    t_end = time.perf_counter() + MAX_MEASURE_S
    while len(times) < MAX_STEPS and (len(times) < 5 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        out = fn(it)
        for v in out.values():  # wait for the step's result, not just its dispatch
            v.numpy()
        times.append(time.perf_counter() - t0)
    cores_used = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
    times.sort()
    variables = list(model.variables)
    return {
        "step_s": times[len(times) // 2],
        "steps_timed": len(times),
        "cores_used": round(cores_used, 2),
        "batch": batch,
        "var_bytes": [int(v.shape.num_elements() * v.dtype.size) for v in variables],
        "var_names": [v.name for v in variables],
        "grad_bytes": int(sum(v.shape.num_elements() * v.dtype.size for v in model.trainable_variables)),
        "params": int(sum(v.shape.num_elements() for v in model.trainable_variables)),
    }


def main(argv: list[str]) -> int:
    bundle_path, out_path, model_name, data_name = argv
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import cloudpickle

        from tfdist import payload
        from tfdist.taskenv import ensure_threads

        ensure_threads()
        with open(bundle_path, "rb") as f:
            bundle = payload.unpack(f.read())
        custom = cloudpickle.loads(bundle.custom_objects) if bundle.custom_objects else {}
        model = payload.decode(*bundle.entries[model_name], custom)
        dataset = payload.decode(*bundle.entries[data_name], custom)
        result: dict[str, Any] = measure(model, dataset)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
