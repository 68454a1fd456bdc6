"""The example's digits model and data packed as a `%%tfdist run` cell's payload, for tests that drive the
job's entry points (pods' or the supervisor's) without a kernel."""

from __future__ import annotations

import os

from tfdist import payload


def digits_payload(src: str) -> tuple[bytes, dict]:
    """(payload, namespace) of the cell `src` over a small digits model `model` and a dataset `ds`; the
    namespace is where the job's results land (payload.apply_results)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16).astype("float32"), d.target.astype("int64")
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Input((64,)),
            tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=tf.keras.optimizers.legacy.SGD(0.1),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)
    ns = {"model": model, "ds": ds}
    return payload.pack(src, ["model", "ds"], ns), ns
