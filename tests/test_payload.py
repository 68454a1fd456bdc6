"""Shipping: which names a cell needs, and that each kind survives the trip (in this process; no cluster)."""

from __future__ import annotations

import os
import threading

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np
import pytest

from tfdist import payload
from tfdist.errors import ShippingError


def test_cell_names_reads_and_binds():
    src = "import math\nh = model.fit(ds, epochs=n)\nf = lambda z: z + k\nout = [scale * v for v in h]\n"
    names = payload.cell_names(src)
    assert names.binds == ["math", "h", "f", "out"]
    assert {"model", "ds", "n", "k", "scale"} <= set(names.reads)
    assert "v" not in names.reads and "z" not in names.reads


def test_a_name_the_cell_binds_before_any_use_is_not_shipped():
    # re-running this cell must not ship the last run's callback and History (each holds the whole model)
    src = "clock = Clock()\nhist = model.fit(ds, callbacks=[clock])\nends = clock.ends\nprint(hist)\n"
    assert payload.cell_names(src).reads == ["Clock", "model", "ds", "print"]
    # a bind that may not happen, or that reads the name first, keeps the notebook's value
    assert "cb" in payload.cell_names("if fresh:\n    cb = C()\nmodel.fit(callbacks=[cb])\n").reads
    assert "x" in payload.cell_names("x = x + 1\n").reads
    assert "a" in payload.cell_names("a[0] = 1\n").reads
    assert "b" in payload.cell_names("a, *b = 1, 2, 3\nprint(b)\n").reads
    assert "cb" in payload.cell_names("def f():\n    return cb\nf()\ncb = 1\n").reads
    assert "f" not in payload.cell_names("def f():\n    return 1\nf()\n").reads


def test_a_name_updated_in_place_is_read():
    # symtable does not count `n += 1` as a use of n: the coordinator would raise NameError
    assert payload.cell_names("n += 1\n").reads == ["n"]
    assert payload.cell_names("def f():\n    global n\n    n += 1\nf()\n").reads == ["n"]
    assert payload.cell_names("def f():\n    m = 0\n    m += 1\n").reads == []


def test_undefined_names_ignore_builtins_and_cell_bindings():
    names = payload.cell_names("a = b + len(c)\nprint(a)\n")
    assert payload.undefined_names(names, {"c": [1]}) == ["b"]


def test_syntax_error_is_raised_with_its_line():
    with pytest.raises(SyntaxError) as ei:
        payload.cell_names("x = 1\ny = (\n")
    assert ei.value.lineno == 2


def test_plain_values_and_notebook_functions_round_trip():
    def scale(v):
        return v * 2

    ns = {"arr": np.arange(5), "scale": scale}
    bundle = payload.unpack(payload.pack("out = scale(arr)", ["arr", "scale"], ns))
    got = {k: payload.decode(*bundle.entries[k]) for k in bundle.entries}
    assert got["scale"](got["arr"]).tolist() == [0, 2, 4, 6, 8]


def test_unpicklable_variable_is_named_with_a_hint():
    with pytest.raises(ShippingError) as ei:
        payload.encode("lock", threading.Lock())
    assert "'lock'" in str(ei.value) and "create it inside the %%tfdist cell" in str(ei.value)


def test_dataset_survives_as_its_graph_including_repeat_and_map():
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(np.arange(6)).map(lambda v: v * 10).repeat().batch(4)
    back = payload.decode(*payload.encode("ds", ds))
    batches = [b.numpy().tolist() for b in back.take(3)]
    assert batches == [[0, 10, 20, 30], [40, 50, 0, 10], [20, 30, 40, 50]]


def test_dataset_with_py_function_gets_a_clear_message():
    import tensorflow as tf

    ds = tf.data.Dataset.range(3).map(lambda v: tf.py_function(lambda a: a, [v], tf.int64))
    with pytest.raises(ShippingError, match="cannot be serialized"):
        payload.encode("ds", ds)


def test_keras_model_travels_with_weights_and_compile_config():
    import tensorflow as tf

    m = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(2)])
    m.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.05), loss="mse")
    kind, data = payload.encode("m", m)
    assert kind == "keras_model"
    back = payload.decode(kind, data)
    for a, b in zip(m.get_weights(), back.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert back.optimizer.get_config()["learning_rate"] == pytest.approx(0.05)
    assert back.loss == "mse"


def test_a_shipped_value_that_holds_a_shipped_model_holds_the_decoded_model():
    import tensorflow as tf

    m = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(2)])
    m.compile(optimizer="sgd", loss="mse")
    cb = tf.keras.callbacks.History()
    cb.set_model(m)
    holder = {"model": m, "opt": m.optimizer}
    bundle = payload.unpack(
        payload.pack("fit(cb, holder, m)", ["cb", "holder", "m"], {"cb": cb, "holder": holder, "m": m})
    )
    assert list(bundle.entries) == ["m", "cb", "holder"]  # the model first: the others refer to it
    got: dict = {}
    for name, (kind, data) in bundle.entries.items():
        got[name] = payload.decode(kind, data, None, got)
    # the one model the job trains, not a copy each: a callback of it sees the training
    assert got["cb"].model is got["m"] and got["holder"]["model"] is got["m"]
    assert got["holder"]["opt"] is got["m"].optimizer


def test_results_put_weights_into_the_same_model_object_and_rebuild_history():
    import tensorflow as tf

    m = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(2)])
    trained = tf.keras.models.clone_model(m)
    trained.set_weights([w + 1 for w in m.get_weights()])
    hist = tf.keras.callbacks.History()
    hist.set_model(trained)
    hist.history, hist.epoch, hist.params = {"loss": [2.0, 1.0]}, [0, 1], {"epochs": 2}
    blob = payload.pack_results(
        {"model": trained, "history": hist, "n": 3}, ["history", "n"], {"model": trained}
    )
    ns = {"model": m}
    res = payload.apply_results(blob, ns)
    assert ns["model"] is m
    np.testing.assert_array_equal(m.get_weights()[1], trained.get_weights()[1])
    assert ns["history"].history == {"loss": [2.0, 1.0]} and ns["history"].model is m
    assert ns["n"] == 3 and res.skipped == {}
