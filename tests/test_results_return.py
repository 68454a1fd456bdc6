"""Results never fail a cell that trained (issue 27): in a real kernel, a `%%tfdist run` cell that binds
callbacks holding the notebook's model (a custom callback of the notebook, EarlyStopping), over a model
with a custom layer, ends without a traceback; the callbacks come back pointing at the notebook's own model,
and every name the cell bound after the fit is assigned. Before, the callbacks dragged the coordinator's
model back as a `.keras` archive that the kernel's Keras could not read ("Cannot deserialize object of
type ..."), and the names after them were never set."""

from __future__ import annotations

import pickle

import pytest

from tests.conftest import SETUP_CODE
from tests.kernels import Kernel, kernel_env
from tfdist import payload

pytestmark = pytest.mark.slow

NOTEBOOK = """
class Scale(tf.keras.layers.Layer):
    def __init__(self, factor=0.5, **kw):
        super().__init__(**kw)
        self.factor = factor
    def call(self, x):
        return x * self.factor
    def get_config(self):
        return {**super().get_config(), "factor": self.factor}

class Seen(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = 0
    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1

cmodel = tf.keras.Sequential([tf.keras.layers.Input((64,)), Scale(), tf.keras.layers.Dense(10)])
cmodel.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.1),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
"""

CELL = """%%tfdist run --workers 1 --ps 1 --name callbacks
seen = Seen()
stop = tf.keras.callbacks.EarlyStopping(monitor="loss", patience=5)
hist = cmodel.fit(train_ds, epochs=2, steps_per_epoch=4, callbacks=[seen, stop])
opt = cmodel.optimizer
after = "assigned"
"""


def test_bound_callbacks_come_back_to_the_notebooks_model(tmp_path):
    k = Kernel(kernel_env(str(tmp_path / "state")), cwd=str(tmp_path))
    try:
        assert k.execute(SETUP_CODE, timeout=240).error is None
        assert k.execute(NOTEBOOK, timeout=60).error is None
        r = k.execute(CELL, timeout=300)
        assert r.error is None, r.error_text
        assert "Traceback" not in r.text, r.text
        check = k.execute(
            "print(seen.epochs, seen.model is cmodel, stop.model is cmodel, hist.model is cmodel,"
            " opt is cmodel.optimizer, after)",
            timeout=60,
        )
        assert check.error is None, check.error_text
        assert check.text.strip().splitlines()[-1] == "2 True True True True assigned", check.text
    finally:
        k.shutdown()


class _Unbuildable:
    """A value whose rebuilding fails in the kernel (as a Keras object of an unknown class would)."""

    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise TypeError("Cannot deserialize object of type Mystery")


def test_a_value_that_cannot_be_rebuilt_is_named_and_the_rest_assigned():
    """In this process: the coordinator's results with one value the kernel cannot rebuild."""
    models: dict = {}
    ns = {"bad": _Unbuildable(), "good": [1, 2, 3]}
    res = pickle.loads(payload.pack_results(ns, ["bad", "good"], models))
    kernel_ns: dict = {}
    out = payload.apply_results(pickle.dumps(res), kernel_ns)
    assert kernel_ns == {"good": [1, 2, 3]}
    assert "Cannot deserialize object of type Mystery" in out.skipped["bad"], out.skipped
    assert "bad" not in out.values
