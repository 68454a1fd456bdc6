"""What a training step moves between a worker and its PS, as the plan's probe measures it (in this
process, real TensorFlow): an embedding's gradient is the rows the batch touched, a dense layer's is
whole. `%tfdist plan` predicted the embedding-heavy model in benchmarks/bench_advisor.py at 0.44-0.59 of
what it measured while it counted the 12.8 MB table as moved every step."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np

from tfdist.runtime import probe


def test_an_embedding_moves_the_rows_its_batch_touches_and_a_dense_layer_moves_whole():
    import tensorflow as tf

    L = tf.keras.layers
    model = tf.keras.Sequential(
        [L.Input((16,), dtype="int64"), L.Embedding(50000, 64), L.GlobalAveragePooling1D(), L.Dense(10)]
    )
    model.compile(
        optimizer=tf.keras.optimizers.legacy.SGD(0.01),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rs = np.random.RandomState(0)
    ids = rs.randint(0, 50000, size=(256, 16)).astype("int64")
    y = (np.arange(256) % 10).astype("int64")
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(64)
    moved = probe.step_bytes(model, ds)
    table = model.variables[0]
    assert table.shape == (50000, 64)
    # 64 examples x 16 ids: 1,024 rows of 64 float32 and their indices (as many, of the lookup's int type)
    rows = 64 * 16 * 64 * 4
    assert rows < moved[0] <= rows + 64 * 16 * 8, moved
    assert moved[1:] == [64 * 10 * 4, 10 * 4]
    assert moved[0] < table.shape.num_elements() * 4 / 10  # not the 12.8 MB table
    # the probe's whole answer: the gradients' bytes per step are the sparse ones
    got = probe.measure(model, ds)
    assert got.step_bytes == moved and got.grad_bytes == sum(moved)
    assert got.var_bytes[0] == 50000 * 64 * 4  # what the PS holds is still the whole table
